"""docs/spec-reference.md and docs/cli-reference.md are generated (docs/gen_reference.py): each must be
what the generator makes of today's schema and parser, or a reader is told about a field or flag that
is not there (or not told about one that is)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.conftest import ROOT

REGENERATE = "run `PYTHONPATH=platform python docs/gen_reference.py`"


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_spec_reference_is_generated_from_the_schema(gen):
    made = gen.spec_reference(json.loads(gen.SCHEMA.read_text()))
    assert gen.SPEC_DOC.read_text() == made, f"docs/spec-reference.md is out of date with the schema: {REGENERATE}"


def test_cli_reference_is_generated_from_help(gen, monkeypatch):
    monkeypatch.setenv("COLUMNS", gen.HELP_WIDTH)
    made = gen.cli_reference()
    assert gen.CLI_DOC.read_text() == made, f"docs/cli-reference.md is out of date with `tidal --help`: {REGENERATE}"


def test_every_field_and_command_is_in_the_references(gen):
    """What the generator walks is all there is: a field of every section, every subcommand."""
    schema = json.loads(gen.SCHEMA.read_text())
    spec_doc = gen.SPEC_DOC.read_text()
    for name, obj in schema["$defs"].items():
        assert f"## {name}" in spec_doc
        for field in obj.get("properties", {}):
            assert f"| `{field}` |" in spec_doc, f"{name}.{field}"
    cli_doc = gen.CLI_DOC.read_text()
    for command in ("run", "validate", "submit", "sweep", "schema", "runs", "cluster"):
        assert f"## `tidal {command}`" in cli_doc
        assert "--restart" in cli_doc and "--set" in cli_doc


def test_benchmarks_page_opens_with_todays_figures_and_keeps_every_benchmarks_section():
    """A reader finds today's figures first; each benchmark's `update_doc` replaces its own section in
    place (a title missing here would make it append a second copy at the end)."""
    import re

    page = (ROOT / "docs" / "benchmarks.md").read_text()
    titles = [part.split("\n", 1)[0] for part in page.split("\n## ")[1:]]
    assert titles[0] == "Today's figures"
    table = page.split("\n## ")[1]
    for figure in ("Tidal / plain DeepSpeed", "Tidal / bare Ray Train", "checkpoint every 2 steps", "node loss",
                   "regrowth", "effective training time", "finished job", "GPU MFU", "universal conversion", "fsync"):
        assert figure.lower() in table.lower(), figure
    sources = {p.name: p.read_text() for p in (ROOT / "benchmarks").glob("*.py")}
    named = {m for text in sources.values() for m in re.findall(r'update_doc\(\s*"([^"]+)",', text)}
    named |= {m for name in ("gpu.py",) for m in re.findall(r'^SECTION = "([^"]+)"', sources[name], re.M)}
    named |= {f"Checkpoint stall: asynchronous checkpoints vs torch.save ({s})" for s in ("local", "s3")}
    named -= {"Worker kills"}  # benchmarks/chaos.py writes that one into docs/reliability.md
    assert named and not named - set(titles), sorted(named - set(titles))
