"""How far a restore wanders: the modules the code reachable from `restore()` crosses, read from the source.

`python benchmarks/restore_path.py [PLATFORM_DIR]` (default: this checkout's `platform/`; give an
older checkout's `platform/` to measure it the same way). A static walk, not a profile: it reads
every module of the `tidal` package under PLATFORM_DIR with `ast`, resolves each call in a function
to a function of the package (a name defined in the module or imported from another, `module.f`
for an imported module, `self.f` in a class, a class's `__init__`, and `__enter__`/`__exit__` of a
`with`; a package function passed as a value, as called), and walks depth-first from the worker's `restore` function, each function once, calls in
source order. Exceptions are not followed (raising one is no step of the path).

Printed, for the whole walk (every path a restore can take, same size or resized):
- `modules`: the distinct modules the walk enters, `restore`'s own included;
- `returns`: the call sites, in the functions reached, that call into another module (each call
  returns once to the module it left);
- `re-entries`: those of them that call into a module already on the walk's call stack below
  (A -> B -> A): control goes back into a module it left before that module's call has ended;
- `revisits`: the walk's steps (each function entered once) into another module that it had
  entered before: how often the path comes back to a module it left, not counting the return;
- `functions`: the functions reached.
"""

from __future__ import annotations

import ast
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

START = ("tidal.worker.checkpoint.restore", "tidal.worker.restore")  # the new home, then the old


@dataclass
class Module:
    name: str
    tree: ast.Module
    functions: dict[str, ast.AST] = field(default_factory=dict)  # "f" or "Class.f"
    classes: set[str] = field(default_factory=set)
    names: dict[str, tuple[str, str]] = field(default_factory=dict)  # local name -> (module, name)
    modules: dict[str, str] = field(default_factory=dict)  # local name -> module


def load(platform: Path) -> dict[str, Module]:
    out = {}
    root = platform / "tidal"
    for p in sorted(root.rglob("*.py")):
        parts = list(p.relative_to(platform).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = Module(name, ast.parse(p.read_text()))
    for m in out.values():
        for node in m.tree.body:
            if isinstance(node, ast.FunctionDef):
                m.functions[node.name] = node
            elif isinstance(node, ast.ClassDef):
                m.classes.add(node.name)
                for item in node.body:
                    if isinstance(item, ast.FunctionDef):
                        m.functions[f"{node.name}.{item.name}"] = item
        for node in ast.walk(m.tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tidal"):
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    if full in out:
                        m.modules[a.asname or a.name] = full
                    else:
                        m.names[a.asname or a.name] = (node.module, a.name)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in out:
                        m.modules[a.asname or a.name] = a.name
    return out


def is_error(mods: dict[str, Module], module: str, name: str) -> bool:
    return module == "tidal.errors" or name.endswith(("Error", "Full")) or name == "NotSliceable"


def callees(mods: dict[str, Module], m: Module, fn: ast.AST, cls: str | None) -> list[tuple[str, str]]:
    """(module, function) of each call in `fn`, in source order."""
    found: list[tuple[int, int, str, str]] = []

    def target(module: str, name: str, at: ast.AST, entering: bool) -> None:
        mod = mods.get(module)
        if mod is None or is_error(mods, module, name):
            return
        keys = []
        if name in mod.classes:
            keys = [f"{name}.__init__"] + ([f"{name}.__enter__", f"{name}.__exit__"] if entering else [])
        elif name in mod.functions:
            keys = [name]
        found.extend((at.lineno, at.col_offset + i, module, k) for i, k in enumerate(keys) if k in mod.functions)

    # A local chosen among modules (`by_range = zero3 if stage == 3 else zero12`): either.
    aliases: dict[str, list[str]] = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            options = [node.value.body, node.value.orelse] if isinstance(node.value, ast.IfExp) else [node.value]
            picked = [m.modules[o.id] for o in options if isinstance(o, ast.Name) and o.id in m.modules]
            if picked and len(picked) == len(options):
                aliases[node.targets[0].id] = picked
    withs = {id(item.context_expr) for node in ast.walk(fn) if isinstance(node, ast.With | ast.AsyncWith)
             for item in node.items}
    # A function named without being called here (`cut_for=repartition_zero3.cut`) is called by
    # whoever receives it: counted as a call from here.
    calls = {id(node.func) for node in ast.walk(fn) if isinstance(node, ast.Call)}
    for node in ast.walk(fn):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and id(node) not in calls \
                and node.value.id in m.modules and isinstance(node.ctx, ast.Load):
            mod = mods[m.modules[node.value.id]]
            if node.attr in mod.functions:
                target(mod.name, node.attr, node, False)
        if not isinstance(node, ast.Call):
            continue
        f, entering = node.func, id(node) in withs
        if isinstance(f, ast.Name):
            if f.id in m.functions or f.id in m.classes:
                target(m.name, f.id, node, entering)
            elif f.id in m.names:
                target(*m.names[f.id], node, entering)
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
            base = f.value.id
            if base in m.modules:
                target(m.modules[base], f.attr, node, entering)
            elif base in ("self", "cls") and cls and f"{cls}.{f.attr}" in m.functions:
                found.append((node.lineno, node.col_offset, m.name, f"{cls}.{f.attr}"))
            for module in aliases.get(base, ()):
                target(module, f.attr, node, entering)
    return [(mod, name) for _, _, mod, name in sorted(found)]


def walk(mods: dict[str, Module], start: tuple[str, str]) -> dict[str, int]:
    seen: set[tuple[str, str]] = set()
    entered: set[str] = set()
    counts = {"returns": 0, "re-entries": 0, "revisits": 0}

    def visit(key: tuple[str, str], stack: list[str]) -> None:
        seen.add(key)
        entered.add(key[0])
        m = mods[key[0]]
        cls = key[1].split(".")[0] if "." in key[1] else None
        for callee in callees(mods, m, m.functions[key[1]], cls):
            if callee[0] != key[0]:
                counts["returns"] += 1
                if callee[0] in stack[:-1]:
                    counts["re-entries"] += 1
            if callee in seen:
                continue
            if callee[0] != key[0] and callee[0] in entered:
                counts["revisits"] += 1
            visit(callee, stack + [callee[0]] if callee[0] != stack[-1] else stack)

    visit(start, [start[0]])
    return {"modules": len(entered), **counts, "functions": len(seen), "module_names": sorted(entered)}


def main(platform: Path) -> None:
    mods = load(platform)
    module = next(m for m in START if m in mods)
    print(json.dumps(walk(mods, (module, "restore")), indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "platform")
