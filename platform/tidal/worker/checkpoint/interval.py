"""How often the memory tier snapshots when it chooses (`every_steps: auto`): Young/Daly's sqrt(2 x cost x time between faults).

A snapshot costs the job `cost_s` of training (the time training waited for it plus the time its
hand-over ran beside training on the same cores: an upper bound), and a fault loses on average
half an interval. The interval that loses least is Young's sqrt(2 * C * M) (Daly's first-order
optimum), with M the mean time between faults. M comes from the faults this job's driver has
seen (its groups restarted) over the time it has trained, with a prior of one fault per
`PRIOR_MTBF_S`, so a young job without faults is not told it never fails. In steps: that
interval over the job's step time, at least 1, and at most the persistent checkpoint interval (a
snapshot rarer than the checkpoints saves nothing). Pure: no torch, no Ray.
"""

from __future__ import annotations

import math

PRIOR_MTBF_S = 4 * 3600.0  # one fault per 4 hours of training before the job has seen any of its own
FIRST_EVERY = 1  # with no measured cost yet: the first snapshot, then the next step's, measure it


def mtbf_s(faults: int, trained_s: float, prior_s: float = PRIOR_MTBF_S) -> float:
    """Mean time between faults: the prior's one fault in `prior_s`, plus the job's own `faults` in `trained_s`."""
    return (prior_s + max(0.0, trained_s)) / (1 + max(0, faults))


def every_steps(cost_s: float | None, step_s: float | None, faults: int, trained_s: float, most: int) -> int:
    """Steps between snapshots: Young/Daly's interval for a snapshot costing `cost_s` and steps of
    `step_s` (None: not measured yet, then `FIRST_EVERY`), between 1 and `most` steps."""
    if cost_s is None or step_s is None or step_s <= 0:
        return max(1, min(FIRST_EVERY, most))
    seconds = math.sqrt(2.0 * max(cost_s, 0.0) * mtbf_s(faults, trained_s))
    return max(1, min(most, round(seconds / step_s)))
