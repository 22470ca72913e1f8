"""train.step_fn for tests/test_secrets_e2e.py: each rank records a hash of every secret it was given
(never the value) in TIDAL_TEST_PROBE_DIR/<rank>.json, once, and prints one of them as careless user
code might; then computes the loss as usual."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

NAMES = ("HF_TOKEN", "DB_PASSWORD")


def digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def step(model: Any, batch: Any) -> Any:
    import ray.train

    out = Path(os.environ["TIDAL_TEST_PROBE_DIR"]) / f"{ray.train.get_context().get_world_rank()}.json"
    if not out.exists():
        out.write_text(json.dumps({k: digest(os.environ[k]) if k in os.environ else None for k in NAMES}))
        # as user code may: the worker masks its own secrets in what it prints (Ray copies it to the job's log)
        print(f"the probe sees {os.environ.get('HF_TOKEN')} as its token", flush=True)
    return model(*batch)
