"""Code that runs inside each Ray Train worker (imports torch and deepspeed)."""

from tidal.tracking.quiet import quiet_libraries

quiet_libraries()  # before any module here imports deepspeed, which warns at import
