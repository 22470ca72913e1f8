"""Secrets by reference (tidal.spec.secrets): what a spec's `env` accepts, how an inline value is
refused, and what a worker says when a referenced secret is not on its node. No Ray here: the end
to end check against a real head is tests/test_secrets_e2e.py."""

from __future__ import annotations

import pytest

from tidal.errors import SpecError
from tidal.spec.job import JobSpec
from tidal.spec.load import load_spec, validate
from tidal.spec.secrets import SecretMissing, resolve


@pytest.mark.parametrize("given, stored", [
    ("env:HF_TOKEN", "env:HF_TOKEN"),
    ({"from_env": "NODE_HF"}, "env:NODE_HF"),
    ("file:/etc/tidal/secrets/hf_token", "file:/etc/tidal/secrets/hf_token"),
    ({"from_file": "/run/secrets/db"}, "file:/run/secrets/db"),
])
def test_both_forms_of_a_reference_are_stored_as_one(given, stored):
    assert JobSpec(env={"HF_TOKEN": given}).env == {"HF_TOKEN": stored}


def test_a_reference_set_from_the_command_line(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("name: j\n")
    assert load_spec(path, ["env.HF_TOKEN=file:/etc/tidal/secrets/hf_token"]).env == {
        "HF_TOKEN": "file:/etc/tidal/secrets/hf_token"}


@pytest.mark.parametrize("value", ["hf_abcdef123456", "s3cr3t:value", 12345, "environment:X"])
def test_an_inline_value_is_refused_naming_the_key_and_never_echoing_it(value):
    with pytest.raises(SpecError) as e:
        validate({"env": {"HF_TOKEN": value}})
    (path, msg), = e.value.problems
    assert path == "env.HF_TOKEN"
    assert "inline" in msg and "HF_TOKEN: env:NODE_VAR" in msg and "file:/etc/tidal/secrets/hf_token" in msg
    assert str(value) not in str(e.value)


@pytest.mark.parametrize("ref, says", [
    ("file:secrets/hf", "must be an absolute path"),
    ("env:not a name", "does not name an environment variable"),
    ({"from_env": "A", "from_file": "/b"}, "one of"),
    ({"from_vault": "x"}, "one of"),
])
def test_a_malformed_reference_says_what_is_wrong(ref, says):
    with pytest.raises(SpecError) as e:
        validate({"env": {"TOKEN": ref}})
    (path, msg), = e.value.problems
    assert path == "env.TOKEN" and says in msg


def test_a_plain_setting_goes_in_worker_env_but_not_one_named_as_a_credential():
    assert JobSpec(worker_env={"TOKENIZERS_PARALLELISM": "false"}).worker_env == {"TOKENIZERS_PARALLELISM": "false"}
    with pytest.raises(SpecError) as e:
        validate({"worker_env": {"WANDB_API_KEY": "abc123"}})
    (path, msg), = e.value.problems
    assert path == "worker_env.WANDB_API_KEY" and "env: {WANDB_API_KEY: env:NODE_VAR}" in msg
    assert "abc123" not in str(e.value)


def test_resolve_reads_the_node_environment_and_files(tmp_path):
    (tmp_path / "db").write_text("pw-from-file\n")  # as `echo` writes it: the newline is no part of it
    env = JobSpec(env={"HF_TOKEN": "env:NODE_HF", "DB_PASSWORD": {"from_file": str(tmp_path / "db")}}).env
    assert resolve(env, environ={"NODE_HF": "hf-value"}) == {"HF_TOKEN": "hf-value", "DB_PASSWORD": "pw-from-file"}


def test_resolve_names_every_missing_key_and_reference(tmp_path):
    env = {"HF_TOKEN": "env:NODE_HF", "DB_PASSWORD": f"file:{tmp_path}/absent", "OK": "env:PRESENT"}
    with pytest.raises(SecretMissing) as e:
        resolve(env, environ={"PRESENT": "the-value"})
    text = str(e.value)
    assert "env.HF_TOKEN (env:NODE_HF): the variable NODE_HF is not set on this node" in text
    assert f"env.DB_PASSWORD (file:{tmp_path}/absent): cannot read the file on this node (No such file" in text
    assert "env.OK" not in text and "the-value" not in text



def test_validate_shows_where_each_secret_comes_from(tmp_path, capsys):
    from tidal.cli import main

    path = tmp_path / "job.yaml"
    path.write_text("name: v\nenv:\n  HF_TOKEN: env:NODE_HF\n  DB_PASSWORD: file:/etc/tidal/secrets/db\n")
    assert main(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "HF_TOKEN: env:NODE_HF" in out and "DB_PASSWORD: file:/etc/tidal/secrets/db" in out
