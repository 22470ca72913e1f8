"""Tidal's training metrics on Ray's Prometheus endpoint, and the Grafana dashboard built on them."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

import tidal
from tests.conftest import ROOT, free_port, tiny_spec
from tidal.goodput.account import BUCKETS
from tidal.tracking.goodput_gauges import GOODPUT_GAUGES
from tidal.worker.telemetry import GAUGES, exported_names, tag_keys

DASHBOARD = ROOT / "cluster_configs" / "grafana" / "tidal-dashboard.json"
SAMPLE = re.compile(r"^(?P<name>ray_tidal_\w+)\{(?P<tags>[^}]*)\} (?P<value>\S+)$")


def dashboard_exprs(path: Path) -> list[str]:
    board = json.loads(path.read_text())
    annotations = [a["expr"] for a in board.get("annotations", {}).get("list", []) if "expr" in a]
    return [t["expr"] for p in board["panels"] for t in p.get("targets", [])] + annotations


def test_every_metric_the_dashboard_uses_is_one_tidal_exports():
    used = {name for expr in dashboard_exprs(DASHBOARD) for name in re.findall(r"ray_tidal_\w+", expr)}
    assert used, "the dashboard plots Tidal's metrics"
    assert used <= exported_names(), f"not exported by Tidal: {sorted(used - exported_names())}"
    assert {"ray_tidal_tokens_per_s", "ray_tidal_straggler_ratio", "ray_tidal_comm_frac", "ray_tidal_world_size",
            "ray_tidal_mfu", "ray_tidal_gpu_util_frac", "ray_tidal_cost_per_hour"} <= used


def test_every_label_an_annotation_prints_is_kept_by_its_query_and_carried_by_its_gauge():
    """Grafana prints an empty `{{label}}` when the query drops it or the gauge never had it: the
    straggler annotation must name the node that left, not only the job."""
    board = json.loads(DASHBOARD.read_text())
    notes = [a for a in board["annotations"]["list"] if "expr" in a]
    assert notes
    for note in notes:
        printed = set(re.findall(r"{{(\w+)}}", note.get("textFormat", "") + note.get("titleFormat", "")))
        kept = set(re.findall(r"by \(([^)]*)\)", note["expr"])[0].replace(" ", "").split(","))
        gauge = re.search(r"ray_tidal_(\w+)", note["expr"])[1]
        assert printed <= kept <= set(tag_keys(gauge)), (note["name"], printed, kept, tag_keys(gauge))
    straggler = next(n for n in notes if "straggler" in n["expr"])
    assert "{{excluded_node}}" in straggler["textFormat"], straggler["textFormat"]


@pytest.fixture(scope="module")
def ray_with_metrics() -> Iterator[int]:
    """A local Ray instance whose metrics agent reports every half second; yields the port it serves."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING", _metrics_export_port=free_port(),
             _system_config={"metrics_report_interval_ms": 500})
    try:
        yield int(ray.nodes()[0]["MetricsExportPort"])  # the public node table says where it serves
    finally:
        ray.shutdown()


def scrape(port: int) -> list[tuple[str, dict[str, str], float]]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = []
    for line in text.splitlines():
        if m := SAMPLE.match(line):
            tags = dict(re.findall(r'(\w+)="([^"]*)"', m["tags"]))
            out.append((m["name"], tags, float(m["value"])))
    return out


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): metric names and labels are unit-tested
@pytest.mark.slow
def test_a_running_job_shows_on_rays_metrics_endpoint_by_job_and_rank(ray_with_metrics, tmp_path):
    port = ray_with_metrics
    spec = tiny_spec(tmp_path, name="prom", **{"train.steps": 300, "train.log_every": 5, "checkpoint.every_steps": 300})
    done = threading.Event()
    job = threading.Thread(target=lambda: (tidal.run(spec), done.set()), daemon=True)
    job.start()
    seen: list[tuple[str, dict[str, str], float]] = []
    while not done.is_set():
        seen = [s for s in scrape(port) if s[1].get("tidal_job") == "prom"]
        if {t["rank"] for n, t, _ in seen if n == "ray_tidal_step"} == {"0", "1"}:
            break
        time.sleep(0.5)
    running = not done.is_set()
    job.join(timeout=600)
    assert running, "Tidal's metrics appeared while the job was running"
    assert done.is_set(), "the job finished"

    steps = {t["rank"]: v for n, t, v in seen if n == "ray_tidal_step"}
    assert steps.keys() == {"0", "1"} and all(0 < v <= 300 for v in steps.values()), steps
    goodput = {f"ray_tidal_{k}" for k in GOODPUT_GAUGES}  # the job's tracker's: by job, team (and bucket)
    for name, tags, _ in seen:
        if name.endswith("_total"):  # the group-start counter is tagged job and reason (below)
            continue
        if name in goodput:
            assert tags.keys() >= {"tidal_job", "team"} and tags["tidal_job"] == "prom", (name, tags)
            continue
        assert tags.keys() >= {"tidal_job", "rank", "node", "site"}, (name, tags)
        assert tags["site"] == "unlabelled", "a laptop's node carries no tidal.io/site label"
    names = {n for n, _, _ in seen}
    # Everything a CPU job has: NVML needs a GPU, a cost needs priced nodes; a counter has its own tags.
    # (A straggler's exclusion is an event of its own: tests/test_straggler_exclusion.py.)
    cpu_job = {f"ray_tidal_{k}" for k in GAUGES} - {"ray_tidal_cost_per_hour", "ray_tidal_stall_s",
                                                    "ray_tidal_straggler_excluded",
                                                    "ray_tidal_straggler_excluded_node"} - {
        n for n in exported_names() if "gpu_" in n}
    assert cpu_job <= names, f"missing from the endpoint: {sorted(cpu_job - names)}"
    assert goodput <= names, f"the goodput account missing from the endpoint: {sorted(goodput - names)}"
    buckets = {t["bucket"] for n, t, _ in seen if n == "ray_tidal_goodput_seconds"}
    assert buckets == set(BUCKETS), buckets
    starts = [t for n, t, _ in scrape(port) if n == "ray_tidal_group_starts_total" and t.get("tidal_job") == "prom"]
    assert starts and starts[0]["reason"] == "start", starts
