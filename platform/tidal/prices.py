"""What a node costs: the `tidal.io/price-per-hour` label every node type carries.

The price is the whole node's, per hour, in the cluster's currency (what the cloud bills, or
an on-prem node's amortized cost). A worker pays its share of the node: its GPUs out of the
node's GPUs, or its CPUs out of the node's CPUs for a CPU job. A label, like the site, so that
it reaches every worker through Ray (`get_runtime_context().get_node_labels()`) and shows in
`ray.nodes()`; `tidal cluster validate` checks that every node type declares one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

PRICE_LABEL = "tidal.io/price-per-hour"

Problem = tuple[str, str]


def parse_price(value: Any) -> float | None:
    """The label's value as a number of currency units per hour; None if it is not one."""
    try:
        price = float(str(value))
    except ValueError:
        return None
    return price if math.isfinite(price) and price >= 0 else None


def price_problems(where: str, labels: Mapping[str, Any], label_key: str) -> list[Problem]:
    """The node type declares its price per hour as a non-negative number (a string, as labels are)."""
    value = labels.get(PRICE_LABEL)
    if value is None:
        return [(f"{where}.{label_key}", "missing: what this node costs per hour, e.g. \"32.77\" (\"0\" for a "
                 "node that should not count); jobs report their cost from it")]
    if parse_price(value) is None:
        return [(f"{where}.{label_key}", f"{value!r} is not a price: use a non-negative number such as \"3.20\"")]
    return []


def worker_share(node_resources: Mapping[str, float], cpus: float, gpus: float) -> float:
    """The fraction of a node one worker holds: by GPUs when it has some, else by CPUs."""
    if gpus and node_resources.get("GPU"):
        return min(1.0, gpus / node_resources["GPU"])
    total = node_resources.get("CPU") or 0.0
    return min(1.0, cpus / total) if total else 0.0


def worker_price(labels: Mapping[str, str], node_resources: Mapping[str, float], cpus: float, gpus: float) -> float | None:
    """What one worker on this node costs per hour; None where the node declares no price."""
    price = parse_price(labels[PRICE_LABEL]) if PRICE_LABEL in labels else None
    return None if price is None else price * worker_share(node_resources, cpus, gpus)
