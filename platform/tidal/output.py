"""What Tidal prints, shared by every command and layer (the lowest layer: it imports only `errors`).

`--output table|json` for the commands that show state (list, status, runs, cluster status):
tables are for people; json is one document on stdout for scripts (`| jq`), with the fields each
command's --help names. Notes and errors go to stderr, so stdout always parses. A job's record
line (`print_record`) is how a submitted job tells the submitter where it tracks and stores.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback
from collections.abc import Iterable
from typing import Any

from tidal.errors import JobAlreadyRunning, SpecError, TidalError, UsageError
from tidal.redact import redact_data, redact_text

EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


def add_output_flag(parser: argparse.ArgumentParser, fields: str) -> None:
    """`fields` says what the json document holds, for the command's --help."""
    parser.add_argument("--output", choices=["table", "json"], default="table",
                        help=f"table (default) for people, or json for scripts: {fields}")


def print_json(data: Any) -> None:
    """Redacted (tidal/redact.py): a record or run's params may quote a credential-bearing URI."""
    print(json.dumps(finite(redact_data(data)), indent=2))


def finite(data: Any) -> Any:
    """NaN and infinity (a diverged loss) as null: json.dumps would write NaN, which is not JSON."""
    if isinstance(data, float) and not math.isfinite(data):
        return None
    if isinstance(data, dict):
        return {k: finite(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [finite(v) for v in data]
    return data


def exit_code(e: TidalError) -> int:
    """2 when nothing could start as asked (scripts should not retry), 1 when it ran and failed."""
    return EXIT_USAGE if isinstance(e, (SpecError, UsageError, JobAlreadyRunning)) else EXIT_FAILED


def print_error(e: BaseException) -> None:
    """The message only; the traceback too under TIDAL_DEBUG=1."""
    if os.environ.get("TIDAL_DEBUG") == "1":
        traceback.print_exception(e)
    print(redact_text(f"error: {e}"), file=sys.stderr)


def print_notes(lines: Iterable[str]) -> None:
    """To stderr, so that stdout stays what the command promises (e.g. YAML from `validate`)."""
    for line in lines:
        print(f"note: {line}", file=sys.stderr)


# A submitted job prints one line starting with this, holding where it tracks and stores (name,
# tracking_uri, experiment, mlflow_run_id, storage), for the submitter's `Job`: the Jobs API has
# no other channel from a running job back to the laptop. Its format is a contract, unlike the
# progress lines; the last one printed wins (a run created late prints it again).
RECORD_PREFIX = "[tidal-record] "


def print_record(data: dict[str, Any]) -> None:
    """Redacted: the job's logs are readable by every holder of the cluster's token. A reader
    whose storage or tracking URI needs credentials supplies them from its own environment."""
    print(f"{RECORD_PREFIX}{json.dumps(redact_data(data))}", flush=True)


def parse_record(logs: str) -> dict[str, Any]:
    """The last record in a job's output (Ray may prefix an actor's lines), or {}."""
    for line in reversed(logs.splitlines()):
        at = line.find(RECORD_PREFIX)
        if at >= 0:
            try:
                return json.loads(line[at + len(RECORD_PREFIX):])
            except ValueError:
                continue
    return {}
