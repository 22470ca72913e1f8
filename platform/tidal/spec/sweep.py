"""Sweeps: the `sweep:` section of a job spec and the `KEY=DIST` parameter syntax.

Pydantic and YAML only, like the rest of `tidal.spec`: `tidal --help` and `tidal validate` never
import ray. `tidal.launch.sweep` turns a `SweepSpec` into a Ray Tune experiment.

A parameter is a dotted JobSpec field and a distribution:

    train.lr=loguniform:1e-4:1e-2     a float drawn log-uniformly from [1e-4, 1e-2]
    train.weight_decay=uniform:0:0.1  a float drawn uniformly (integer fields take randint)
    train.micro_batch=choice:4,8      one of the values, at random, per trial
    train.lr=grid:1e-2,1e-3           every value, each in `samples` trials (Tune's grid_search)
    train.seed=randint:0:1000         an integer in [0, 1000) (the upper bound is excluded, as in Tune)
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tidal.errors import SpecError
from tidal.spec.parse import load_yaml

if TYPE_CHECKING:
    from tidal.spec.job import JobSpec

Kind = Literal["choice", "grid", "uniform", "loguniform", "randint"]
KINDS: tuple[str, ...] = ("choice", "grid", "uniform", "loguniform", "randint")
ACCEPTED_FORMS = (
    "KEY=choice:A,B,... | KEY=grid:A,B,... | KEY=uniform:LO:HI | KEY=loguniform:LO:HI | "
    "KEY=randint:LO:HI (HI excluded), e.g. train.lr=loguniform:1e-4:1e-2 or train.micro_batch=choice:4,8"
)
# Every trial shares these, or they name things: sweeping them would mix trials together.
NOT_SWEEPABLE = ("name", "checkpoint.storage", "tracking.uri", "tracking.experiment", "sweep")
# Some of what a checkpoint report carries (worker/loop.py), and so what Tune can rank trials by.
# A metric close to one of these but not equal is a typo; others may be metrics added since.
REPORTED_METRICS = ("loss", "eval_loss", "eval_perplexity", "lr", "tokens_per_s", "samples_per_s", "step_time_s",
                    "mfu", "world_size")


@dataclass(frozen=True)
class Param:
    """One swept field: `values` for choice/grid, `low`/`high` for the ranges."""

    key: str
    kind: Kind
    values: tuple[Any, ...] = ()
    low: float | int | None = None
    high: float | int | None = None

    def expression(self) -> str:
        """The `DIST` text, as the user would write it (logged as an MLflow param)."""
        if self.kind in ("choice", "grid"):
            return f"{self.kind}:{','.join(map(str, self.values))}"
        return f"{self.kind}:{self.low}:{self.high}"

    def extremes(self) -> list[Any]:
        """Values that, if valid for the job, make every drawn value valid (field bounds are ranges)."""
        if self.kind in ("choice", "grid"):
            return list(self.values)
        if self.kind == "randint":
            return [self.low, int(self.high) - 1]  # type: ignore[arg-type]
        return [self.low, self.high]


def parse_param(text: str) -> Param:
    """`KEY=DIST` -> Param. Raises SpecError naming the accepted forms."""
    key, sep, dist = text.partition("=")
    key = key.strip()
    if not sep or not key or not dist.strip():
        raise _bad(text, "it is not of the form KEY=DIST")
    return parse_dist(key, dist.strip())


def parse_dist(key: str, dist: str) -> Param:
    """`choice:a,b` etc. for the field `key` -> Param."""
    check_key(key)
    text = f"{key}={dist}"
    kind, sep, rest = dist.partition(":")
    kind = kind.strip().lower()
    if not sep or kind not in KINDS:
        guess = difflib.get_close_matches(kind, KINDS, n=1)
        why = f"unknown distribution {kind!r}" + (f" (did you mean '{guess[0]}'?)" if guess else "")
        raise _bad(text, why if sep else "DIST must start with a distribution name and ':'")
    if kind in ("choice", "grid"):
        items = [s.strip() for s in rest.split(",")]
        if not rest.strip() or any(not s for s in items):
            raise _bad(text, f"{kind} needs comma-separated values with none empty")
        return Param(key, kind, values=tuple(_scalar(s) for s in items))  # type: ignore[arg-type]
    if kind in ("uniform", "loguniform") and _is_int(_fields()[0][key]):
        raise _bad(text, f"{key} is an integer field: use randint:LO:HI, or choice")
    return _range(text, key, kind, rest)  # type: ignore[arg-type]


def parse_params(params: Mapping[str, str] | Iterable[str]) -> dict[str, Param]:
    """`{"train.lr": "loguniform:1e-4:1e-2"}` or `["train.lr=loguniform:1e-4:1e-2"]` -> key -> Param.

    A key given twice in a list keeps its last value, like `--set`.
    """
    if isinstance(params, Mapping):
        parsed = [parse_dist(k.strip(), str(v).strip()) for k, v in params.items()]
    else:
        parsed = [parse_param(p) for p in params]
    return {p.key: p for p in parsed}


def check_key(key: str) -> None:
    """`key` must be a dotted JobSpec leaf field that trials may differ in."""
    leaves, sections = _fields()
    if key in leaves:
        return
    if key in NOT_SWEEPABLE or key.startswith("sweep."):
        raise SpecError([(f"--param {key}", "cannot be swept: every trial of a sweep shares it (it names the job, "
                          "where it is stored or tracked, or the sweep itself)")])
    if key in sections:
        inside = ", ".join(k for k in leaves if k.startswith(key + "."))
        raise SpecError([(f"--param {key}", f"is a section, not a field; sweep one of: {inside}")])
    # "lr" -> "train.lr": a bare field name matches by its last part first.
    guess = [k for k in leaves if k.rsplit(".", 1)[-1] == key] or difflib.get_close_matches(key, list(leaves), n=1, cutoff=0.6)
    hint = f"did you mean '{guess[0]}'?" if guess else f"sweepable fields: {', '.join(leaves)}"
    raise SpecError([(f"--param {key}", f"unknown field; {hint}")])


class SweepSpec(BaseModel):
    """How to sweep a job: which fields, how many trials, and whether to stop bad trials early.

    Each trial is a full Tidal job named `<name>-t<N>` with its own checkpoints and MLflow run.
    ASHA stops trials at checkpoint steps: metrics reach Ray Tune with each checkpoint report.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    params: dict[str, str] = Field(
        default_factory=dict, description="field -> distribution, e.g. {'train.lr': 'loguniform:1e-4:1e-2'}"
    )
    samples: int = Field(1, ge=1, description="trials drawn (with grid values: trials per grid point)")
    scheduler: Literal["none", "asha"] = Field("none", description="'asha' stops trials that fall behind early")
    metric: str = Field("loss", description=f"what ranks trials: a metric of checkpoint reports ({', '.join(REPORTED_METRICS)} ...)")
    mode: Literal["min", "max"] = "min"
    max_concurrent: int | None = Field(
        None, ge=1, description="trials at once; default: what the cluster's CPUs/GPUs fit at max_workers each"
    )
    grace_steps: int | None = Field(
        None, ge=1, description="ASHA: steps every trial trains before it may be stopped (default: checkpoint interval)"
    )
    reduction_factor: float = Field(2.0, gt=1.0, description="ASHA: keep the best 1/reduction_factor at each rung")
    checkpoint_every: int | None = Field(
        None, ge=1, description="checkpoint.every_steps for trials: ASHA decides only at checkpoint steps"
    )
    seed: int = Field(0, ge=0, description="seed of the random draws, so a sweep can be repeated")

    @field_validator("params")
    @classmethod
    def _params_parse(cls, v: dict[str, str]) -> dict[str, str]:
        try:
            parse_params(v)
        except SpecError as e:
            # "params: ..." lets tidal.spec.load name the field `sweep.params`.
            raise ValueError("params: " + "; ".join(f"{p}: {m}" for p, m in e.problems)) from None
        return v

    @field_validator("metric")
    @classmethod
    def _metric_known(cls, v: str) -> str:
        guess = difflib.get_close_matches(v, REPORTED_METRICS, n=1, cutoff=0.8)
        if v not in REPORTED_METRICS and guess:
            raise ValueError(f"metric: {v!r} is not reported with checkpoints; did you mean '{guess[0]}'? "
                             f"(for example: {', '.join(REPORTED_METRICS)})")
        return v

    def parsed(self) -> dict[str, Param]:
        return parse_params(self.params)


