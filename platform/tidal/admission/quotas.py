"""The cluster's quota file: teams, their shares and cloud budgets, the priorities and defaults.

The cluster names the file in its nodes' environment, `TIDAL_QUOTAS` (beside `TIDAL_STORAGE`
and `MLFLOW_TRACKING_URI`): a local path on the head or any URI pyarrow reads (s3://...).
Shares are counted in one unit for the whole file, workers or GPUs, on-prem and cloud apart:
- `guaranteed`: what the team always gets back, by shrinking or suspending borrowers;
- `borrow`: how much more it may take while others leave capacity idle (revocable);
- `cloud_budget`: GPU-hours or cost (in the currency of the nodes' `tidal.io/price-per-hour`
  labels, tidal/prices.py) per day; a burst past it is refused.

`load_quotas(path)` returns `Quotas` or raises `QuotaFileError` naming every bad key and the fix;
`quota_problems(data)` gives the same as (key, message) pairs for `tidal cluster validate`.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tidal.errors import SpecError, TidalError
from tidal.spec.parse import load_yaml
from tidal.spec.scheduling import SCHEDULING_NAME

QUOTAS_VAR = "TIDAL_QUOTAS"
DEFAULT_PRIORITIES = ("low", "normal", "high")
# Without a quota file every job counts against this one team, with no limit.
DEFAULT_TEAM = "default"

Problem = tuple[str, str]


class QuotaFileError(TidalError):
    """A quota file that cannot be used; one line per problem, each naming the key."""

    def __init__(self, problems: list[Problem], source: str) -> None:
        self.problems = problems
        lines = [f"invalid quota file {source}: {len(problems)} problem(s)"]
        lines += [f"  {where}: {msg}" for where, msg in problems]
        super().__init__("\n".join(lines))


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SiteQuota(_Part):
    guaranteed: int = Field(0, ge=0, description="slots the team always gets back (by shrinking borrowers)")
    borrow: int = Field(0, ge=0, description="slots beyond `guaranteed` the team may use while they are idle")

    @property
    def limit(self) -> int:
        return self.guaranteed + self.borrow


class CloudBudget(_Part):
    gpu_hours_per_day: float | None = Field(None, gt=0, description="cloud GPU-hours the team may use per day")
    cost_per_day: float | None = Field(None, gt=0, description="cloud spend per day, in the price labels' currency")

    @model_validator(mode="after")
    def _one(self) -> CloudBudget:
        if (self.gpu_hours_per_day is None) == (self.cost_per_day is None):
            got = "both" if self.gpu_hours_per_day is not None else "neither"
            raise ValueError(f"give exactly one of gpu_hours_per_day or cost_per_day (got {got})")
        return self

    def describe(self) -> str:
        if self.gpu_hours_per_day is not None:
            return f"{self.gpu_hours_per_day:g} GPU-hours per day"
        return f"{self.cost_per_day:g} per day"


class TeamQuota(_Part):
    onprem: SiteQuota = Field(default_factory=SiteQuota)
    cloud: SiteQuota = Field(default_factory=SiteQuota)
    cloud_budget: CloudBudget | None = None


class Defaults(_Part):
    team: str | None = Field(None, pattern=SCHEDULING_NAME, description="for jobs that name no team")
    priority: str = Field("normal", pattern=SCHEDULING_NAME, description="for jobs that name no priority")


class Quotas(_Part):
    unit: Literal["workers", "gpus"] = Field("workers", description="what shares and capacity count: gpus, or "
                                             "workers (each worker counts its CPUs, as Ray places it)")
    priorities: list[str] = Field(list(DEFAULT_PRIORITIES), min_length=1, description="lowest first")
    min_resize_interval_s: float = Field(300.0, ge=0, description="least time between two resizes of one job")
    reserve_after_s: float = Field(600.0, ge=0, description="how long the job at the head of the queue lets jobs "
                                   "of its own priority start past it (backfill) before it holds a reservation")
    capacity: int | None = Field(None, ge=1, description="on-prem slots in `unit`; default: counted from the live "
                                 "on-prem nodes (their GPUs, or their CPUs for unit workers)")
    defaults: Defaults = Field(default_factory=Defaults)
    teams: dict[str, TeamQuota] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> Quotas:
        import re

        dupes = sorted({p for p in self.priorities if self.priorities.count(p) > 1})
        if dupes:
            raise ValueError(f"priorities: {', '.join(dupes)} listed twice; list each priority once, lowest first")
        bad = [n for n in [*self.priorities, *self.teams] if not re.match(SCHEDULING_NAME, n)]
        if bad:
            raise ValueError(f"teams: {bad[0]!r} is not a usable name; use letters, digits, '.', '_' or '-'")
        if self.defaults.priority not in self.priorities:
            raise ValueError(f"defaults: priority {self.defaults.priority!r} is not one of the priorities "
                             f"({', '.join(self.priorities)}); set defaults.priority to one of them")
        if self.teams and self.defaults.team is not None and self.defaults.team not in self.teams:
            raise ValueError(f"defaults: team {self.defaults.team!r} is not one of the teams "
                             f"({', '.join(self.teams)}); set defaults.team to one of them or remove it")
        return self

    def rank(self, priority: str) -> int:
        """Higher is more urgent; an unknown name ranks below every defined one."""
        return self.priorities.index(priority) if priority in self.priorities else -1

    def team(self, name: str) -> TeamQuota | None:
        """The team's quota; None where the file sets none (no limit)."""
        return self.teams.get(name)

    def slots_per_worker(self, cpus: float, gpus: float) -> int:
        """One worker's size in the file's unit: what Ray places for it. Unit gpus counts its GPUs,
        unit workers its CPUs (capacity is then the on-prem CPUs), a whole slot at least."""
        return max(1, math.ceil((gpus if self.unit == "gpus" else cpus) - 1e-9))


