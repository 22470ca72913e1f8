"""No false hang in a long healthy run: a job of at least 30 minutes with the spec's failure
defaults (the adaptive step deadline: 10x the slowest recent step, at least 30 s) that saves large
checkpoints, evaluates, and resizes (a node lost mid-run, the group trains on at 1 worker, then grows
back when a node returns), on a real Ray cluster of one raylet per simulated node. Reports what the
platform itself recorded: hangs declared (the MLflow run's `hangs/` artifacts and the goodput
account's hang bucket; both must be 0), restarts and resizes, checkpoints and evaluations, and the
slowest step against the deadline's floor.

    python -m benchmarks.no_false_hang [--minutes 30] [--d-model 768] [--layers 6] [--in-place]

With --in-place, the same job with failure.replace_in_place on (its rendezvous, the job's own process
group across Ray's replica groups, and the heartbeat's defaults): the node's loss is then a lost rank
without room at the job's size, which the spec says restarts the group smaller, and the return grows it.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import update_doc
from tidal.spec.job import JobSpec
from tidal.testing.clusters import add_worker_node, raylet_cluster
from tidal.testing.runs import finished, prepared_store, run_in_background


def soak_spec(tmp: Path, args: argparse.Namespace, steps: int, name: str = "no-false-hang") -> JobSpec:
    return JobSpec(
        name=name,
        model={"n_layer": args.layers, "n_head": 8, "d_model": args.d_model, "vocab_size": 256, "seq_len": 64},
        data={"source": "synthetic"},
        train={"steps": steps, "micro_batch": 4, "global_batch": 8, "lr": 3e-4, "warmup_steps": 10, "log_every": 10},
        parallelism={"zero_stage": 2, "precision": "fp32"},
        scaling={"min_workers": 1, "max_workers": 2, "elastic_check_s": 5},
        checkpoint={"every_steps": args.every, "keep": 2, "storage": str(tmp / "runs")},
        eval={"every_steps": args.eval_every, "batches": 2},
        tracking={"uri": prepared_store(tmp / "mlflow.db"), "experiment": "soak"},
        failure={"replace_in_place": args.in_place},
    )


def probed_steps(tmp: Path, args: argparse.Namespace) -> int:
    """Steps for `args.minutes` at a short run's median step time (Tidal has no time limit of its own;
    a probe on a busy machine overestimates the step, so --steps is the surer way to a length)."""
    from mlflow.tracking import MlflowClient

    import tidal

    probe = soak_spec(tmp, args, 40, "no-false-hang-probe").with_overrides({"eval.every_steps": 1000})
    probed = tidal.run(probe)
    times = sorted(x.value for x in MlflowClient(probe.tracking.uri).get_metric_history(probed.mlflow_run_id,
                                                                                      "step_time_s"))
    step_s = times[len(times) // 2] * 1.1  # evaluations, saves and the 3 minutes at one worker
    return int(args.minutes * 60 / step_s)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from mlflow.tracking import MlflowClient


    with tempfile.TemporaryDirectory() as d, raylet_cluster(workers=2) as cluster:
        tmp = Path(d)
        # The run's length in steps, from a short run's step time (Tidal has no time limit of its own)
        steps = args.steps or probed_steps(tmp, args)
        spec = soak_spec(tmp, args, steps)
        out: dict[str, Any] = {}
        # The job in a thread, the cluster's changes here: Ray's add_node sets a signal handler, which
        # only the main thread may (a first version that resized from a thread could not add the node back).
        t0 = time.time()
        runner, done = run_in_background(spec)
        runner.join(args.minutes * 60 / 3)  # a third of the way in, a node goes (the group trains on at 1)...
        if runner.is_alive():
            out["lost_at_s"] = time.time() - t0
            cluster.remove_node(next(iter(cluster.worker_nodes)))
            runner.join(180)  # ...and 3 minutes later one returns
        if runner.is_alive():
            add_worker_node(cluster)
            out["returned_at_s"] = time.time() - t0
        finished(runner, done, timeout=None)
        result, wall = done["result"], done["wall_s"]
        assert result.error is None, result.error
        client = MlflowClient(spec.tracking.uri)
        run = client.get_run(result.mlflow_run_id)
        m = run.data.metrics
        hist = {k: client.get_metric_history(result.mlflow_run_id, k) for k in ("step_time_s", "world_size", "eval_loss",
                                                                               "checkpoint_bytes")}
        hangs = client.list_artifacts(result.mlflow_run_id, "hangs")
        worlds = [int(x.value) for x in sorted(hist["world_size"], key=lambda x: x.step)]
        return {"wall_s": wall, "steps": int(max(x.step for x in hist["step_time_s"])), "hangs": len(hangs),
                "hang_s": m.get("goodput_hang_s", 0.0), "restarts": int(m.get("restarts", 0)),
                "resizes": int(m.get("resizes", 0)), "worlds": [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]],
                "evals": len(hist["eval_loss"]), "checkpoints": len(hist["checkpoint_bytes"]),
                "checkpoint_gb": max((x.value for x in hist["checkpoint_bytes"]), default=0) / 1e9,
                "max_step_s": max(x.value for x in hist["step_time_s"]),
                "median_step_s": sorted(x.value for x in hist["step_time_s"])[len(hist["step_time_s"]) // 2],
                "goodput": m.get("goodput"), **out}


IN_PLACE = (" and `failure.replace_in_place: true` (the job's own process group through the driver's rendezvous, "
            "the per-rank heartbeat at its defaults)")


def changes(r: dict[str, Any]) -> str:
    if "lost_at_s" not in r:
        return "the job ended before its node was to go"
    back = f"one added back at {r['returned_at_s'] / 60:.1f} min" if "returned_at_s" in r else "none added back"
    return f"a node removed at {r['lost_at_s'] / 60:.1f} min, {back}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0, help="the run's length, in steps from a short run's step time")
    ap.add_argument("--steps", type=int, default=0, help="the run's length in steps (default: from a probe's step time)")
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--every", type=int, default=100, help="checkpoint.every_steps")
    ap.add_argument("--eval-every", type=int, default=50, help="eval.every_steps")
    ap.add_argument("--in-place", action="store_true", help="failure.replace_in_place on (off: the spec's default)")
    ap.add_argument("--no-doc", action="store_true")
    args = ap.parse_args()
    r = measure(args)
    body = f"""Command: `python -m benchmarks.no_false_hang --minutes {args.minutes:g} --steps {args.steps} --d-model {args.d_model} --layers {args.layers} \\
--every {args.every} --eval-every {args.eval_every}{' --in-place' if args.in_place else ''}` ({time.strftime('%Y-%m-%d')}, 2-core CPU machine; a Ray cluster of a
head and two 1-CPU raylets, `ray.cluster_utils.Cluster`)

A {r['wall_s'] / 60:.1f}-minute job (GPT d{args.d_model}, {args.layers} layers, ZeRO-2, 1-2 workers elastic, {r['steps']} steps) with the spec's failure defaults (the adaptive step deadline){IN_PLACE if args.in_place else ''}, a checkpoint every {args.every} steps
({r['checkpoint_gb']:.2f} GB each), an evaluation every {args.eval_every}; {changes(r)}.

| measure | value |
|---|---|
| steps trained | {r['steps']} (median step {r['median_step_s']:.2f} s, slowest {r['max_step_s']:.2f} s) |
| checkpoints / evaluations logged | {r['checkpoints']} / {r['evals']} |
| worker counts, in order | {r['worlds']} ({r['resizes']} resizes, {r['restarts']} restarts: the node loss) |
| **hangs declared** (`hangs/` in the MLflow run) / the account's hang bucket | **{r['hangs']}** / {r['hang_s']:.1f} s |
| goodput | {(r['goodput'] or 0):.1%} |
"""
    print(body)
    if not args.no_doc:
        update_doc("No false hang: a long healthy run" + (", failure.replace_in_place on" if args.in_place else ""), body)


if __name__ == "__main__":
    main()
