"""Sites: where a node is (on-prem or cloud), from its `tidal.io/site` label or its site resource.

At the bottom of the imports (tidal/__init__.py), beside prices.py: the cluster's configs and bursts,
the team queue's cloud accounting and the workers' telemetry all read a node's site.
"""

from __future__ import annotations

from collections.abc import Mapping

SITE_LABEL = "tidal.io/site"
SITES = ("onprem", "cloud")


def site_resource(site: str) -> str:
    """The custom resource that marks a node of `site` (declared next to the label)."""
    return f"site_{site}"


def node_site(resources: Mapping[str, float], labels: Mapping[str, str]) -> str | None:
    """A node's site from its label, else from its site resource; None for unlabelled nodes."""
    site = labels.get(SITE_LABEL)
    if site in SITES:
        return site
    return next((s for s in SITES if resources.get(site_resource(s), 0) > 0), None)
