"""The `scheduling` section: which team a job belongs to and how urgent it is.

Both default to the cluster's choice (its quota file's `defaults`), so a job file stays portable
between clusters. The priority is a plain name, not a fixed list: a cluster's quota file may
define its own priorities, so the name is checked against that file when the job is submitted
(admission/quotas.py `resolve_scheduling`), not here.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

# Names travel as MLflow tags, Prometheus labels and `--team` values: keep them plain.
SCHEDULING_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"


class SchedulingSpec(BaseModel):
    """Team and priority used by the cluster's admission (queue, quotas, preemption)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    team: str | None = Field(
        None, pattern=SCHEDULING_NAME, description="the team whose quota the job counts against; `tidal submit "
        "--team` overrides it. Default: the quota file's defaults.team"
    )
    priority: str | None = Field(
        None, pattern=SCHEDULING_NAME, description="low, normal or high unless the cluster's quota file defines "
        "others; higher-priority jobs go first and may shrink lower ones toward min_workers. `tidal submit "
        "--priority` overrides it. Default: the quota file's defaults.priority (normal)"
    )
