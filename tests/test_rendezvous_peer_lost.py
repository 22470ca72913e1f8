"""Which errors take the in-place path (worker/health/rendezvous.py `peer_lost`): a collective whose
peer went away, or Ray's report barrier reset for a replaced worker; never a user's own error."""

from __future__ import annotations

import pytest

from tidal.worker.health.rendezvous import RendezvousError, peer_lost

GLOO = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:10650. This is typically caused by a remote worker crashing.")


class SynchronizationBarrierResetError(Exception):
    """Ray Train's (ray.train.v2._internal.execution.checkpoint.sync_actor), matched by name."""


@pytest.mark.parametrize(("error", "lost"), [
    (RuntimeError(GLOO), True),  # what torch 2.13's gloo raised in the survivor (probed)
    (RuntimeError("[gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]: Connection reset by peer"), True),
    (SynchronizationBarrierResetError("barrier reset"), True),
    (RuntimeError("my dataset download failed: Connection reset by peer"), False),  # the user's own
    (ValueError(GLOO), False),  # not an error a collective raises
    (RendezvousError("generation 3 did not form within 180s (Connection closed by peer, gloo)"), False),
    (RuntimeError("CUDA out of memory"), False),
])
def test_only_a_lost_peer_is_replaced_in_place(error, lost):
    assert peer_lost(error) is lost


def test_replacing_in_place_is_refused_with_zero_3_naming_the_fix(tmp_path):
    from tests.conftest import tiny_spec
    from tidal.errors import SpecError

    spec = tiny_spec(tmp_path, name="z3").with_overrides({"failure.replace_in_place": True})  # ZeRO-2: supported
    spec.with_overrides({"failure.replace_in_place": False, "parallelism.zero_stage": 3})
    # refused by the spec itself (tidal validate, the SDK, every face), naming the field
    with pytest.raises(SpecError, match="failure.replace_in_place.*zero_stage 1 or 2, or set failure.replace_in_place: false"):
        spec.with_overrides({"parallelism.zero_stage": 3})
