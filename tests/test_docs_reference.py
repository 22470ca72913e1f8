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


def test_the_architecture_map_is_generated_and_names_every_module(gen):
    """docs/guide.md's architecture map is what the generator makes of today's modules (each one's
    first docstring sentence): a module added, moved or removed without regenerating it fails here."""
    guide = gen.GUIDE.read_text()
    shown = {line.split("|")[1].strip() for line in guide.splitlines() if line.startswith("| `") or line.startswith("| **`")}
    missing = []
    for path in gen.modules():
        rel = path.relative_to(gen.PACKAGE)
        entry = f"**`{rel.parent}/`**" if path.name == "__init__.py" and rel.parent.parts else f"`{rel}`"
        if entry not in shown:
            missing.append(str(rel))
    assert not missing, f"modules missing from the architecture map in docs/guide.md: {missing}; {REGENERATE}"
    assert gen.architecture_map() in guide, f"the architecture map in docs/guide.md is out of date: {REGENERATE}"


def test_a_module_without_a_docstring_is_named_not_left_out(gen, tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "said.py").write_text('"""Does one thing. And more."""\n')
    (package / "silent.py").write_text("x = 1\n")
    assert gen.summary(package / "said.py") == "Does one thing."
    with pytest.raises(ValueError, match="silent.py has no docstring"):
        gen.architecture_map(package)


def test_the_benchmarks_table_says_at_a_glance_which_goal_is_met():
    """Each row of the opening table answers in short cells: a figure with a goal says yes, no or not
    proven (the reading is in the figure's section below), one without says so."""
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    table = [line for line in page.split("\n## ")[1].splitlines() if line.startswith("|")]
    header = [c.strip() for c in table[0].strip("|").split("|")]
    assert header[:4] == ["figure", "goal", "today", "met?"], header
    for line in table[2:]:
        figure, goal, today, met = (c.strip() for c in line.strip("|").split(" | ")[:4])
        assert met.split(":")[0].split(" (")[0] in ({"no goal"} if goal == "-" else {"yes", "no", "not proven"}), line
        for cell in (goal, today, met):
            assert len(cell) <= 60, f"{figure}: a cell of the table is a line, its reading goes below: {cell!r}"


def test_a_benchmark_replaces_its_own_section_and_not_one_whose_title_it_begins():
    """`--stall-pairs` writes "Memory tier: what snapshots cost training" and `--stall-pairs --large` the same
    title with ", at a 1.5 GB state": the first must not overwrite the second (it once matched by prefix)."""
    from tidal.testing.doc_sections import with_section

    page = "# B\n\n## X\n\nold x\n\n## X, at a 1.5 GB state\n\nold large\n"
    assert with_section(page, "X", "new x") == "# B\n\n## X\n\nnew x\n\n## X, at a 1.5 GB state\n\nold large\n"
    assert with_section(page, "Y", "y").endswith("old large\n\n## Y\n\ny\n")  # a new section goes last
