"""Clusters: validate cluster configs (configs), place and burst workers (burst), show the cluster (status).

Importing this package imports neither ray nor torch; each module imports Ray where it needs it.
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


__all__ = ["SITES", "SITE_LABEL", "node_site", "site_resource"]
