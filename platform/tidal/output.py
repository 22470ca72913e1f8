"""`--output table|json` for the commands that show state (list, status, runs, cluster status).

Tables are for people; json is one document on stdout for scripts (`| jq`), with the fields each
command's --help names. Notes and errors go to stderr, so stdout always parses.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from tidal.redact import redact_data


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
