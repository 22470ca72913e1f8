"""The package version, in the lowest layer so that any module may name it, and `--version`."""

from __future__ import annotations

import argparse

__version__ = "0.1.0"
VERSIONS_OF = ("ray", "deepspeed", "mlflow", "torch")


class VersionAction(argparse.Action):
    """`--version`: read from package metadata, so torch, ray and the rest are not imported."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        from importlib.metadata import PackageNotFoundError, version

        lines = [f"tidal {__version__}"]
        for name in VERSIONS_OF:
            try:
                lines.append(f"{name} {version(name)}")
            except PackageNotFoundError:
                lines.append(f"{name} not installed")
        print("\n".join(lines))
        parser.exit()
