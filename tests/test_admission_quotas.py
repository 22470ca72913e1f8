"""The cluster's quota file: the shipped example loads, bad files are refused naming the key and
the fix, and a job's team and priority resolve against it (or are refused with the choices)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT
from tidal.admission.quotas import QuotaFileError, cluster_quotas, load_quotas, resolve_scheduling
from tidal.errors import SpecError

EXAMPLE = ROOT / "cluster_configs" / "quotas.yaml"


def write(tmp_path: Path, data: object) -> str:
    path = tmp_path / "quotas.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def problems_of(tmp_path: Path, data: object) -> str:
    with pytest.raises(QuotaFileError) as e:
        load_quotas(write(tmp_path, data))
    return str(e.value)


def test_shipped_example_loads_with_its_teams_and_budgets():
    q = load_quotas(str(EXAMPLE))
    assert q.priorities == ["low", "normal", "high"] and q.defaults.team in q.teams
    assert any(t.cloud_budget is not None for t in q.teams.values())


@pytest.mark.parametrize(("data", "key", "hint"), [
    ({"teams": {"vision": {"onprem": {"guaranted": 4}}}}, "teams.vision.onprem.guaranted", "did you mean 'guaranteed'"),
    ({"teams": {"vision": {"onprem": {"guaranteed": -1}}}}, "teams.vision.onprem.guaranteed", "greater than or equal"),
    ({"teams": {"v": {"cloud_budget": {}}}}, "teams.v.cloud_budget", "exactly one of gpu_hours_per_day or cost_per_day"),
    ({"priorities": ["low", "high"]}, "defaults", "set defaults.priority to one of them"),
    ({"priorities": ["low", "low"], "defaults": {"priority": "low"}}, "priorities", "listed twice"),
    ({"teams": {"a": {}}, "defaults": {"team": "b"}}, "defaults", "not one of the teams (a)"),
    ({"unit": "tpus"}, "unit", "'workers' or 'gpus'"),
    (["not", "a", "mapping"], "<file>", "YAML mapping"),
])
def test_bad_quota_file_is_refused_naming_the_key_and_the_fix(tmp_path, data, key, hint):
    message = problems_of(tmp_path, data)
    assert f"  {key}:" in message and hint in message


def test_unreadable_quota_file_says_which_variable_names_it(tmp_path):
    with pytest.raises(QuotaFileError, match="TIDAL_QUOTAS"):
        cluster_quotas({"TIDAL_QUOTAS": str(tmp_path / "missing.yaml")})
    assert cluster_quotas({}) is None


def test_team_and_priority_default_from_the_quota_file():
    q = load_quotas(str(EXAMPLE))
    assert resolve_scheduling(None, None, q) == (q.defaults.team, q.defaults.priority)
    assert resolve_scheduling(None, "high", None) == ("default", "high")


def test_unknown_priority_or_team_is_refused_listing_the_defined_ones(tmp_path):
    q = load_quotas(write(tmp_path, {"priorities": ["batch", "interactive"], "defaults": {"priority": "batch"},
                                     "teams": {"vision": {}, "nlp": {}}}))
    with pytest.raises(SpecError) as e:
        resolve_scheduling("robotics", "high", q)
    text = str(e.value)
    assert "scheduling.team: 'robotics'" in text and "vision" in text and "nlp" in text
    assert "scheduling.priority: 'high'" in text and "batch, interactive" in text
    with pytest.raises(SpecError, match="names no default team"):
        resolve_scheduling(None, None, q)
    assert resolve_scheduling("nlp", "interactive", q) == ("nlp", "interactive")


# --- `tidal cluster validate` ---------------------------------------------------------------------

def test_cluster_validate_checks_the_quota_file_a_config_names(tmp_path):
    from tidal.cluster.check import validate_cluster_config

    config = tmp_path / "onprem.yaml"
    config.write_text((ROOT / "cluster_configs" / "onprem.yaml").read_text())
    # the file of the name TIDAL_QUOTAS gives, beside the config: the copy that is deployed
    (tmp_path / "quotas.yaml").write_text(yaml.safe_dump({"teams": {"v": {"onprem": {"guaranted": 1}}}}))
    problems = validate_cluster_config(config)
    assert problems and all("TIDAL_QUOTAS (quotas.yaml) teams.v.onprem.guaranted" in w for w, _ in problems)
    assert "did you mean 'guaranteed'" in problems[0][1]
    (tmp_path / "quotas.yaml").write_text(EXAMPLE.read_text())
    assert validate_cluster_config(config) == []


def test_cluster_validate_refuses_a_relative_quota_path(tmp_path):
    from tidal.cluster.check import validate_cluster_config

    config = tmp_path / "onprem.yaml"
    config.write_text((ROOT / "cluster_configs" / "onprem.yaml").read_text()
                      .replace("TIDAL_QUOTAS=/mnt/tidal/quotas.yaml", "TIDAL_QUOTAS=quotas.yaml"))
    problems = validate_cluster_config(config)
    assert [w for w, _ in problems] == ["head_start_ray_commands[2].TIDAL_QUOTAS",
                                        "worker_start_ray_commands[1].TIDAL_QUOTAS"]
    assert "relative" in problems[0][1]


def test_a_quota_file_validates_as_itself(tmp_path):
    from tidal.cluster.check import validate_cluster_config

    path = Path(write(tmp_path, {"teams": {"v": {"cloud": {"borow": 1}}}}))
    assert [w for w, _ in validate_cluster_config(path)] == ["teams.v.cloud.borow"]


# --- `tidal submit --team T --priority P` ----------------------------------------------------------

def test_submit_flags_override_the_specs_team_and_priority(monkeypatch):
    from tidal import cli
    from tidal.launch import jobs

    seen = {}

    def fake_submit(spec, address, working_dir):
        seen["scheduling"] = spec.scheduling
        raise SystemExit(0)  # stop before following a job that does not exist

    monkeypatch.setattr(jobs, "submit", fake_submit)
    with pytest.raises(SystemExit):
        cli.main(["submit", str(ROOT / "jobs/quickstart.yaml"), "--address", "http://127.0.0.1:9",
                  "--team", "production", "--priority", "high"])
    assert (seen["scheduling"].team, seen["scheduling"].priority) == ("production", "high")


def test_submit_refuses_a_priority_the_clusters_quota_file_lacks_before_contacting_it(monkeypatch, tmp_path, capsys):
    from tidal import cli
    from tidal.launch import jobs

    monkeypatch.setenv("TIDAL_QUOTAS", str(EXAMPLE))
    monkeypatch.setattr(jobs, "connect", lambda address: pytest.fail("contacted the cluster"))
    code = cli.main(["submit", str(ROOT / "jobs/quickstart.yaml"), "--address", "http://127.0.0.1:9",
                     "--working-dir", str(tmp_path), "--priority", "urgent"])
    err = capsys.readouterr().err
    assert code == 2 and "scheduling.priority: 'urgent'" in err and "low, normal, high" in err