def check_metric(spec: JobSpec, cfg: SweepSpec) -> None:
    """An eval metric ranks trials only if the job evaluates (then every checkpoint report carries it)."""
    if cfg.metric.startswith("eval_") and spec.eval is None:
        raise SpecError([("sweep.metric", f"{cfg.metric} is measured only by jobs with an eval section: add one "
                          "(e.g. --set eval.every_steps=50), or rank trials by loss")])


def merged(base: SweepSpec | None, params: Mapping[str, str] | Iterable[str] | None = None,
           **settings: Any) -> SweepSpec:
    """`base` (the spec's `sweep:` section) with command-line or SDK values on top.

    `params` are added to (and replace same-key) base params; a `settings` value of None keeps the
    base value. Raises SpecError naming `sweep.<field>`.
    """
    data = (base or SweepSpec()).model_dump()
    if params:
        data["params"] = {**data["params"], **{k: p.expression() for k, p in parse_params(params).items()}}
    data.update({k: v for k, v in settings.items() if v is not None})
    return validate_sweep(data)


def validate_sweep(data: Mapping[str, Any], source: str | None = None) -> SweepSpec:
    try:
        return SweepSpec.model_validate(data)
    except ValidationError as e:
        raise SpecError([_describe(err) for err in e.errors()], source=source) from None


