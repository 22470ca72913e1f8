"""Helpers to test Tidal jobs against the real thing (as `ray.cluster_utils` is for Ray): find and
kill the processes a job started, wait for a step in MLflow, read a metric's history, and the
chaos harness. Shipped with the package because both Tidal's tests and its benchmarks use them,
and neither may import the other. Never imported by Tidal itself (the top layer: tidal/__init__.py)."""
