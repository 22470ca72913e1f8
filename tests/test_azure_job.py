"""A job on Azure Blob Storage reached only through an `abfs://` storage URI and the environment
Azure's own tools read (tidal/azure_blob.py), on Azurite, Microsoft's emulator: it trains, saves
and finishes, its checkpoints, lease and event log on the emulator."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

import tidal
from tests.conftest import _shared_ray, tiny_spec
from tidal import fs
from tidal.testing.object_stores import AZURITE_ACCOUNT, AZURITE_KEY, azurite_blob, azurite_path

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(azurite_path() is None, reason="Azurite is not installed (npm install -g azurite)")]
CONN = "AZURE_STORAGE_CONNECTION_STRING"


@pytest.fixture(scope="module")
def azurite_env(tmp_path_factory) -> Iterator[str]:
    """Azurite, and its connection string in this process's environment before this module's Ray
    starts, as a cluster's nodes would have it: Ray's workers inherit it."""
    _shared_ray.stop()  # a Ray started before would have workers without it
    with azurite_blob(tmp_path_factory.mktemp("azurite")) as endpoint:
        before = os.environ.get(CONN)
        os.environ[CONN] = (f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
                            f"BlobEndpoint=http://{endpoint}/{AZURITE_ACCOUNT};")
        try:
            yield endpoint
        finally:
            _shared_ray.stop()  # the next module's Ray starts without it
            if before is None:
                os.environ.pop(CONN, None)
            else:
                os.environ[CONN] = before


@pytest.fixture(scope="module")
def azure_ray(azurite_env) -> Iterator[None]:
    """The shared local Ray, started here once the connection string is in the environment: through
    `ray_local` it could start first (fixtures of one scope set up in no promised order), and its
    workers then had no key (the tracker fell back to pyarrow's DefaultAzureCredential and aborted)."""
    import ray

    _shared_ray.stop()
    ray.shutdown()
    _shared_ray.start()
    yield


def test_a_job_with_an_abfs_storage_uri_trains_and_saves_on_azurite(azure_ray, tmp_path):
    storage = f"abfs://tidal@{AZURITE_ACCOUNT}.dfs.core.windows.net/runs"  # as Azure's docs write one
    spec = tiny_spec(tmp_path, name="on-azure", **{"train.steps": 6, "checkpoint.every_steps": 3,
                                                   "checkpoint.storage": storage})
    result = tidal.run(spec)
    assert result.error is None and result.path == f"{storage}/on-azure/checkpoint_000000006"
    store, root = fs.resolve(f"{storage}/on-azure")
    files = fs.files_under(store, root)
    assert "checkpoint_000000006/tidal-state.json" in files
    assert any(f.startswith("on-azure.lease/") for f in fs.files_under(store, root.rsplit("/", 1)[0])), "its lease"
