"""Imports flow one way (see `tidal/__init__.py`): a test over the AST of every module in
`platform/tidal`, function-level imports included, so that a circle hidden inside a function
still fails; at the scale of folders too, where two folders on one layer importing each other is a
circle that no module-level cycle shows. Imports under `if TYPE_CHECKING:` are left out: they never run, they only name types.
Also: Ray's private modules only in `tidal/ray_private.py`, and the driver never imports torch."""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import ROOT

PACKAGE = ROOT / "platform" / "tidal"
# Highest first; a module may import its own layer and any below it. `tidal.spec` stands beside
# all: every layer may import it, and it imports only the lowest layer.
LAYERS: list[tuple[str, ...]] = [
    ("tidal", "tidal.__main__", "tidal.cli", "tidal.testing"),
    ("tidal.launch", "tidal.exporter"),
    ("tidal.worker", "tidal.eval_best", "tidal.job_end"),
    ("tidal.worker.checkpoint",),
    ("tidal.tracking",),
    ("tidal.storage", "tidal.cluster"),
    ("tidal.lease", "tidal.admission"),
    ("tidal.fs", "tidal.exclusive", "tidal.azure_blob", "tidal.test_hooks", "tidal.gil", "tidal.errors", "tidal.output", "tidal.version", "tidal.ray_private", "tidal.redact",
     "tidal.ray_auth", "tidal.sites", "tidal.prices", "tidal.goodput", "tidal.jobs_api"),
]
SPEC = "tidal.spec"
ADAPTER = "tidal.ray_private"


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    path: Path
    line: int

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line} imports {self.target}"


@functools.cache
def tree_of(path: Path) -> ast.Module:
    """`path` parsed, once for every test here (the checks walk the same files many times)."""
    return ast.parse(path.read_text())


def modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        parts = list(p.relative_to(PACKAGE.parent).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside `if TYPE_CHECKING:` blocks."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def imports(name: str, path: Path, mods: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported module, line) for every import in `path`, resolved to absolute names: `from pkg
    import x` imports the module pkg.x if there is one, else pkg itself."""
    tree = tree_of(path)
    skip = _type_checking_nodes(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found += [(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base, node.lineno) for a in node.names]
    return found


@functools.cache  # parsing every module takes about a second; two tests read the same graph
def graph() -> list[Edge]:
    mods = modules()
    edges = {Edge(name, target, path, line) for name, path in mods.items()
             for target, line in imports(name, path, mods) if target in mods and target != name}
    return sorted(edges, key=lambda e: (e.source, e.line, e.target))


def layer_of(module: str) -> int | None:
    """0 for the top layer; None for the spec, which stands beside all."""
    if module == SPEC or module.startswith(SPEC + "."):
        return None
    best = None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > len(best[1])):
                best = (i, p)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS and to tidal/__init__.py's docstring")
    return best[0]


def against_the_flow(edge: Edge) -> bool:
    src, dst = layer_of(edge.source), layer_of(edge.target)
    if dst is None:
        return False  # anyone may import the spec
    if src is None:
        return dst != len(LAYERS) - 1  # the spec imports only the lowest layer
    return dst < src


def cycles(edges: list[Edge]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan)."""
    succ: dict[str, set[str]] = {}
    for e in edges:
        succ.setdefault(e.source, set()).add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(succ.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(succ):
        if v not in index:
            visit(v)
    return out


def test_the_module_graph_has_no_cycle():
    edges = graph()
    found = cycles(edges)
    detail = [" <-> ".join(c) + ": " + "; ".join(e.where() for e in edges if e.source in c and e.target in c)
              for c in found]
    assert not found, "import cycles:\n" + "\n".join(detail)


def test_imports_flow_down_the_layers():
    bad = [e.where() for e in graph() if against_the_flow(e)]
    assert not bad, "imports against the layer order (tidal/__init__.py):\n" + "\n".join(bad)


def folder(module: str) -> str:
    """The folder (tidal.admission) or top-level module (tidal.lease) that `module` belongs to."""
    return ".".join(module.split(".")[:2])


def two_way_folders(edges: list[Edge]) -> list[str]:
    """Each pair of folders that import each other, with the imports each way."""
    between: dict[tuple[str, str], list[Edge]] = {}
    for e in edges:
        if folder(e.source) != folder(e.target):
            between.setdefault((folder(e.source), folder(e.target)), []).append(e)
    return [f"{a} <-> {b}: " + "; ".join(e.where() for e in between[a, b] + between[b, a])
            for a, b in sorted(between) if a < b and (b, a) in between]


def test_no_two_folders_import_each_other():
    found = two_way_folders(graph())
    assert not found, "folders that import each other (put what both need below both):\n" + "\n".join(found)


def test_the_checker_sees_two_folders_importing_each_other():
    here = Path(__file__)
    planted = [Edge("tidal.admission.cloud", "tidal.cluster.prices", here, 1),
               Edge("tidal.cluster.check", "tidal.admission.quotas", here, 2),
               Edge("tidal.admission.actor", "tidal.admission.cloud", here, 3)]
    assert not cycles(planted)  # no module circle: only the folders go round
    found = two_way_folders([*graph(), *planted])
    assert len(found) == 1 and found[0].startswith("tidal.admission <-> tidal.cluster: ")
    assert not two_way_folders(planted[1:])


@functools.cache
def imported_names(path: Path) -> set[str]:
    """The names `path` binds by importing them (anywhere in it), not by defining them."""
    names = set()
    for node in ast.walk(tree_of(path)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def through_a_re_export(files: list[Path], mods: dict[str, Path]) -> list[tuple[Path, int, str, str]]:
    """(file, line, name, module) for each `from tidal.m import name` where m only imports `name` from
    elsewhere: a re-export. A package's `__init__` may gather names (tidal, tidal.spec are faces); a
    module holds its own."""
    found = []
    for path in files:
        for node in ast.walk(tree_of(path)):
            if not (isinstance(node, ast.ImportFrom) and node.module in mods and not node.level):
                continue
            home = mods[node.module]
            if home.name != "__init__.py":
                found += [(path, node.lineno, a.name, node.module) for a in node.names if a.name in imported_names(home)]
    return found


def test_each_name_is_imported_from_its_home():
    files = [*modules().values(), *sorted((ROOT / "benchmarks").glob("*.py"))]
    found = [f"{path.relative_to(ROOT)}:{line} imports {name} through {module}"
             for path, line, name, module in through_a_re_export(files, modules())]
    assert not found, "import these from the module that defines them:\n" + "\n".join(found)


def test_the_checker_sees_a_re_export(tmp_path):
    (tmp_path / "home.py").write_text("def helper(): ...\n")
    (tmp_path / "middle.py").write_text("from tidal.home import helper\n")
    (tmp_path / "user.py").write_text("from tidal.middle import helper\nfrom tidal.home import helper as h\n")
    mods = {f"tidal.{n}": tmp_path / f"{n}.py" for n in ("home", "middle", "user")}
    assert through_a_re_export([tmp_path / "user.py"], mods) == [(tmp_path / "user.py", 1, "helper", "tidal.middle")]


def test_the_checker_sees_a_cycle_and_an_upward_import():
    here = Path(__file__)
    edges = [Edge("tidal.worker.a", "tidal.cli", here, 1), Edge("tidal.cli", "tidal.worker.a", here, 2)]
    assert cycles(edges) == [["tidal.cli", "tidal.worker.a"]]
    assert [against_the_flow(e) for e in edges] == [True, False]
    assert against_the_flow(Edge("tidal.spec.job", "tidal.storage", here, 3))
    assert not against_the_flow(Edge("tidal.storage", "tidal.spec.job", here, 4))


def test_function_level_imports_are_seen(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import tidal.cli\n"
                 "def f():\n    from tidal.launch import jobs\n")
    names = [n for n, _ in imports("tidal.worker.m", f, modules())]
    assert "tidal.launch.jobs" in names and "tidal.cli" not in names


def test_ray_private_names_only_in_the_adapter():
    bad = []
    for name, path in modules().items():
        if name == ADAPTER:
            continue
        tree = tree_of(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ray"):
                targets = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                if t.startswith("ray") and any(p.startswith("_") for p in t.split(".")):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {t}")
    assert not bad, f"Ray's private names go through {ADAPTER} only:\n" + "\n".join(bad)


def test_tests_and_benchmarks_never_import_each_other():
    """Their shared harness lives in tidal.testing, which both may use."""
    bad = []
    for folder, other in (("tests", "benchmarks"), ("benchmarks", "tests")):
        for path in sorted((ROOT / folder).glob("*.py")):
            for node in ast.walk(tree_of(path)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
                bad += [f"{folder}/{path.name}:{node.lineno} imports {n}" for n in names if n.split(".")[0] == other]
    assert not bad, "\n".join(bad)


DRIVER_PROBE = """
import json, sys
from tidal.cli import main
import tidal.launch.trainer, tidal.launch.jobs, tidal.launch.stream_prep, tidal.worker, tidal.exporter.model
rc = main(["validate", "jobs/quickstart.yaml"])
print(json.dumps({"rc": rc, "heavy": sorted(m for m in ("torch", "deepspeed") if m in sys.modules)}))
"""


def test_the_driver_never_imports_torch():
    proc = subprocess.run([sys.executable, "-c", DRIVER_PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT / "platform"), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"rc": 0, "heavy": []}, got
