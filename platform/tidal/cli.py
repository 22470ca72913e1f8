"""`tidal` command line: parses arguments, calls the SDK, prints. No logic of its own.

Imports only the spec at start-up, so `tidal --help` and `tidal validate` stay fast and
never load torch, ray or deepspeed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Callable, Sequence

import yaml

from tidal.errors import TidalError
from tidal.spec.job import JobSpec
from tidal.spec.load import load_spec

EPILOG = """examples:
  tidal validate jobs/quickstart.yaml
  tidal validate jobs/quickstart.yaml --set scaling.max_workers=4 --deepspeed
  tidal run jobs/quickstart.yaml                      # local Ray, or the cluster in RAY_ADDRESS
  tidal run jobs/quickstart.yaml --set train.steps=50 --restart

Set TIDAL_DEBUG=1 to see tracebacks behind error messages."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return args.func(args) or 0
    except TidalError as e:
        if os.environ.get("TIDAL_DEBUG") == "1":
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; run the same command again to resume from the latest checkpoint", file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tidal",
        description="Elastic, fault-tolerant training on Ray Train + DeepSpeed, tracked in MLflow. "
        "A job is one YAML spec; every knob lives there (see jobs/README.md).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(title="commands", metavar="COMMAND")

    v = _command(sub, "validate", _validate, "check a job spec and print it fully resolved")
    v.add_argument("--deepspeed", action="store_true", help="also print the DeepSpeed config derived for each world size")

    r = _command(sub, "run", _run, "run a job to the end (resumes from its latest checkpoint)")
    r.add_argument("--restart", action="store_true", help="start over: set the job's old checkpoints aside and open a new MLflow run")
    return p


def _command(sub: argparse._SubParsersAction, name: str, func: Callable[[argparse.Namespace], int | None], help: str) -> argparse.ArgumentParser:
    c = sub.add_parser(name, help=help, description=help)
    c.add_argument("spec", metavar="SPEC", help="job spec YAML file (e.g. jobs/quickstart.yaml)")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a spec field, e.g. --set train.steps=50 (repeatable)")
    c.set_defaults(func=func)
    return c


def _spec(args: argparse.Namespace) -> JobSpec:
    return load_spec(args.spec, args.overrides)


def _validate(args: argparse.Namespace) -> int:
    spec = _spec(args)
    print(f"# {args.spec}: valid")
    print(yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False).rstrip())
    if args.deepspeed:
        from tidal.spec.deepspeed import ds_config

        on_gpu = spec.scaling.gpus_per_worker > 0
        for world in sorted({spec.scaling.min_workers, spec.scaling.max_workers}):
            print(f"\n# DeepSpeed config at world size {world} ({'GPU' if on_gpu else 'CPU'})")
            print(json.dumps(ds_config(spec, world, on_gpu=on_gpu), indent=2))
    return 0


def _run(args: argparse.Namespace) -> int:
    from tidal.launch.trainer import run

    spec = _spec(args)
    result = run(spec, restart=args.restart)
    print(result.summary(spec.resolved()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
