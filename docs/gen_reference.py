"""Generate docs/spec-reference.md (from jobs/tidal-job.schema.json), docs/cli-reference.md (from
`tidal --help` and each command's) and the architecture map in docs/guide.md (from the first sentence
of each module's docstring). tests/test_docs_reference.py fails when a committed file differs.

    PYTHONPATH=platform python docs/gen_reference.py
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = ROOT / "jobs" / "tidal-job.schema.json"
SPEC_DOC = ROOT / "docs" / "spec-reference.md"
CLI_DOC = ROOT / "docs" / "cli-reference.md"
GUIDE = ROOT / "docs" / "guide.md"
PACKAGE = ROOT / "platform" / "tidal"
COMMAND = "PYTHONPATH=platform python docs/gen_reference.py"
HELP_WIDTH = "100"  # argparse wraps at $COLUMNS: fixed, so the file does not depend on the terminal


def _type(prop: dict[str, Any]) -> str:
    if "$ref" in prop:
        name = prop["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{name.lower()})"
    if "anyOf" in prop:
        return " or ".join(_type(p) for p in prop["anyOf"])
    if "enum" in prop:
        return " / ".join(f"`{json.dumps(v)}`" for v in prop["enum"])
    if "const" in prop:
        return f"`{json.dumps(prop['const'])}`"
    kind = prop.get("type", "any")
    if kind == "array" and "items" in prop:
        return f"list of {_type(prop['items'])}"
    if kind == "object" and isinstance(prop.get("additionalProperties"), dict):
        return f"map of {_type(prop['additionalProperties'])}"
    return str(kind)


LIMITS = (("minimum", ">= {}"), ("exclusiveMinimum", "> {}"), ("maximum", "<= {}"), ("exclusiveMaximum", "< {}"),
          ("minLength", "at least {} characters"), ("pattern", "matches `{}`"))


def _limits(prop: dict[str, Any]) -> str:
    found = [form.format(prop[key]) for key, form in LIMITS if key in prop]
    for alt in prop.get("anyOf", []):
        found += [form.format(alt[key]) for key, form in LIMITS if key in alt]
    return f" ({'; '.join(found)})" if found else ""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _fields(obj: dict[str, Any]) -> list[str]:
    required = set(obj.get("required", []))
    rows = ["| field | type | default | description |", "|---|---|---|---|"]
    for name, prop in obj.get("properties", {}).items():
        default = "(required)" if name in required else (
            f"`{_cell(json.dumps(prop['default']))}`" if "default" in prop else "")
        rows.append(f"| `{name}` | {_cell(_type(prop))} | {default} | {_cell(prop.get('description', '') + _limits(prop))} |")
    return rows


def spec_reference(schema: dict[str, Any]) -> str:
    out = [f"# Job spec reference\n\nGenerated from `jobs/tidal-job.schema.json` (`tidal schema`) by `{COMMAND}`;",
           "do not edit by hand. A job is one YAML file with these sections; `--set a.b=c` overrides any field.",
           f"\n## {schema.get('title', 'JobSpec')} (the top level)\n"]
    if schema.get("description"):
        out.append(_cell(schema["description"]) + "\n")
    out += _fields(schema)
    for name, obj in sorted(schema.get("$defs", {}).items()):
        out.append(f"\n## {name}\n")
        if obj.get("description"):
            out.append(obj["description"].strip() + "\n")
        out += _fields(obj)
    return "\n".join(out) + "\n"


def _commands(parser: argparse.ArgumentParser, path: list[str]) -> list[tuple[list[str], argparse.ArgumentParser]]:
    found = [(path, parser)]
    for action in parser._actions:  # argparse has no public walk of its subcommands
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _commands(sub, [*path, name])
    return found


def cli_reference() -> str:
    os.environ["COLUMNS"] = HELP_WIDTH
    from tidal.cli import _parser

    out = [f"# CLI reference\n\nGenerated from `tidal --help` and each command's `--help` by `{COMMAND}`;",
           "do not edit by hand."]
    for path, parser in _commands(_parser(), ["tidal"]):
        out += [f"\n## `{' '.join(path)}`\n", "```text", parser.format_help().rstrip(), "```"]
    return "\n".join(out) + "\n"


MAP_BEGIN = ("<!-- architecture map: generated from each module's docstring by "
             f"`{COMMAND}`; do not edit by hand -->")
MAP_END = "<!-- end of the architecture map -->"


def summary(path: Path) -> str:
    """A module's first docstring sentence (its first paragraph up to the first full stop), or
    ValueError naming the module: a module without a docstring would be missing from the map."""
    doc = ast.get_docstring(ast.parse(path.read_text()))
    if not doc:
        where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        raise ValueError(f"{where} has no docstring: its first sentence is its entry in the "
                         "architecture map (docs/guide.md)")
    paragraph = " ".join(doc.split("\n\n")[0].split())
    found = re.match(r"(.+?[.!?])(?:\s|$)", paragraph)
    return found.group(1) if found else paragraph


def modules(package: Path = PACKAGE) -> list[Path]:
    """Every module of the package: its top-level modules first, then each subpackage, its
    `__init__` first."""
    def key(p: Path) -> tuple:
        rel = p.relative_to(package)
        return (len(rel.parts) > 1, rel.parts[:-1], p.name != "__init__.py", p.name)

    return sorted(package.rglob("*.py"), key=key)


def architecture_map(package: Path = PACKAGE) -> str:
    """The map as a table: one row per module of `platform/tidal`, a package's row in bold."""
    rows = ["| module | what it is |", "|---|---|"]
    for path in modules(package):
        rel = path.relative_to(package)
        name = f"**`{rel.parent}/`**" if path.name == "__init__.py" and rel.parent.parts else f"`{rel}`"
        rows.append(f"| {name} | {_cell(summary(path))} |")
    return "\n".join([MAP_BEGIN, *rows, MAP_END])


def with_map(guide: str, made: str) -> str:
    """`guide` with the text between the map's markers replaced by `made` (which holds the markers)."""
    start, end = guide.find(MAP_BEGIN), guide.find(MAP_END)
    if start < 0 or end < start:
        raise ValueError(f"docs/guide.md has no architecture map markers ({MAP_BEGIN!r} ... {MAP_END!r})")
    return guide[:start] + made + guide[end + len(MAP_END):]


def main() -> None:
    SPEC_DOC.write_text(spec_reference(json.loads(SCHEMA.read_text())))
    CLI_DOC.write_text(cli_reference())
    GUIDE.write_text(with_map(GUIDE.read_text(), architecture_map()))


if __name__ == "__main__":
    main()
