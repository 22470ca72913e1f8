"""`tidal sweep`: argument parsing and printing only; the work is `tidal.launch.sweep.sweep`.

Importing this module loads no ray or torch (`tidal --help` stays fast): the sweep runs in the handler.
"""

from __future__ import annotations

import argparse
from typing import Any

from tidal.output import print_notes
from tidal.spec.job import notes
from tidal.spec.load import load_sweep_section
from tidal.spec.sweep import ACCEPTED_FORMS

EXAMPLES = """examples:
  tidal sweep jobs/quickstart.yaml --param train.lr=loguniform:1e-4:1e-2 --samples 8 --set sweep.scheduler=asha
  tidal sweep jobs/quickstart.yaml --param train.lr=grid:1e-2,3e-3,1e-3 --param train.micro_batch=choice:4,8
  tidal sweep jobs/sweep.yaml                   # the spec's `sweep:` section; --param and --samples add to it
  tidal sweep jobs/sweep.yaml --restart         # start over instead of resuming the interrupted sweep

The rest of a sweep is the spec's `sweep:` section, or --set sweep.KEY=VALUE: scheduler (none|asha),
metric (default loss), mode (min|max), max_concurrent (default: as many trials as the cluster fits at
scaling.max_workers each), grace_steps, reduction_factor, checkpoint_every, seed.

Each trial is a whole job named <name>-t<N> with its own checkpoints and an MLflow child run under
one parent run. With sweep.scheduler asha, trials are compared (and stopped) at checkpoint steps only:
set sweep.checkpoint_every (or checkpoint.every_steps) to a few steps."""
# Flags `tidal sweep` once had; their settings live in the `sweep:` section now (one place for knobs).
MOVED = {"--scheduler": "scheduler", "--metric": "metric", "--mode": "mode", "--max-concurrent": "max_concurrent"}


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `sweep` command to `tidal`'s subcommands."""
    help_ = "run a job once per trial of a Ray Tune sweep (resumes an interrupted sweep)"
    p = subparsers.add_parser("sweep", help=help_, description=help_, epilog=EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", metavar="SPEC", help="job spec YAML file; its optional `sweep:` section gives the defaults")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a spec field, e.g. --set train.steps=50 or --set sweep.scheduler=asha (repeatable)")
    p.add_argument("--param", dest="params", action="append", default=[], metavar="KEY=DIST",
                   help=f"a field to sweep (repeatable), added to sweep.params: {ACCEPTED_FORMS}")
    p.add_argument("--samples", type=int, help="trials to draw; with grid values, trials per grid point (default: "
                   "sweep.samples, 1)")
    p.add_argument("--restart", action="store_true",
                   help="start the sweep over: set its old trials aside and open a new MLflow parent run")
    for flag in MOVED:
        p.add_argument(flag, action=_Moved, help=argparse.SUPPRESS)
    p.set_defaults(func=_sweep)
    return p


class _Moved(argparse.Action):
    """A removed flag: say where its setting went instead of argparse's bare "unrecognized"."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, argparse.SUPPRESS, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, _ns: argparse.Namespace, values: Any, option: str | None = None) -> None:
        key = MOVED[option or ""]
        parser.error(f"{option} is a sweep setting in the spec now: use --set sweep.{key}={values} "
                     f"or `{key}:` in the spec's sweep: section")


def _sweep(args: argparse.Namespace) -> int:
    from tidal.launch.sweep import sweep

    spec, section = load_sweep_section(args.spec, args.overrides)
    print_notes(notes(spec))
    result = sweep(spec, params=args.params, samples=args.samples, restart=args.restart, config=section)
    print(result.summary())
    return 0 if result.best_spec is not None else 1
