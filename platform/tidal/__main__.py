"""`python -m tidal`: the same command line as `tidal` (tidal/cli.py)."""

from tidal.cli import main

raise SystemExit(main())