def quota_problems(data: Any) -> list[Problem]:
    """Every problem in a parsed quota file, as (key, message); [] when it is fine."""
    if not isinstance(data, Mapping):
        return [("<file>", "a quota file is a YAML mapping with keys such as teams, priorities and defaults "
                 "(see cluster_configs/quotas.yaml)")]
    try:
        Quotas.model_validate(data)
    except ValidationError as e:
        return [_describe(err) for err in e.errors()]
    return []


def parse_quotas(data: Any, source: str) -> Quotas:
    problems = quota_problems(data)
    if problems:
        raise QuotaFileError(problems, source)
    return Quotas.model_validate(data)


def load_quotas(path: str) -> Quotas:
    """The quota file at a local path or a URI."""
    from tidal import fs

    try:
        filesystem, where = fs.resolve(os.path.expanduser(path))
        with filesystem.open_input_stream(where) as f:
            data = load_yaml(f.read())
    except (OSError, yaml.YAMLError) as e:
        raise QuotaFileError([("<file>", f"cannot read it ({e}); check {QUOTAS_VAR} names the file on the "
                               "cluster's storage or the head's disk")], path) from None
    return parse_quotas(data, path)


def cluster_quotas(environ: Mapping[str, str]) -> Quotas | None:
    """The quota file the environment names, or None where it names none."""
    path = environ.get(QUOTAS_VAR)
    return load_quotas(path) if path else None


def resolve_scheduling(team: str | None, priority: str | None, quotas: Quotas | None) -> tuple[str, str]:
    """(team, priority) for a job: its own, else the cluster's defaults; refused with the choices
    where the quota file does not define them."""
    q = quotas or Quotas()
    team = team or q.defaults.team or (None if q.teams else DEFAULT_TEAM)
    priority = priority or q.defaults.priority
    problems: list[Problem] = []
    if team is None:
        problems.append(("scheduling.team", f"not set, and the cluster's quota file names no default team: set "
                         f"scheduling.team or `--team` to one of {', '.join(q.teams)}"))
    elif q.teams and team not in q.teams:
        problems.append(("scheduling.team", f"{team!r} has no quota on this cluster; use one of "
                         f"{', '.join(q.teams)} (or ask the cluster's admin to add it to the quota file)"))
    if priority not in q.priorities:
        problems.append(("scheduling.priority", f"{priority!r} is not a priority on this cluster; use one of "
                         f"{', '.join(q.priorities)} (lowest first)"))
    if problems:
        raise SpecError(problems)
    return str(team), priority


def _describe(err: Mapping[str, Any]) -> Problem:
    loc = [str(x) for x in err["loc"]]
    kind, msg = err["type"], str(err["msg"])
    if kind == "extra_forbidden":
        allowed = sorted(_model_at(loc[:-1]).model_fields)
        guess = difflib.get_close_matches(loc[-1], allowed, n=1)
        hint = f"did you mean {guess[0]!r}? " if guess else ""
        return ".".join(loc), f"unknown key; {hint}allowed here: {', '.join(allowed)}"
    if kind == "value_error":  # our validators may start their message with the key they blame
        msg = msg.removeprefix("Value error, ")
        key, sep, rest = msg.partition(": ")
        if sep and key.isidentifier():
            loc, msg = [*loc, key], rest
        return ".".join(loc) or "<file>", msg
    got = err.get("input")
    shown = "" if kind == "missing" or isinstance(got, (dict, list)) else f" (got {got!r})"
    return ".".join(loc) or "<file>", f"{msg}{shown}"


def _model_at(loc: list[str]) -> type[BaseModel]:
    """The model whose keys live at `loc` (teams.<name>.cloud -> SiteQuota)."""
    model: type[BaseModel] = Quotas
    path = list(loc)
    while path:
        key = path.pop(0)
        if model is Quotas and key == "teams":
            path = path[1:]  # the team's name
            model = TeamQuota
            continue
        annotation = model.model_fields[key].annotation
        model = next(a for a in (SiteQuota, CloudBudget, TeamQuota, Defaults) if a is annotation
                     or a in getattr(annotation, "__args__", ()))
    return model


__all__ = ["QUOTAS_VAR", "CloudBudget", "Quotas", "QuotaFileError", "SiteQuota", "TeamQuota", "cluster_quotas",
           "load_quotas", "parse_quotas", "quota_problems", "resolve_scheduling"]
