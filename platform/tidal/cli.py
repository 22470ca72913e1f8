"""`tidal` command line: parses arguments, calls the SDK, prints. No logic of its own.

Imports only the spec and light modules at start-up, so `tidal --help` and `tidal validate` stay
fast and never load torch, ray, deepspeed or mlflow (tests/test_spec.py checks).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence

import yaml

from tidal.admission.view import FIELDS as QUEUE_FIELDS
from tidal.cluster.cli import register as register_cluster
from tidal.errors import TidalError, UsageError
from tidal.exporter.cli import register as register_export
from tidal.launch.jobs import JOB_FIELDS, PROGRESS_FIELDS, Job
from tidal.launch.sweep_cli import register as register_sweep
from tidal.output import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    add_output_flag,
    exit_code,
    print_error,
    print_json,
    print_notes,
)
from tidal.redact import RedactingStream
from tidal.spec.job import JobSpec, notes
from tidal.spec.load import load_spec
from tidal.tracking.quiet import skip_known_ray_errors
from tidal.tracking.runs import RECORD_FIELDS
from tidal.version import VersionAction

EPILOG = """examples:
  tidal validate jobs/quickstart.yaml
  tidal validate jobs/quickstart.yaml --set scaling.max_workers=4 --deepspeed
  tidal schema > jobs/tidal-job.schema.json           # after changing JobSpec; editors read it
  tidal run jobs/quickstart.yaml                      # local Ray, or the cluster in RAY_ADDRESS
  tidal run jobs/quickstart.yaml --set train.steps=50 --restart
  tidal sweep jobs/quickstart.yaml --param train.lr=loguniform:1e-4:1e-2 --samples 8 --set sweep.scheduler=asha
  tidal submit jobs/quickstart.yaml --address http://127.0.0.1:8265   # follows it to its end; --no-wait returns at once
  tidal list --address http://127.0.0.1:8265; tidal logs ID --follow; tidal stop ID
  tidal runs; tidal runs compare RUN_ID RUN_ID
  tidal export jobs/quickstart.yaml --format torch --output out/gpt --mlflow   # the trained model, one folder
  tidal runs --output json                            # also list, status, cluster status: fields in their --help
  tidal cluster validate cluster_configs/*.yaml
  tidal --version                                     # with the Ray, DeepSpeed, MLflow and torch versions

Cluster commands read the address from --address or RAY_ADDRESS, and the auth token from
RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token, as Ray does.

Without RAY_ADDRESS, run and sweep use the cluster `ray start` started on this machine if it still
answers, as ray.init() does; else (or with RAY_ADDRESS=local) they start a local Ray instance without
Ray's dashboard (about 3% of a small machine's training); TIDAL_RAY_DASHBOARD=1 starts it (an ASHA
sweep always does).

Set TIDAL_DEBUG=1 to see tracebacks behind error messages.

exit codes:
  0    success
  1    a job or command that failed: a job that failed for good after its restarts, a submitted
       job that ended FAILED or STOPPED, a cluster or MLflow store that cannot be reached
  2    bad usage or an invalid job spec or cluster config: nothing was started; fix what the
       message names
  130  interrupted (Ctrl-C)"""

PROGRESS_DOC = f"the latest progress: {', '.join(PROGRESS_FIELDS)} (null before the first)"


def main(argv: Sequence[str] | None = None) -> int:
    skip_known_ray_errors()  # before anything imports Ray, which reads it once (tracking/quiet.py)
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    # Everything the command prints, Ray's copies of the workers' lines and tracebacks included,
    # passes the one redaction rule (tidal/redact.py): a console is often a shared log.
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = RedactingStream(out), RedactingStream(err)
    try:
        return args.func(args) or 0
    except TidalError as e:
        print_error(e)
        return exit_code(e)
    except KeyboardInterrupt:
        print("interrupted; run the same command again to resume from the latest checkpoint", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        sys.stdout, sys.stderr = out, err


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tidal",
        description="Elastic, fault-tolerant training on Ray Train + DeepSpeed, tracked in MLflow. "
        "A job is one YAML spec; every knob lives there (see jobs/README.md).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action=VersionAction, help="print the versions of tidal, Ray, DeepSpeed, MLflow and torch")
    sub = p.add_subparsers(title="commands", metavar="COMMAND")

    v = _command(sub, "validate", _validate, "check a job spec and print it fully resolved")
    v.add_argument("--deepspeed", action="store_true", help="also print the DeepSpeed config derived for each world size, and an estimate of memory per GPU and per node")

    r = _command(sub, "run", _run, "run a job to the end (resumes from its latest checkpoint)")
    r.add_argument("--restart", action="store_true", help="start over: set the job's old checkpoints aside and open a new MLflow run")
    r.add_argument("--wait", action="store_true", help="if the job is already running (another terminal, a submitted "
                   "driver), wait for it to end and then run, instead of refusing to start a second driver of it "
                   "(TIDAL_RUN_WAIT=1 does the same)")

    register_sweep(sub)
    register_export(sub)

    sc = sub.add_parser("schema", help="print the job spec's JSON Schema (for editors and CI checks)",
                        description="Print the JSON Schema of a job spec. jobs/tidal-job.schema.json is this output; "
                        "job files name it on their first line (# yaml-language-server: $schema=./tidal-job.schema.json) "
                        "so editors complete keys and flag typos. After changing JobSpec, run "
                        "`tidal schema > jobs/tidal-job.schema.json`.")
    sc.set_defaults(func=_schema)

    s = _command(sub, "submit", _submit, "send a job to a Ray cluster through the Ray Jobs API and follow it to its end")
    _address(s)
    s.add_argument("--working-dir", default=".", help="folder uploaded with the job (default: .; .gitignore respected)")
    s.add_argument("--no-wait", action="store_true", help="return once the job is submitted instead of printing its "
                   "output until it ends (by default, like `ray job submit`, the exit code is 0 only if it SUCCEEDED)")
    s.add_argument("--follow", action="store_true", help=argparse.SUPPRESS)  # the default now; old commands keep working
    s.add_argument("--team", help="the team whose quota the job counts against (overrides scheduling.team)")
    s.add_argument("--priority", help="low, normal or high unless the cluster's quota file defines others "
                   "(overrides scheduling.priority)")

    for name, func, help_ in (("status", _status, "show a submitted job's state and progress"),
                              ("logs", _logs, "print a submitted job's output"),
                              ("stop", _stop, "stop a submitted job")):
        c = sub.add_parser(name, help=help_, description=help_)
        c.add_argument("job_id", metavar="ID", help="the submission id `tidal submit` printed")
        _address(c)
        if name == "logs":
            c.add_argument("--follow", action="store_true", help="keep printing until the job ends")
        if name == "status":
            add_output_flag(c, f"an object with id, status, reason (why it failed before its entrypoint ran, else "
                            f"null) and {PROGRESS_DOC}")
        c.set_defaults(func=func)
    ls = sub.add_parser("list", help="list Tidal jobs on a cluster with progress", description="list Tidal jobs on a cluster")
    _address(ls)
    add_output_flag(ls, "a list of objects with id, name, status (QUEUED, SHRUNK or SUSPENDED under the cluster's "
                    "admission, where its queue is readable here), team, priority, start_time (ms since the epoch) "
                    f"and {PROGRESS_DOC}")
    ls.set_defaults(func=_list)

    qu = sub.add_parser("queue", help="jobs waiting and running under the cluster's admission, with why they wait",
                        description="Every job the cluster's admission knows (docs/sharing.md): team, priority, state "
                        "(QUEUED, RUNNING, SHRUNK, SUSPENDED), workers now/min-max, position and reason. Read from the "
                        "queue document on the cluster's storage (no Ray connection needed), or with --address / "
                        "$RAY_ADDRESS through the cluster's Jobs API (no storage access needed); ended jobs are in "
                        "`tidal list`.")
    qu.add_argument("--storage", default=None, help="the cluster's storage root (default: $TIDAL_STORAGE), or the "
                    "queue document itself with $TIDAL_QUEUE")
    _address(qu)
    add_output_flag(qu, "a list of objects with " + ", ".join(QUEUE_FIELDS) + " (workers: now)")
    qu.set_defaults(func=_queue)

    rn = sub.add_parser("runs", help="table of Tidal runs in MLflow; `runs compare RUN RUN ...` puts runs side by side",
                        description="Tidal runs in MLflow: job, status, steps, final loss, tokens/s, MFU, world size, "
                        "GPU-hours (of them on cloud nodes), cost, goodput. `tidal runs compare RUN_ID RUN_ID ...` shows the params that differ and final metrics.")
    rn.add_argument("rest", nargs="*", metavar="compare RUN_ID", help="`compare` followed by two or more run ids")
    rn.add_argument("--uri", default=os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db"),
                    help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db)")
    rn.add_argument("--experiment", default=None, help="only this experiment")
    rn.add_argument("--by-team", action="store_true",
                    help="one row per team (the admission's team; '-' without one): runs, wall hours, worker-hours and "
                    "goodput, the productive share of their wall time (docs/reliability.md)")
    add_output_flag(rn, "for `runs`, a list of objects with " + ", ".join(RECORD_FIELDS) + " (times in ms since "
                    "the epoch); for `runs compare`, an object with differing_params and runs, a list of objects "
                    "with run_id, job, status, params and metrics")
    rn.set_defaults(func=_runs)
    register_cluster(sub)
    return p


def _address(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=None, help="Ray dashboard address, e.g. http://127.0.0.1:8265 (the head through `ray dashboard CLUSTER.yaml`) or https://... behind a TLS proxy (default: $RAY_ADDRESS)")


def _command(sub: argparse._SubParsersAction, name: str, func: Callable[[argparse.Namespace], int | None], help: str) -> argparse.ArgumentParser:
    c = sub.add_parser(name, help=help, description=help)
    c.add_argument("spec", metavar="SPEC", help="job spec YAML file (e.g. jobs/quickstart.yaml)")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a spec field, e.g. --set train.steps=50 (repeatable)")
    c.set_defaults(func=func)
    return c


def _spec(args: argparse.Namespace) -> JobSpec:
    spec = load_spec(args.spec, args.overrides)
    print_notes(notes(spec))
    return spec


def _validate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tidal.spec.user_refs import check_calls

    spec = _spec(args)
    print_notes(check_calls(spec, Path.cwd()))  # the user's functions against the spec's arguments, as `run` checks
    print(f"# {args.spec}: valid")
    print(yaml.safe_dump(spec.redacted(), sort_keys=False).rstrip())
    if args.deepspeed:
        from tidal.spec.deepspeed import ds_config

        on_gpu = spec.scaling.gpus_per_worker > 0
        for world in sorted({spec.scaling.min_workers, spec.scaling.max_workers}):
            print(f"\n# DeepSpeed config at world size {world} ({'GPU' if on_gpu else 'CPU'})")
            print(json.dumps(ds_config(spec, world, on_gpu=on_gpu), indent=2))
        if spec.parallelism.zero_stage in (1, 2):
            print("# and, once the model is built, zero_optimization.reduce_bucket_size: its trainable parameter count "
                  "where that is under DeepSpeed's 5e8, unless set above")
        from tidal.spec.memory import memory_table

        print("\n" + "\n".join(memory_table(spec, sorted({spec.scaling.min_workers, spec.scaling.max_workers}))))
    return 0


def _schema(_args: argparse.Namespace) -> int:
    from tidal.spec.schema import schema_text

    print(schema_text(), end="")
    return 0


def process_started() -> float:
    """When this process started (s since the epoch): a `tidal run`'s submission, from which its goodput
    account counts. Its interpreter's start and imports took 23 s on a loaded machine, missing from the
    account before."""
    import psutil  # a Ray dependency

    return psutil.Process().create_time()


def _run(args: argparse.Namespace) -> int:
    from tidal.launch.trainer import run

    spec = _spec(args)
    result = run(spec, restart=args.restart, wait=args.wait, began=process_started())
    print(result.summary())
    return 0


def _submit(args: argparse.Namespace) -> int:
    from tidal.launch.jobs import submit

    args.overrides += [f"scheduling.{k}={v}" for k, v in (("team", args.team), ("priority", args.priority)) if v]
    spec = _spec(args)
    job = submit(spec, args.address, args.working_dir)
    print(f"submitted {spec.name!r} as {job.submission_id} to {job.address}")
    print(f"  follow it:  tidal logs {job.submission_id} --follow --address {job.address}")
    print(f"  stop it:    tidal stop {job.submission_id} --address {job.address}")
    if args.no_wait:
        return 0
    return _follow_to_end(job)


def _follow_to_end(job: Job) -> int:
    """Print the job's output until it ends; 0 only if it SUCCEEDED. Ctrl-C stops following, not the job."""
    try:
        for chunk in job.follow():
            print(chunk, end="", flush=True)
        state = job.wait()
    except KeyboardInterrupt:
        _still_running(job)
        return EXIT_INTERRUPTED
    print(f"\njob {job.submission_id} {state}")
    return 0 if state == "SUCCEEDED" else EXIT_FAILED


def _still_running(job: Job) -> None:
    print(f"\nstopped following; job {job.submission_id} keeps running on the cluster.\n"
          f"  follow it again:  tidal logs {job.submission_id} --follow --address {job.address}\n"
          f"  stop it:          tidal stop {job.submission_id} --address {job.address}", file=sys.stderr)


def _job(args: argparse.Namespace) -> Job:
    from tidal.launch import jobs

    return Job(args.job_id, jobs.connect(args.address).get_address())


def _status(args: argparse.Namespace) -> int:
    job = _job(args)
    p, state = job.progress(), job.status()
    reason = getattr(state, "reason", None)  # a JobState; a plain state where status() is stood in for
    if args.output == "json":
        print_json({"id": job.submission_id, "status": str(state), "reason": reason,
                    **dict.fromkeys(PROGRESS_FIELDS), **p})
        return 0
    line = f"{job.submission_id}: {state}" + (f" before its entrypoint ran: {reason}" if reason else "")
    if p:
        speed = f" | {p['tokens_per_s']:,.0f} tok/s" if p.get("tokens_per_s") is not None else ""  # none for a user dataset
        line += f" | step {p['step']}/{p['steps']} | loss {p['loss']:.4f}{speed} | world {p['world_size']}"
    print(line)
    return 0


def _logs(args: argparse.Namespace) -> int:
    job = _job(args)
    if args.follow:
        try:
            for chunk in job.follow():
                print(chunk, end="", flush=True)
        except KeyboardInterrupt:
            _still_running(job)
            return EXIT_INTERRUPTED
    else:
        print(job.logs(), end="")
    return 0


def _stop(args: argparse.Namespace) -> int:
    job = _job(args)
    print(f"{job.submission_id}: {'stop requested' if job.stop() else 'not running'}; now {job.status()}")
    return 0


def _list(args: argparse.Namespace) -> int:
    from tidal.launch.jobs import list_jobs

    rows = list_jobs(args.address)
    if args.output == "json":
        print_json([{**dict.fromkeys(JOB_FIELDS + PROGRESS_FIELDS), **r} for r in rows])
        return 0
    if not rows:
        print("no Tidal jobs on this cluster")
        return 0
    print(f"{'ID':<28} {'NAME':<20} {'STATUS':<10} {'STEP':>11} {'LOSS':>8} {'TOK/S':>10} {'WORLD':>5}")
    for r in rows:
        step = f"{r['step']}/{r['steps']}" if "step" in r else "-"
        loss = f"{r['loss']:.4f}" if "loss" in r else "-"
        tps = f"{r['tokens_per_s']:,.0f}" if "tokens_per_s" in r else "-"
        print(f"{r['id']:<28} {r['name']:<20} {r['status']:<10} {step:>11} {loss:>8} {tps:>10} {r.get('world_size', '-'):>5}")
    return 0


def _queue(args: argparse.Namespace) -> int:
    from tidal.admission.naming import QUEUE_VAR, queue_document, queue_named
    from tidal.admission.queue_doc import load_queue
    from tidal.admission.view import rows, table

    env = {**os.environ, **({"TIDAL_STORAGE": args.storage} if args.storage else {})}
    if args.storage:
        env.pop(QUEUE_VAR, None)
    if args.address or (not queue_named(env) and env.get("RAY_ADDRESS")):
        from tidal.admission.view import remote_queue
        from tidal.launch.jobs import connect

        queue = remote_queue(connect(args.address))
    elif queue_named(env):
        queue = load_queue(queue_document(env))
    else:
        raise UsageError("where is the queue? pass --address (the cluster's dashboard, as for `tidal list`) or "
                         "--storage (its storage root), or set RAY_ADDRESS, TIDAL_STORAGE or TIDAL_QUEUE")
    records = rows(queue)
    if args.output == "json":
        print_json([{k: r[k] for k in QUEUE_FIELDS} for r in records])
    else:
        print(table(records, queue.notice))
    return 0


def _runs(args: argparse.Namespace) -> int:
    from tidal.tracking.runs import (
        COLUMNS,
        TEAM_COLUMNS,
        compare,
        compare_record,
        list_runs,
        run_records,
        table,
        team_rows,
    )

    if args.rest and args.rest[0] == "compare":
        if len(args.rest) < 3:
            raise UsageError("usage: tidal runs compare RUN_ID RUN_ID [RUN_ID ...]")
        if args.output == "json":
            print_json(compare_record(args.uri, args.rest[1:]))
            return 0
        print(table(*compare(args.uri, args.rest[1:])))
        return 0
    if args.rest:
        raise UsageError(f"unknown runs action {args.rest[0]!r}: use `tidal runs` or `tidal runs compare RUN_ID RUN_ID`")
    if args.by_team:
        teams = team_rows(run_records(args.uri, args.experiment))
        if args.output == "json":
            print_json([dict(zip(TEAM_COLUMNS, row, strict=True)) for row in teams])
        else:
            print(table(list(TEAM_COLUMNS), teams) if teams else f"no runs with a goodput account in {args.uri}")
        return 0
    if args.output == "json":
        print_json(run_records(args.uri, args.experiment))
        return 0
    rows = list_runs(args.uri, args.experiment)
    if not rows:
        print(f"no Tidal runs in {args.uri}")
        return 0
    print(table(list(COLUMNS), [[r[c] for c in COLUMNS] for r in rows]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
