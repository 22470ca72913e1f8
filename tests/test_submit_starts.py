"""Every submission starts, and one that cannot says why (issue #52), against the suite's real token-auth head
(conftest's `head`). Ray skips uploading an unchanged working_dir whose package the GCS says it
holds, and the GCS deletes a package once no job references it (ray#36703, #46625): a job submitted
from a folder as another job from that folder ends could find its package gone and fail before its
entrypoint ran, with `tidal submit` saying only FAILED. Each submission now uploads a package of
its own (tidal.launch.jobs.package_working_dir)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.conftest import ONE_WORKER, ROOT, tiny_spec
from tidal.cli import main
from tidal.launch.jobs import Job, connect, submit

pytestmark = pytest.mark.slow


@pytest.mark.extended  # outside the suite's budget (pyproject.toml): every submission's own package; tidal submit runs in test_jobs
def test_ten_jobs_from_one_folder_all_start(head, tmp_path, monkeypatch, capsys):
    """Ten jobs submitted one after another from the same folder, through `tidal submit` and the
    SDK: each starts (its entrypoint runs and it succeeds) from a package of its own. The first trains
    a few steps; the other nine find the job complete and end at once, which keeps this cheap while
    each still starts its entrypoint."""
    monkeypatch.chdir(ROOT)
    spec = tiny_spec(tmp_path, name="ten", **{"train.steps": 4, "checkpoint.every_steps": 4, **ONE_WORKER})
    path = tmp_path / "ten.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    first = submit(spec, head, ROOT)
    assert first.wait(timeout=400) == "SUCCEEDED", first.logs()[-3000:]
    ids = [first.submission_id]
    for i in range(9):
        if i % 2:  # the SDK
            job = submit(spec, head, ROOT)
            assert job.wait(timeout=200) == "SUCCEEDED", job.logs()[-3000:]
            ids.append(job.submission_id)
        else:  # the CLI, following the job to its end
            code = main(["submit", str(path), "--address", head])
            out = capsys.readouterr().out
            assert code == 0, out[-3000:]
            assert "already complete at step 4" in out
            ids.append(out.split("submitted 'ten' as ")[1].split()[0])
    client = connect(head)
    infos = [client.get_job_info(i) for i in ids]
    assert [str(i.status.value) for i in infos] == ["SUCCEEDED"] * 10
    packages = [i.runtime_env["working_dir"] for i in infos]
    assert len(set(packages)) == 10, f"a package was shared between submissions: {packages}"


def test_a_job_that_fails_in_its_runtime_env_says_why(head, tmp_path, monkeypatch, capsys):
    """A package Ray cannot unpack fails the job's runtime environment before its entrypoint runs:
    `tidal submit`, `tidal status`, `tidal logs` and Job.status() give the Jobs API's reason."""
    import tidal.launch.jobs as jobs

    def broken_package(root: Path, excludes: list[str], dest: Path) -> Path:
        bad = dest / "working_dir.zip"
        bad.write_bytes(b"not a zip archive at all")
        return bad

    monkeypatch.setattr(jobs, "package_working_dir", broken_package)
    spec = tiny_spec(tmp_path, name="never-starts")
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    assert main(["submit", str(path), "--address", head]) == 1
    out = capsys.readouterr().out
    job_id = out.split("submitted 'never-starts' as ")[1].split()[0]
    assert f"[tidal] job {job_id} failed before its entrypoint ran: runtime_env setup failed" in out, out[-3000:]
    assert out.rstrip().endswith("FAILED")

    assert main(["status", job_id, "--address", head]) == 0
    status = capsys.readouterr().out
    assert status.startswith(f"{job_id}: FAILED before its entrypoint ran: runtime_env setup failed"), status
    assert main(["logs", job_id, "--address", head]) == 0
    assert "failed before its entrypoint ran: runtime_env setup failed" in capsys.readouterr().out
    state = Job(job_id, head).status()
    assert state == "FAILED" and state.reason and "runtime_env setup failed" in state.reason
