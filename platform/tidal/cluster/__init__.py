"""Clusters: validate cluster configs (configs), place and burst workers (burst), show the cluster (status).

Importing this package imports neither ray nor torch; each module imports Ray where it needs it.
"""
