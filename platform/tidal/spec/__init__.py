"""The job spec: pydantic + yaml only, so that `tidal --help` never imports torch or ray."""

from tidal.spec.job import JobSpec
from tidal.spec.load import load_spec

__all__ = ["JobSpec", "load_spec"]