def trial_label(trial_id: str) -> str:
    """The trial's index `N` from Tune's trial id (`<experiment>_<NNNNN>`): short, and stable across a
    resumed sweep; trial `N` is the job `<name>-t<N>`. Falls back to the whole trial id should Tune
    ever format it differently: still unique."""
    tail = trial_id.rsplit("_", 1)[-1]
    return str(int(tail)) if tail.isdigit() else trial_id


# --- helpers ------------------------------------------------------------------------------
def _range(text: str, key: str, kind: Kind, rest: str) -> Param:
    parts = rest.split(":")
    if len(parts) != 2 or not all(s.strip() for s in parts):
        raise _bad(text, f"{kind} needs two bounds, {kind}:LO:HI")
    number = int if kind == "randint" else float
    try:
        low, high = (number(s.strip()) for s in parts)
    except ValueError:
        what = "integers" if kind == "randint" else "numbers"
        raise _bad(text, f"{kind} bounds must be {what}") from None
    if low >= high:
        raise _bad(text, f"LO ({low}) must be below HI ({high})")
    if kind == "loguniform" and low <= 0:
        raise _bad(text, f"loguniform needs LO > 0 (got {low})")
    return Param(key, kind, low=low, high=high)


def _scalar(text: str) -> Any:
    """A choice value typed like YAML would, except that `1e-4` is a number (YAML 1.1 says string)."""
    for number in (int, float):
        try:
            return number(text)
        except ValueError:
            pass
    try:
        value = load_yaml(text)
    except yaml.YAMLError:
        return text
    return value if isinstance(value, (bool, str)) or value is None else text


def _bad(text: str, why: str) -> SpecError:
    return SpecError([("--param", f"{text!r}: {why}. Accepted forms: {ACCEPTED_FORMS}")])


def _is_int(annotation: Any) -> bool:
    """`int`, or `int | None` (an optional count such as train.warmup_steps)."""
    return annotation is int or set(typing.get_args(annotation)) == {int, type(None)}


# SweepSpec is a section of JobSpec, yet what it may sweep is JobSpec's fields. `tidal.spec.job`
# names its model here once the class exists (`sweeps_fields_of`), so that neither module imports
# the other: a function-level import of job from here would be an import circle, only hidden.
_ROOT: list[type[BaseModel]] = []


def sweeps_fields_of(model: type[BaseModel]) -> None:
    """Make `model` (JobSpec) the one whose fields sweep parameters name."""
    _ROOT[:] = [model]


def _fields() -> tuple[dict[str, Any], list[str]]:
    """(dotted leaf field -> its type, dotted sections) of JobSpec, minus what trials share."""
    if not _ROOT:  # an invariant: importing any tidal module imports tidal.spec.job first
        raise RuntimeError("tidal.spec.job was not imported: it registers JobSpec with sweeps_fields_of")
    leaves: dict[str, Any] = {}
    sections: list[str] = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            key = prefix + name
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                sections.append(key)
                walk(ann, key + ".")
            elif key not in NOT_SWEEPABLE:
                leaves[key] = ann

    walk(_ROOT[0], "")
    return leaves, [s for s in sections if s not in NOT_SWEEPABLE]


def _describe(err: Mapping[str, Any]) -> tuple[str, str]:
    loc = [str(x) for x in err["loc"]]
    path = ".".join(["sweep", *loc])
    if err["type"] == "extra_forbidden":
        allowed = sorted(SweepSpec.model_fields)
        guess = difflib.get_close_matches(loc[-1], allowed, n=1)
        hint = f"did you mean '{guess[0]}'? " if guess else ""
        return path, f"unknown key; {hint}Allowed here: {', '.join(allowed)}"
    msg = str(err["msg"]).removeprefix("Value error, ")
    if err["type"] == "value_error":
        field, sep, rest = msg.partition(": ")
        if sep and field == (loc[0] if loc else ""):
            return path, rest
    if err["type"] == "literal_error":
        msg = msg.replace("Input should be", "must be one of:")
    got = err.get("input")
    if not isinstance(got, (dict, list)):
        msg += f" (got {got!r})"
    return path, msg
