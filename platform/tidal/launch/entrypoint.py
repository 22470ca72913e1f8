"""What a submitted Ray job runs: decode the spec `tidal submit` shipped, then `run(spec)`."""

from __future__ import annotations

import base64
import json
import sys

from tidal.errors import TidalError
from tidal.output import exit_code, print_error
from tidal.redact import install
from tidal.spec.load import validate
from tidal.tracking.quiet import skip_known_ray_errors


def main(argv: list[str]) -> int:
    skip_known_ray_errors()  # before `import ray`: this process is the job's driver (tracking/quiet.py)
    # What this driver prints, Ray's copies of the workers' lines included, is what `ray job logs`
    # shows every token holder: the one redaction rule applies, as on `tidal run`'s console.
    install()
    try:
        data = json.loads(base64.urlsafe_b64decode(argv[0]))
        spec = validate(data, source="submitted spec")
        from tidal.launch.trainer import run

        result = run(spec)
    except TidalError as e:
        print_error(e)
        return exit_code(e)
    print(result.summary())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
