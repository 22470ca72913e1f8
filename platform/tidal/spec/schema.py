"""The job spec as JSON Schema, generated from JobSpec (never written by hand, so it cannot drift).

`tidal schema` prints it; `jobs/tidal-job.schema.json` is that output, which editors read through
the `# yaml-language-server: $schema=...` line of each job file to complete keys and flag typos.
Every section forbids unknown keys (`additionalProperties: false`), as JobSpec does. Checks that
span fields (batch sizes against world sizes...) stay in JobSpec: `tidal validate` runs them.
"""

from __future__ import annotations

import json
from typing import Any

from tidal.spec.job import JobSpec

DIALECT = "https://json-schema.org/draft/2020-12/schema"  # what pydantic generates


def job_schema() -> dict[str, Any]:
    return {"$schema": DIALECT, **JobSpec.model_json_schema()}


def schema_text() -> str:
    """The schema as `tidal schema` prints it and jobs/tidal-job.schema.json holds it."""
    return json.dumps(job_schema(), indent=2) + "\n"
