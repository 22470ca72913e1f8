"""Test-only hooks (tidal/test_hooks.py): every fault or pause a test injects into production code
through the environment is named there, with one prefix, and read through it alone."""

from __future__ import annotations

import re

from tests.conftest import ROOT

PACKAGE = ROOT / "platform" / "tidal"
# The hooks' names before they were gathered: none may come back
OLD = ("TIDAL_CHECKPOINT_WRITE_DELAY_S", "TIDAL_MEMORY_SNAPSHOT_DELAY_S", "TIDAL_MEMORY_LOAD_PAUSE")


def test_the_test_hooks_are_named_in_one_place_with_one_prefix_and_read_only_through_it():
    from tidal import test_hooks

    assert test_hooks.HOOKS and all(name.startswith(test_hooks.PREFIX) for name in test_hooks.HOOKS)
    assert test_hooks.PREFIX == "TIDAL_TEST_"
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "test_hooks.py" or rel.startswith("testing/"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"[\"']TIDAL_TEST_", line) or any(old in line for old in OLD):
                offenders.append(f"{rel}:{n}: {line.strip()}")
    assert not offenders, "a test hook named or read outside tidal/test_hooks.py:\n" + "\n".join(offenders)


def test_a_hook_is_read_from_the_environment_and_an_unknown_one_is_refused(monkeypatch):
    import pytest

    from tidal import test_hooks

    monkeypatch.setenv(test_hooks.CHECKPOINT_WRITE_DELAY, "3@0")
    assert test_hooks.read(test_hooks.CHECKPOINT_WRITE_DELAY) == "3@0"
    monkeypatch.delenv(test_hooks.CHECKPOINT_WRITE_DELAY)
    assert test_hooks.read(test_hooks.CHECKPOINT_WRITE_DELAY) == ""
    with pytest.raises(KeyError):
        test_hooks.read("TIDAL_DEBUG")
