"""Submit from a laptop: a real head started here (`ray start --head`, token auth on), the Ray Jobs
API through `tidal submit/status/logs/list/stop`, plain `ray job submit`, and the SDK notebook."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import ONE_WORKER, ROOT, tiny_spec
from tests.helpers import driver_in
from tidal.cli import main
from tidal.errors import TidalError
from tidal.launch.jobs import submit
from tidal.testing.processes import wait_for

pytestmark = pytest.mark.slow


def spec_file(tmp: Path, name: str, **overrides) -> tuple:
    spec = tiny_spec(tmp, name=name, **overrides)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    return spec, path


def test_submit_follow_status_logs_list(head, tmp_path, capsys, monkeypatch):
    from tidal.launch.jobs import Job

    monkeypatch.chdir(ROOT)
    _, path = spec_file(tmp_path, "submitted", **ONE_WORKER)
    assert main(["submit", str(path), "--address", head]) == 0  # follows by default, like `ray job submit`
    out = capsys.readouterr().out
    job_id = out.split("submitted 'submitted' as ")[1].split()[0]
    assert "[tidal] step 24/24" in out and out.rstrip().endswith(f"job {job_id} SUCCEEDED")
    assert not [line for line in out.splitlines() if "[tidal]" in line and "pid=" in line], "no Ray actor prefix"

    assert main(["status", job_id, "--address", head]) == 0
    assert "SUCCEEDED | step 24/24" in capsys.readouterr().out
    assert main(["logs", job_id, "--address", head]) == 0
    assert "finished in" in capsys.readouterr().out
    assert main(["list", "--address", head]) == 0
    listing = capsys.readouterr().out
    assert job_id in listing and "submitted" in listing and "24/24" in listing

    assert main(["status", job_id, "--address", head, "--output", "json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert (status["id"], status["status"], status["step"], status["steps"]) == (job_id, "SUCCEEDED", 24, 24)
    assert main(["list", "--address", head, "--output", "json"]) == 0
    listed = {r["id"]: r for r in json.loads(capsys.readouterr().out)}
    assert listed[job_id]["name"] == "submitted" and listed[job_id]["step"] == 24

    # The SDK path the notebook uses, on the same job: metrics rows, loss falling.
    frame = Job(job_id, head).metrics()
    assert list(frame["step"]) == list(range(1, 25))
    assert frame["loss"].iloc[-1] < 0.75 * frame["loss"].iloc[0]
    assert {"tokens_per_s", "world_size", "mfu"} <= set(frame.columns)


def test_submit_exits_by_the_outcome_no_wait_returns_at_once_and_stop_stops(head, tmp_path, capsys, monkeypatch):
    """Like `ray job submit`: exit 0 only if the job SUCCEEDED (following by default, and exit 0 for
    a success: the test above); --no-wait returns at once; `tidal stop` stops that job as it trains.
    The job that FAILED is a second submission of the running one, which its entrypoint refuses (a
    job that fails in training exits 1 the same way: the exit follows the Jobs API's status)."""
    from tidal.launch.jobs import Job

    monkeypatch.chdir(ROOT)
    _, path = spec_file(tmp_path, "to-stop", **{"train.steps": 5000, "checkpoint.every_steps": 1000, **ONE_WORKER})
    assert main(["submit", str(path), "--address", head, "--no-wait"]) == 0
    out = capsys.readouterr().out
    assert "[tidal] step" not in out
    job = Job(out.split("submitted 'to-stop' as ")[1].split()[0], head)
    wait_for("the job's first step", job.progress, 180, every=1.0)
    assert job.progress()["step"] >= 1, "job never started training"

    assert main(["submit", str(path), "--address", head]) == 1
    out = capsys.readouterr().out
    assert "already running" in out and out.rstrip().endswith("FAILED"), out[-3000:]
    assert main(["stop", job.submission_id, "--address", head]) == 0
    assert job.wait(timeout=120) == "STOPPED"  # and the head is free for the next test


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): plain `ray job submit` runs in test_one_live_attempt
def test_plain_ray_job_submit_runs_tidal(head, tmp_path):
    """The guide's (docs/guide.md) `ray job submit ... -- tidal run jobs/quickstart.yaml`, made small with --set."""
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "job", "submit", "--address", head, "--working-dir", str(ROOT),
           "--", "tidal", "run", "jobs/quickstart.yaml", "--set", "train.steps=20", "--set", "model.d_model=64",
           "--set", "model.n_head=2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[tidal] job 'quickstart' finished" in proc.stdout
    assert "succeeded" in proc.stdout.lower()
    # the entrypoint is the driver: Tidal's lines as in `tidal run`, without Ray's actor prefix
    assert "[tidal] step 20/20" in proc.stdout
    assert not [line for line in proc.stdout.splitlines() if "[tidal]" in line and "pid=" in line]


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): a run on the head node
def test_a_run_on_the_head_node_uses_its_cluster(head, head_tmp):
    """Logged in to a head node, no RAY_ADDRESS: a driver joins the cluster `ray start` recorded there
    (token auth included), as ray.init() does, rather than starting an instance of its own."""
    recorded = head_tmp / "ray" / "ray_current_cluster"
    # `ray start` records it once started, which can be after its dashboard answers
    wait_for("`ray start`'s record of its cluster", recorded.is_file, 60)
    proc = driver_in(head_tmp)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "`ray start` started on this machine" in proc.stdout
    assert f"gcs {recorded.read_text().strip()}" in proc.stdout


