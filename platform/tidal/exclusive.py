"""Create a file only if it does not exist yet, on a local or shared filesystem and on S3.

pyarrow's filesystems have no conditional create, and a job's lease (tidal/lease.py) needs one:
of two starts that create the same generation file, exactly one must win. An `O_EXCL` create
does it on a local disk and on NFS (v3 and later); on S3 and S3-compatible stores a conditional
PUT (`If-None-Match: *`, honoured by AWS and by moto's server) does, through boto3 for that one
object with the endpoint and credentials the pyarrow filesystem was built with.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import pyarrow.fs as pafs

from tidal import fs

log = logging.getLogger("tidal")


def create_exclusive(store: pafs.FileSystem, path: str, data: dict[str, Any]) -> bool:
    """Create `path` holding `data` only if it does not exist; False if it did."""
    blob = json.dumps(data, indent=2).encode()
    if fs.is_local(store):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)  # exclusive on NFSv3+ too
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        return True
    if isinstance(store, pafs.S3FileSystem):
        return _s3_create_exclusive(store, path, blob)
    # No conditional create is known for this filesystem: check, then write (a race between two
    # starts within the same instant is not excluded here).
    log.warning("[tidal] this storage has no exclusive create Tidal knows of: two starts of one job at the same "
                "instant are not excluded")
    if fs.exists(store, path):
        return False
    with store.open_output_stream(path) as f:
        f.write(blob)
    return True


def _s3_create_exclusive(store: pafs.S3FileSystem, path: str, blob: bytes) -> bool:
    """A conditional PUT (If-None-Match: *), which S3 and S3-compatible stores honour: pyarrow
    has none, so this one object goes through boto3 with the same endpoint and credentials."""
    import boto3
    import botocore.exceptions

    bucket, _, key = path.partition("/")
    s3 = boto3.client("s3", **_s3_options(store))
    try:
        s3.put_object(Bucket=bucket, Key=key, Body=blob, IfNoneMatch="*")
    except botocore.exceptions.ClientError as e:
        code = e.response.get("Error", {}).get("Code", "")
        if code in ("PreconditionFailed", "ConditionalRequestConflict") or \
                e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") in (409, 412):
            return False
        raise OSError(f"could not create {path}: {code or e}") from None
    return True


def _s3_options(store: pafs.S3FileSystem) -> dict[str, str]:
    """boto3 client options for the endpoint, region and credentials a pyarrow S3 filesystem
    was built with (from its URI or the AWS_* environment, which boto3 also reads)."""
    options: dict[str, str] = {}
    try:
        reduced = store.__reduce__()[1]  # pyarrow keeps its options only in its pickle arguments
        kwargs: dict[str, Any] = reduced[0] if reduced and isinstance(reduced[0], dict) else {}
    except Exception:  # noqa: BLE001 - an older pyarrow: the environment decides, as for boto3 alone
        kwargs = {}
    if endpoint := kwargs.get("endpoint_override"):
        scheme = kwargs.get("scheme") or "https"
        options["endpoint_url"] = endpoint if "://" in endpoint else f"{scheme}://{endpoint}"
    if region := kwargs.get("region"):
        options["region_name"] = region
    if kwargs.get("access_key"):
        options["aws_access_key_id"] = kwargs["access_key"]
        options["aws_secret_access_key"] = kwargs.get("secret_key") or ""
    return options
