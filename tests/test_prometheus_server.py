"""The Grafana dashboard against a real Prometheus server, scraping a test head the way Ray documents:
with the `prometheus.yml` Ray writes into its session folder, while two Tidal jobs train.

Ray's config names its scrape job "ray", and Prometheus gives every series it scrapes that `job`
label: a metric's own `job` label yields to it (renamed `exported_job`). So Tidal labels its
series `tidal_job`; with `job` every panel showed both jobs merged under "ray".
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT
from tidal.testing.heads import ray_head
from tidal.testing.processes import (
    free_port,
    start_in_session,
    stop_session,
    wait_for,
    wait_for_server,
)
from tidal.worker.telemetry import JOB_LABEL

DASHBOARD = ROOT / "cluster_configs" / "grafana" / "tidal-dashboard.json"
# What a CPU job cannot feed: NVML's GPU figures, a cost (no priced nodes), the admission's queue.
NOT_ON_CPU = re.compile(r"ray_tidal_(gpu_|cost_per_hour|queue_)")
JOBS = ("prom-a", "prom-b")


def query(port: int, path: str, **params: str) -> object:
    url = f"http://127.0.0.1:{port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    body = json.loads(urllib.request.urlopen(url, timeout=10).read())
    assert body["status"] == "success", body
    return body["data"]


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, query) for every query that selects by the dashboard's job variable."""
    board = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in board["panels"] for t in p.get("targets", [])
            if "$job" in t["expr"] and not NOT_ON_CPU.search(t["expr"])]


def job_spec(tmp: Path, name: str) -> Path:
    spec = {"name": name, "model": {"n_layer": 2, "n_head": 2, "d_model": 64, "vocab_size": 64, "seq_len": 16},
            "train": {"steps": 100000, "micro_batch": 4, "global_batch": 4, "log_every": 1},
            "scaling": {"min_workers": 1, "max_workers": 1},
            "checkpoint": {"every_steps": 100000, "storage": str(tmp / "runs")},
            "tracking": {"uri": f"sqlite:///{tmp}/{name}.db", "experiment": "tests"}}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.slow
@pytest.mark.extended  # two jobs and a Prometheus server: minutes beyond CI's budget
def test_the_dashboards_job_variable_and_every_panel_keep_two_jobs_apart(tmp_path):
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("needs a Prometheus server: apt-get install prometheus (as .ci/run does)")
    args = [f"--metrics-export-port={free_port()}", '--system-config={"metrics_report_interval_ms": 1000}']
    with ray_head(tmp_path, 4, {}, args=args) as head:
        config = wait_for("Ray's prometheus.yml in the head's session folder",
                          lambda: next(head.ray_tmp.glob("session_*/metrics/prometheus/prometheus.yml"), None), 60)
        assert yaml.safe_load(config.read_text())["scrape_configs"][0]["job_name"] == "ray"
        port = free_port()
        prom = start_in_session([prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}"], tmp_path / "prometheus.log")
        jobs = [start_in_session([sys.executable, "-m", "tidal", "run", str(job_spec(tmp_path, name))],
                                 tmp_path / f"{name}.log", env={**os.environ, "RAY_ADDRESS": head.gcs}) for name in JOBS]
        try:
            wait_for_server(lambda: _ready(port), prom, tmp_path / "prometheus.log", "Prometheus", 60)
            _check(port, tmp_path)
        finally:
            for proc in (*jobs, prom):
                stop_session(proc)


def _ready(port: int) -> bool:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2).status == 200
    except OSError:
        return False


def _check(port: int, tmp: Path) -> None:
    queries = panel_queries()

    def every_panel_has_both() -> bool:
        listed = set(query(port, f"label/{JOB_LABEL}/values", **{"match[]": "ray_tidal_step"}))
        return listed >= set(JOBS) and all(
            query(port, "query", query=q.replace("$job", name))["result"] for _, q in queries for name in JOBS)

    try:
        wait_for("both jobs in every panel Prometheus answers", every_panel_has_both, timeout=420, every=5)
    except Exception:
        for name in JOBS:
            print((tmp / f"{name}.log").read_text()[-3000:])
        raise
    # The dashboard's job variable: label_values(ray_tidal_step, tidal_job) lists each job.
    listed = query(port, f"label/{JOB_LABEL}/values", **{"match[]": "ray_tidal_step"})
    assert set(listed) == set(JOBS), listed
    # What merged them before: the scrape's own job label is Ray's scrape job on every series.
    assert {s["job"] for s in query(port, "series", **{"match[]": "ray_tidal_step"})} == {"ray"}
    for name in JOBS:
        for title, q in queries:
            series = query(port, "query", query=q.replace("$job", name))["result"]
            assert series, (title, q)
            assert {s["metric"].get(JOB_LABEL) for s in series} == {name}, (title, q, series)
