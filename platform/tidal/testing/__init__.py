"""Helpers to test Tidal jobs against the real thing (as `ray.cluster_utils` is for Ray): every real server the tests and benchmarks run, and what they check with.

`heads` (a token-auth `ray start` head with its Jobs API), `clusters` (several raylets on this
machine), `servers` (moto's S3 server, `mlflow server`), `processes` (free ports, waits, stopping
a process group by PID), `runs` (a running job's progress in MLflow and its run folder), `chaos`
(the worker-kill harness) and `doc_sections` (how a benchmark writes its section of docs/benchmarks.md). Shipped with the package because both Tidal's tests and its benchmarks
use them, and neither may import the other. Never imported by Tidal itself (the top layer:
tidal/__init__.py)."""
