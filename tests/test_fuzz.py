"""Property: any YAML the loader is given yields a valid JobSpec or a clean SpecError naming a
field path; never another exception type."""

from __future__ import annotations

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tidal.errors import SpecError
from tidal.spec import JobSpec, load_spec
from tidal.spec.load import validate
from tidal.spec.parse import apply_overrides

SECTIONS = list(JobSpec.model_fields)
KEYS = sorted({k for name, f in JobSpec.model_fields.items() if hasattr(f.annotation, "model_fields")
               for k in f.annotation.model_fields} | {"stpes", "zero_stge", "x", ""})

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                    st.text(max_size=20), st.sampled_from(["synthetic", "fp16", "bf16", "any", "1e-3", "-1"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.sampled_from(KEYS), inner, max_size=4)),
                      max_leaves=12)
sections = st.dictionaries(st.sampled_from(KEYS), values, max_size=6)
docs = st.dictionaries(st.sampled_from([*SECTIONS, "trian", "sweep", "extra"]),
                       st.one_of(sections, values), max_size=6)


def _check(problems: list[tuple[str, str]]) -> None:
    assert problems, "a SpecError must list at least one problem"
    for path, msg in problems:
        assert isinstance(path, str) and isinstance(msg, str) and msg


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(docs)
def test_any_mapping_gives_a_spec_or_a_spec_error(doc):
    try:
        spec = validate(doc)
    except SpecError as e:
        _check(e.problems)
    else:
        assert isinstance(spec, JobSpec)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_any_text_file_gives_a_spec_or_a_spec_error(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("fuzz") / "job.yaml"
    path.write_text(text)
    try:
        load_spec(path)
    except SpecError as e:
        _check(e.problems)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=30), max_size=4))
def test_any_override_strings_give_a_spec_or_a_spec_error(overrides):
    try:
        validate(apply_overrides({}, overrides))
    except SpecError as e:
        _check(e.problems)


def test_yaml_dump_of_a_valid_spec_round_trips(tmp_path):
    spec = JobSpec(env={"HF_TOKEN": "env:HF_TOKEN", "DB": {"from_file": "/run/secrets/db"}}, worker_env={"HF_HOME": "/tmp/hf"})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    assert load_spec(path) == spec
