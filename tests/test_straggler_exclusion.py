"""A persistent straggler's node taken out of an elastic job and brought back: the decisions alone,
then a real job on a multi-raylet cluster with one slow node."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

import tidal
from tests.conftest import metric_history, tiny_spec
from tidal.testing.processes import wait_for
from tidal.tracking.findings import STRAGGLER_TAG
from tidal.worker.health import avoidance
from tidal.worker.health.stragglers import ExclusionWatch, Spread, exclusion_on, size_without


def test_only_a_rank_slow_without_a_break_for_the_whole_duration_is_taken_out():
    w = ExclusionWatch(ratio=1.5, after_s=600)
    slow, fine = Spread(2.0, 1), Spread(1.1, 1)
    assert w.update(slow, 0) is None and w.update(slow, 300) is None
    assert w.update(fine, 400) is None, "a break starts over"
    assert w.update(slow, 500) is None and w.update(slow, 1000) is None, "500 s since the break"
    assert w.update(Spread(2.0, 2), 1150) is None, "another rank: starts over"
    assert w.update(Spread(2.0, 2), 1700) is None
    assert w.update(Spread(2.0, 2), 1750) == 2
    assert w.update(Spread(2.0, 2), 2000) is None, "once per group"


def test_never_below_min_workers_and_off_by_default_for_fixed_size_jobs():
    assert size_without(world=4, on_node=1, min_workers=2) == 3
    assert size_without(world=4, on_node=2, min_workers=2) == 2, "the node's every rank goes"
    assert size_without(world=2, on_node=1, min_workers=2) is None
    assert exclusion_on(None, elastic=True) and not exclusion_on(None, elastic=False)
    assert exclusion_on(True, elastic=False) and not exclusion_on(False, elastic=True)


def test_the_record_steers_the_selector_and_the_drivers_restarts(tmp_path):
    spec = tiny_spec(tmp_path)
    assert avoidance.restart_for(spec) is None and avoidance.label_selector(avoidance.read(spec)) is None
    a = avoidance.Avoided("abc123", "10.0.0.2", until=time.time() + 60, rank=1, ratio=2.0, step=40, size=3)
    avoidance.write(spec, a)
    assert avoidance.restart_for(spec) == a, "the group ended to take the node out"
    assert avoidance.read(spec).state == "avoiding"
    assert avoidance.restart_for(spec) is None, "a group ending while avoiding (stop_at, early stop) is not restarted"
    assert avoidance.label_selector(avoidance.read(spec)) == {"ray.io/node-id": "!abc123"}
    assert avoidance.label_selector(avoidance.read(spec), now=a.until) is None, "the avoidance is over"
    assert avoidance.most_workers(4, avoidance.read(spec)) == 3, "no room asked for on the avoided node"
    assert avoidance.most_workers(4, avoidance.read(spec), now=a.until) == 4
    avoidance.write(spec, avoidance.Avoided(**{**a.__dict__, "state": "return"}))
    assert avoidance.restart_for(spec).state == "return" and avoidance.read(spec).state == "done"
    assert avoidance.label_selector(avoidance.read(spec)) is None


def test_one_owner_sizes_the_group_and_admission_no_longer_hides_a_straggler():
    from tidal.worker.health.decide import NONE, group_target, resize_to

    # (admission's target, the job's own, the size the group was launched for) -> (target sent, who asked)
    cases = [((NONE, NONE, 2), (NONE, "")),
             ((2.0, NONE, 2), (NONE, "")),  # admission keeps the size: train on
             ((1.0, NONE, 2), (1.0, "admission")),
             ((2.0, 1.0, 2), (1.0, "own")),  # a straggler's node out under admission (dropped before)
             ((NONE, 1.0, 2), (1.0, "own")),  # no word from admission: the job's own ask stands
             ((4.0, 1.0, 2), (4.0, "admission"))]  # admission's new size wins; the driver caps it by the avoidance
    for args, want in cases:
        assert group_target(*args) == want, args
    assert resize_to(group_target(2.0, 1.0, 2)[0], 2) == 1


def test_with_the_gauges_off_a_persistent_straggler_is_still_taken_out(tmp_path, monkeypatch):
    """TIDAL_TELEMETRY=0 turns the Prometheus gauges off, not the failure handling it once took with it."""
    from types import SimpleNamespace

    import torch

    from tidal.worker import telemetry

    monkeypatch.setenv(telemetry.OFF_VAR, "0")
    places = [telemetry.Place("10.0.0.1", "a" * 16, "onprem", None), telemetry.Place("10.0.0.2", "b" * 16, "onprem", None)]
    ctx = SimpleNamespace(get_world_rank=lambda: 0, get_world_size=lambda: 2)
    monkeypatch.setattr(telemetry.ray.train, "get_context", lambda: ctx)
    monkeypatch.setattr(telemetry.Place, "here", classmethod(lambda cls, spec: places[0]))
    spec = tiny_spec(tmp_path, **{"scaling.min_workers": 1, "scaling.max_workers": 2,
                                  "failure.straggler_exclude_after_s": 0.01})
    said: list[str] = []
    t = telemetry.Telemetry(spec, SimpleNamespace(say=lambda text, step: said.append(text)), torch.device("cpu"), None)
    t.places = places  # what the group's one all_gather_object gives
    out: dict[str, float] = {}
    for step in (2, 4, 6):
        out |= t.at_log_step({"step": step, "step_time_s": 0.1}, busy_s=[0.05, 0.2])
        time.sleep(0.02)
    assert out.get("straggler_excluded") == 1.0 and t.target == 1.0, (out, said)
    assert avoidance.read(spec).node_id == "b" * 16 and any("restarting at 1 worker(s)" in x for x in said)


@pytest.mark.slow
@pytest.mark.extended  # a multi-raylet cluster for three lives of the job: minutes beyond CI's budget
def test_an_elastic_job_drops_a_slow_node_trains_on_and_grows_back_after_the_avoidance(tmp_path, capfd):
    from tidal.testing.clusters import raylet_cluster

    flag = tmp_path / "slow-node"
    flag.touch()
    over = {
        "model.builder": "tests.straggler_model:build", "train.step_fn": "tests.slow_step:step",
        "train.steps": 800, "train.log_every": 2, "checkpoint.every_steps": 20,
        "scaling.min_workers": 1, "scaling.max_workers": 2, "scaling.elastic_check_s": 2,
        "failure.straggler_exclude_after_s": 3, "failure.straggler_avoid_s": 40,
        "worker_env": {"TIDAL_TEST_SLOW_RESOURCE": "slow_node", "TIDAL_TEST_SLOW_S": "0.06",
                       "TIDAL_TEST_SLOW_FLAG": str(flag), "TIDAL_TEST_STEP_S": "0.02"},
    }
    spec = tiny_spec(tmp_path, name="exclude", **over)
    with raylet_cluster() as cluster:
        cluster.add_node(num_cpus=1, resources={"slow_node": 1})
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        # The neighbour leaves once the node is out: back in the group, it is no longer slow.
        threading.Thread(target=_unflag_when_avoided, args=(spec, flag), daemon=True).start()
        result = tidal.run(spec)
        out = capfd.readouterr().out
        reference = tidal.run(spec.with_overrides({
            "name": "undisturbed", "scaling.min_workers": 1, "scaling.max_workers": 1,
            "worker_env": {"TIDAL_TEST_STEP_S": "0"}}))

    said = [ln for ln in out.splitlines() if "straggler: rank" in ln and "checkpointing" in ln]
    assert len(said) == 1 and "restarting at 1 worker(s) instead of 2 without that node" in said[0], out[-3000:]
    assert "this job avoids it for 40s" in said[0], said[0]
    assert sum("is no longer avoided" in ln for ln in out.splitlines()) == 1, out[-3000:]
    run_id = result.mlflow_run_id
    loss, world = metric_history(spec, run_id, "loss"), metric_history(spec, run_id, "world_size")
    assert sorted(loss) == list(range(2, 801, 2)), "every step logged once"
    sizes = [world[s] for s in sorted(world)]
    changes = [sizes[0]] + [b for a, b in zip(sizes, sizes[1:], strict=False) if a != b]
    assert changes[-3:] == [2, 1, 2], changes  # the slow node out, then back after straggler_avoid_s
    excluded = metric_history(spec, run_id, "straggler_excluded_rank")
    assert len(excluded) == 1, excluded
    tags = MlflowClient(spec.tracking.uri).get_run(run_id).data.tags
    assert tags[STRAGGLER_TAG].startswith(f"rank {list(excluded.values())[0]:.0f} was "), tags[STRAGGLER_TAG]
    assert avoidance.read(spec).state == "done"
    ref = metric_history(spec, reference.mlflow_run_id, "loss")
    # The same global batch at any size: the losses of the undisturbed run, up to summation order.
    assert loss == pytest.approx(ref, rel=1e-4, abs=1e-6)


def _unflag_when_avoided(spec, flag: Path, timeout: float = 900) -> None:
    wait_for("the slow node avoided", lambda: (a := avoidance.read(spec)) is not None and a.state == "avoiding",
             timeout, every=0.5)
    flag.unlink(missing_ok=True)
