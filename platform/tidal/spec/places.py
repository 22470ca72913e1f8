"""Where a job keeps things: storage, tracking URI and experiment resolved from the spec, the
cluster's environment or the laptop defaults, and every relative path made absolute (JobSpec.resolved)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidal.errors import SpecError

if TYPE_CHECKING:
    from tidal.spec.job import JobSpec


def resolved_places(spec: JobSpec, base_dir: Path, env: Mapping[str, str]) -> dict[str, Any]:
    """The overrides that make `spec`'s places concrete (see JobSpec.resolved)."""
    storage = spec.checkpoint.storage or env.get("TIDAL_STORAGE") or DEFAULT_STORAGE
    uri = spec.tracking.uri or env.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI
    experiment = spec.tracking.experiment or env.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
    if in_ray_working_dir(base_dir):
        storage, uri = _outside_working_dir(storage, uri, env.get("TIDAL_STORAGE"))
    if "://" not in storage:
        storage = str((base_dir / storage).resolve())
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        uri = "sqlite:///" + str((base_dir / uri[len("sqlite:///"):]).resolve())
    elif "://" not in uri and not uri.startswith("databricks"):
        uri = str((base_dir / uri).resolve())
    source = spec.data.source
    if source != "synthetic" and "://" not in source:
        source = str((base_dir / source).resolve())
    tokenizer = spec.data.tokenizer
    if tokenizer is not None and "://" not in tokenizer:
        tokenizer = str((base_dir / tokenizer).resolve())
    return {"checkpoint.storage": storage, "tracking.uri": uri, "tracking.experiment": experiment,
            "data.source": source, "data.tokenizer": tokenizer}


DEFAULT_STORAGE = "./tidal-runs"
DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
DEFAULT_EXPERIMENT = "tidal"


def in_ray_working_dir(path: Path) -> bool:
    """True inside the folder Ray unpacks a submitted job's working_dir into: it is shared by every
    job submitted from an identical folder and vanishes with the Ray session."""
    return "runtime_resources" in path.resolve().parts


def _outside_working_dir(storage: str, uri: str, cluster_storage: str | None) -> tuple[str, str]:
    """Storage and tracking URI for a submitted job: never relative to Ray's working-dir cache."""
    problems = []
    if cluster_storage and "://" not in cluster_storage and not os.path.isabs(cluster_storage):
        problems.append(("checkpoint.storage", f"the cluster's TIDAL_STORAGE {cluster_storage!r} is relative; set it "
                         "on the cluster's nodes to a path every node shares or an s3:// URI"))
    elif "://" not in storage and not os.path.isabs(storage):
        if cluster_storage:
            storage = f"{cluster_storage.rstrip('/')}/{storage.removeprefix('./').strip('/')}"
        else:
            problems.append(("checkpoint.storage", f"{storage!r} is relative, and a submitted job runs inside Ray's "
                             "temporary working-dir copy, which later jobs reuse and the cluster deletes. Set "
                             "TIDAL_STORAGE on the cluster's nodes (see cluster_configs/), or set checkpoint.storage "
                             "to a path every node shares or an s3:// URI"))
    relative_path = "://" not in uri and not os.path.isabs(uri) and not uri.startswith("databricks")
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////") or relative_path:
        problems.append(("tracking.uri", f"{uri!r} is relative, so the MLflow store would live inside Ray's temporary "
                         "working-dir copy where nobody can see it. Set MLFLOW_TRACKING_URI on the cluster's nodes "
                         "(cluster_configs/ start an mlflow server on the head), or set tracking.uri to a server "
                         "(http://HEAD:5000)"))
    if problems:
        raise SpecError(problems, source="submitted job")
    return storage, uri
