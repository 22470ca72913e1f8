"""A state that will not load weights-only fails at the first save, naming the types and the spec
field that allows them (`checkpoint.safe_globals`), instead of being written into checkpoints that
every restore would refuse; allowed there, it saves and loads. No Ray."""

from __future__ import annotations

import io
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from tests.extra_state_model import NUMPY_SCALAR, Scaled
from tidal.errors import CheckpointError, SpecError
from tidal.spec.job import JobSpec
from tidal.worker.checkpoint import safe_load


@pytest.fixture(autouse=True)
def _allow_nothing_after() -> Iterator[None]:
    # Before too: a save earlier in this process (another test file's) leaves its file names
    # checked, and a checked name is not looked at again.
    safe_load.allow([])
    yield
    safe_load.allow([])


def model_states() -> dict:
    """What DeepSpeed saves as the model states of a model with numpy in its extra state."""
    return {"module": Scaled(8).state_dict(), "dp_world_size": 2}


def test_the_first_save_names_what_a_weights_only_load_would_refuse():
    with pytest.raises(safe_load.UnsafeState) as e:
        safe_load.check_saveable("global_step6/mp_rank_00_model_states.pt", model_states())
    message = str(e.value)
    for name in NUMPY_SCALAR:  # numpy.dtypes.Float64DType is built while loading: a static look misses it
        assert name in message
    assert "checkpoint.safe_globals" in message and "mp_rank_00_model_states.pt" in message


def test_allowed_in_the_spec_it_saves_and_loads():
    safe_load.allow(NUMPY_SCALAR)
    safe_load.check_saveable("global_step6/mp_rank_00_model_states.pt", model_states())
    buf = io.BytesIO()
    torch.save(model_states(), buf)
    buf.seek(0)
    assert safe_load.safe_load(buf)["module"]["_extra_state"]["temperature"] == np.float64(1.0)


def test_deepspeed_and_plain_states_need_nothing_allowed():
    state = {"module": {"w": torch.ones(2), "b": torch.nn.Parameter(torch.zeros(2))}, "step": 3, "names": ["a"]}
    assert safe_load.unsafe_globals(state) == []


def test_a_name_that_imports_nothing_is_a_clear_error():
    with pytest.raises(CheckpointError, match="checkpoint.safe_globals: 'numpy.nothing_here' names nothing"):
        safe_load.allow(["numpy.nothing_here"])


def test_the_spec_takes_dotted_names_only():
    spec = JobSpec(name="x", checkpoint={"safe_globals": NUMPY_SCALAR})
    assert spec.checkpoint.safe_globals == NUMPY_SCALAR
    with pytest.raises((SpecError, ValueError), match="not a dotted name"):
        JobSpec(name="x", checkpoint={"safe_globals": ["os.system; rm"]})