def test_wrong_token_gets_a_friendly_message(head, monkeypatch, capsys):
    monkeypatch.setenv("RAY_AUTH_TOKEN", "not-the-token")
    assert main(["list", "--address", head]) == 1  # a ClusterError: the command failed
    err = capsys.readouterr().err
    assert "refused the auth token" in err and "RAY_AUTH_TOKEN" in err and "Traceback" not in err


def test_missing_token_gets_a_friendly_message(head, monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "absent"))
    assert main(["status", "whatever", "--address", head]) == 1
    assert "no auth token was found" in capsys.readouterr().err


def test_notebook_runs_against_the_head(head, tmp_path):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(ROOT / "notebooks" / "quickstart.ipynb", as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "saved without outputs"
    os.environ["TIDAL_ADDRESS"] = head
    try:
        NotebookClient(nb, timeout=600, kernel_name="python3",
                       resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    finally:
        os.environ.pop("TIDAL_ADDRESS")
    table = "".join(o.get("data", {}).get("text/plain", "") for o in nb.cells[5].outputs)
    rows = [line.split() for line in table.splitlines()[1:] if line.strip()]
    assert rows, f"metrics frame is empty: {table!r}"
    kinds = {o.get("output_type") for c in nb.cells for o in c.get("outputs", [])}
    assert "error" not in kinds
    images = [o for o in nb.cells[6].outputs if "image/png" in o.get("data", {})]
    assert images, "no plot"


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): cluster-decided storage and tracking also in test_secrets_e2e
def test_the_cluster_decides_where_a_submitted_job_keeps_things(head, cluster_env, tmp_path_factory, monkeypatch,
                                                               capsys):
    """`tidal submit` of the quickstart from a folder, twice, to a cluster whose nodes name an MLflow
    server and TIDAL_STORAGE: the first trains into them, the second says it is complete."""
    from tidal.launch.jobs import Job
    from tidal.storage import RunDir

    folder = tmp_path_factory.mktemp("project")
    (folder / "quickstart.yaml").write_text((ROOT / "jobs" / "quickstart.yaml").read_text())
    monkeypatch.chdir(folder)
    for var in ("MLFLOW_TRACKING_URI", "TIDAL_STORAGE", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)  # the laptop names neither: the cluster decides
    small = ["--set", "name=quickstart-twice", "--set", "train.steps=20", "--set", "model.d_model=64",
             "--set", "model.n_head=2", "--set", "checkpoint.every_steps=10"]

    assert main(["submit", "quickstart.yaml", "--address", head, "--follow", *small]) == 0
    out = capsys.readouterr().out
    assert "[tidal] step 20/20" in out
    job_id = out.split("submitted 'quickstart-twice' as ")[1].split()[0]
    found = RunDir(cluster_env["TIDAL_STORAGE"], "quickstart-twice").latest_complete()
    assert found is not None and found.step == 20, "checkpoints are under the cluster's TIDAL_STORAGE"
    job = Job(job_id, head)
    assert job.tracking_uri() == cluster_env["MLFLOW_TRACKING_URI"]
    assert list(job.metrics()["step"]) == [10, 20], "the laptop reads the run from the cluster's MLflow"
    result = job.result()
    assert result.error is None and result.path == f"{cluster_env['TIDAL_STORAGE']}/quickstart-twice/checkpoint_000000020"
    assert result.tracking_uri == cluster_env["MLFLOW_TRACKING_URI"] and "loss" in result.metrics
    cache = [p for p in tmp_path_factory.getbasetemp().glob("head*/ray/**/runtime_resources/**/*")
             if p.name in ("tidal-runs", "mlflow.db", "mlruns") or (p.is_dir() and p.name.startswith("checkpoint_"))]
    assert cache == [], "nothing is kept inside Ray's working-dir cache"

    assert main(["submit", "quickstart.yaml", "--address", head, "--follow", *small]) == 0
    out = capsys.readouterr().out
    assert "already complete at step 20" in out and "--restart" in out
    assert "step 1/20" not in out and "nan" not in out


def test_upload_above_the_limit_is_refused_before_sending(tmp_path):
    from tidal.launch.jobs import upload_limit

    (tmp_path / "big.bin").write_bytes(os.urandom(upload_limit() + 1024))
    (tmp_path / "small.txt").write_text("hi")
    with pytest.raises(TidalError) as e:
        # port 1 answers nothing: a connection attempt would fail differently
        submit(tiny_spec(tmp_path, name="big"), "http://127.0.0.1:1", tmp_path)
    assert "above Ray's 100 MiB limit" in str(e.value) and "big.bin" in str(e.value) and ".rayignore" in str(e.value)


def test_gitignored_and_checkpoint_folders_do_not_count(tmp_path):
    from tidal.launch.jobs import ALWAYS_EXCLUDE, working_dir_size

    (tmp_path / ".gitignore").write_text("data/\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "huge.bin").write_bytes(b"x" * 10_000)
    (tmp_path / "tidal-runs").mkdir()
    (tmp_path / "tidal-runs" / "ckpt.pt").write_bytes(b"x" * 10_000)
    (tmp_path / "train.py").write_text("print(1)\n")
    size, largest = working_dir_size(tmp_path, ALWAYS_EXCLUDE)
    names = {p for _, p in largest}
    assert "train.py" in names and not any("huge" in n or "ckpt" in n for n in names)
    assert size < 1000

