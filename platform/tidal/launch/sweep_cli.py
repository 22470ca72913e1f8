"""`tidal sweep`: argument parsing and printing only; the work is `tidal.launch.sweep.sweep`.

Importing this module loads no ray or torch (`tidal --help` stays fast): the sweep runs in the handler.
"""

from __future__ import annotations

import argparse

from tidal.spec.sweep import ACCEPTED_FORMS, load_sweep_section

EXAMPLES = """examples:
  tidal sweep jobs/quickstart.yaml --param train.lr=loguniform:1e-4:1e-2 --samples 8 --scheduler asha
  tidal sweep jobs/quickstart.yaml --param train.lr=grid:1e-2,3e-3,1e-3 --param train.micro_batch=choice:4,8
  tidal sweep jobs/sweep.yaml                   # the spec's `sweep:` section; flags override it
  tidal sweep jobs/sweep.yaml --restart         # start over instead of resuming the interrupted sweep

Each trial is a whole job named <name>-t<N> with its own checkpoints and an MLflow child run under
one parent run. With --scheduler asha, trials are compared (and stopped) at checkpoint steps only:
set sweep.checkpoint_every (or checkpoint.every_steps) to a few steps."""


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `sweep` command to `tidal`'s subcommands."""
    help_ = "run a job once per trial of a Ray Tune sweep (resumes an interrupted sweep)"
    p = subparsers.add_parser("sweep", help=help_, description=help_, epilog=EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", metavar="SPEC", help="job spec YAML file; its optional `sweep:` section gives the defaults")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a spec field, e.g. --set train.steps=50 (repeatable)")
    p.add_argument("--param", dest="params", action="append", default=[], metavar="KEY=DIST",
                   help=f"a field to sweep (repeatable): {ACCEPTED_FORMS}")
    p.add_argument("--samples", type=int, help="trials to draw; with grid values, trials per grid point (default 1)")
    p.add_argument("--scheduler", choices=["none", "asha"], help="asha stops trials that fall behind (default none)")
    p.add_argument("--metric", help="what ranks trials (default loss)")
    p.add_argument("--mode", choices=["min", "max"], help="whether lower or higher --metric is better (default min)")
    p.add_argument("--max-concurrent", type=int, metavar="K",
                   help="trials at once (default: as many as the cluster fits at scaling.max_workers each)")
    p.add_argument("--restart", action="store_true",
                   help="start the sweep over: set its old trials aside and open a new MLflow parent run")
    p.set_defaults(func=_sweep)
    return p


def _sweep(args: argparse.Namespace) -> int:
    from tidal.cli import print_notes
    from tidal.launch.sweep import sweep

    spec, section = load_sweep_section(args.spec, args.overrides)
    print_notes(spec)
    result = sweep(spec, params=args.params, samples=args.samples, scheduler=args.scheduler, metric=args.metric,
                   mode=args.mode, max_concurrent=args.max_concurrent, restart=args.restart, config=section)
    print(result.summary())
    return 0 if result.best_spec is not None else 1
