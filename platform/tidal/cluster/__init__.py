"""Clusters: validate cluster configs (configs), place and burst workers (burst), show the cluster (status).

Importing this package imports neither ray nor torch; each module imports Ray where it needs it.
"""

from __future__ import annotations

SITE_LABEL = "tidal.io/site"
SITES = ("onprem", "cloud")


def site_resource(site: str) -> str:
    """The custom resource that marks a node of `site` (declared next to the label)."""
    return f"site_{site}"


__all__ = ["SITES", "SITE_LABEL", "site_resource"]
