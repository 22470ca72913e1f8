"""YAML -> JobSpec: the job-file front of `tidal.spec.parse` (which holds overrides and messages)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from tidal.spec.job import JobSpec
from tidal.spec.parse import apply_overrides, read_yaml, validated
from tidal.spec.sweep import SweepSpec

__all__ = ["apply_overrides", "load_spec", "load_sweep_section", "validate"]


def load_spec(path: str | os.PathLike[str], overrides: list[str] | None = None) -> JobSpec:
    """Read a YAML job file, apply overrides, validate. Raises SpecError listing every problem."""
    return validate(apply_overrides(read_yaml(path), overrides or []), source=str(path))


def validate(data: Mapping[str, Any], source: str | None = None) -> JobSpec:
    return validated(JobSpec, data, source)


def load_sweep_section(path: str | os.PathLike[str], overrides: list[str] | None = None) -> tuple[JobSpec, SweepSpec | None]:
    """A YAML job file -> (its JobSpec, its `sweep:` section or None). `--set sweep.samples=8` works too."""
    spec = load_spec(path, overrides or [])
    return spec, spec.sweep


