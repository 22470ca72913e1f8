"""The JSON Schema editors read (jobs/tidal-job.schema.json): current with JobSpec, named by every
job file, accepting every shipped job, and rejecting a typo'd key as JobSpec does."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.conftest import ROOT
from tests.helpers import tidal_main

SCHEMA = ROOT / "jobs" / "tidal-job.schema.json"
HEADER = "# yaml-language-server: $schema=./tidal-job.schema.json"
JOBS = sorted((ROOT / "jobs").glob("*.yaml"))


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_shipped_schema_is_what_tidal_schema_prints():
    code, out, err = tidal_main("schema")
    assert code == 0, err
    assert out == SCHEMA.read_text(), (
        "jobs/tidal-job.schema.json is out of date with JobSpec: run `tidal schema > jobs/tidal-job.schema.json`")


@pytest.mark.parametrize("path", JOBS, ids=lambda p: p.name)
def test_every_job_names_the_schema_and_follows_it(path: Path, validator):
    assert path.read_text().splitlines()[0] == HEADER, f"{path.name}: make its first line `{HEADER}`"
    validator.validate(yaml.safe_load(path.read_text()))


@pytest.mark.parametrize("where", [("train", "stpes"), ("trian",), ("sweep", "sampels")])
def test_a_typo_is_rejected(where, validator):
    data = yaml.safe_load((ROOT / "jobs" / "quickstart.yaml").read_text())
    section = data
    for key in where[:-1]:
        section = section.setdefault(key, {})
    section[where[-1]] = 10
    error = jsonschema.exceptions.best_match(validator.iter_errors(data))  # looks inside `sweep`'s anyOf
    assert error is not None, f"{'.'.join(where)} was accepted"
    assert "Additional properties are not allowed" in error.message and repr(where[-1]) in error.message
