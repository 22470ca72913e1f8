"""Stored reference losses (tests/golden.py): each stored file matches the spec its builder makes
now, and a test's spec that differs, or a data file with other content, is refused by name."""

from __future__ import annotations

import json

import pytest

from tests.conftest import tiny_spec
from tests.golden import ASSETS, REFERENCES, reference_losses, what_matters


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_every_reference_is_stored_for_the_spec_its_builder_makes(tmp_path, name):
    path = ASSETS / f"{name}.json"
    assert path.exists(), f"no stored losses: run `python -m tests.golden {name}`"  # else it would train here
    losses = reference_losses(name, REFERENCES[name](tmp_path), tmp_path)
    spec = json.loads(path.read_text())["spec"]
    assert sorted(losses) == list(range(1, spec["train.steps"] + 1)), "one loss a step"


def test_a_file_in_the_tests_folder_matches_by_place_and_content(tmp_path):
    def spec_in(folder, text: str):
        folder.mkdir()
        (folder / "docs.txt").write_text(text)
        return tiny_spec(folder, **{"data.source": str(folder / "docs.txt"), "model.vocab_size": 256})

    one, same, other = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    first = what_matters(spec_in(one, "abc\n"), one)
    assert first["data.source"] == "$TMP/docs.txt"
    assert first == what_matters(spec_in(same, "abc\n"), same)
    assert first["data.source.sha256"] != what_matters(spec_in(other, "abd\n"), other)["data.source.sha256"]


def test_a_spec_that_differs_names_the_field_and_the_command(tmp_path):
    name = "reshard-zero2"
    drifted = REFERENCES[name](tmp_path).with_overrides({"train.lr": 0.02})
    with pytest.raises(AssertionError, match=r"\(train\.lr\): run `python -m tests\.golden reshard-zero2`"):
        reference_losses(name, drifted)
