"""Which `extended` tests (pyproject.toml: outside the suite's time budget) a CI run takes: CI carries them in
rotation, a share per run, since a test that never runs rots silently and only CI runs here.

The extended tests are cut into the fewest shares whose measured durations each fit `BUDGET_S` (longest test
first, each into the share with least time so far), and a commit runs share `commit count mod N`: consecutive
commits take the shares in turn, so every extended test runs at least once every N commits that CI runs in a
row, and a rerun of a commit runs the same share. A shallow clone (no count) takes the share its sha names.

    python -m tests.rotation    # prints the share's test ids, one a line; says which share on stderr

The durations (`tests/assets/extended_durations.json`) are one full `pytest -m extended --durations=0` run's,
on this project's shared 2-core machine (a quiet one is faster, so the estimate errs long); a test not there
yet counts as `UNMEASURED_S`. Regenerate after adding extended tests:

    python -m pytest -m extended --durations=0 | python -m tests.rotation --record

A test that failed is not recorded (it stopped early); one measured before keeps the longer of its times; a test
that is not extended (any more) is dropped.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DURATIONS = ROOT / "tests" / "assets" / "extended_durations.json"
# CI has 90 minutes; the install, the quick tests and the slow stage take about 40 of them (the slow stage
# alone 33 min 15 s on 2026-11-28), so the extended stage gets at most 20, leaving 30 to spare.
BUDGET_S = 20 * 60.0
UNMEASURED_S = 180.0  # a new extended test's guess until it is measured: a long end-to-end run


@dataclass(frozen=True)
class Share:
    index: int
    count: int
    ids: tuple[str, ...]
    estimate_s: float


def partition(durations: Mapping[str, float], budget_s: float) -> list[list[str]]:
    """The fewest shares that each fit `budget_s`; within a share, the ids keep their sorted order (ties and
    order never depend on dict order, so every machine cuts the same shares)."""
    if not durations:
        return [[]]
    too_long = {i: d for i, d in durations.items() if d > budget_s}
    if too_long:
        raise ValueError(f"extended tests longer than the whole budget of {budget_s:.0f} s alone: {too_long}; "
                         "shorten them, or move them out of `extended` into a stage of their own")
    order = sorted(durations, key=lambda i: (-durations[i], i))
    count = max(1, -(-int(sum(durations.values())) // int(budget_s)))  # the total's ceiling: no fewer can fit
    while True:
        loads = [0.0] * count
        shares: list[list[str]] = [[] for _ in range(count)]
        for test in order:
            k = min(range(count), key=lambda j: (loads[j], j))
            loads[k] += durations[test]
            shares[k].append(test)
        if max(loads) <= budget_s:
            return [sorted(s) for s in shares]
        count += 1


def share_index(count: int, commits: int | None, sha: str) -> int:
    """The share a commit runs: its count of commits (its place in the history) when known, else its sha's."""
    if commits is not None:
        return commits % count
    return int(sha[:12] or "0", 16) % count if re.fullmatch(r"[0-9a-fA-F]*", sha) else 0


def choose(ids: Iterable[str], measured: Mapping[str, float], commits: int | None, sha: str,
           budget_s: float = BUDGET_S) -> Share:
    durations = {i: measured.get(i, UNMEASURED_S) for i in ids}
    shares = partition(durations, budget_s)
    k = share_index(len(shares), commits, sha)
    return Share(k, len(shares), tuple(shares[k]), sum(durations[i] for i in shares[k]))


def parse_durations(lines: Iterable[str]) -> dict[str, float]:
    """Per test that passed, the sum of its setup, call and teardown from pytest's `--durations=0` lines; a
    test that failed or errored (pytest's `-ra` summary names it) stopped early, so its time says nothing."""
    out: dict[str, float] = {}
    failed: set[str] = set()
    for line in lines:
        if m := re.match(r"\s*([0-9.]+)s (?:setup|call|teardown)\s+(\S+::\S+)", line):
            out[m.group(2)] = round(out.get(m.group(2), 0.0) + float(m.group(1)), 1)
        elif m := re.match(r"(?:FAILED|ERROR) (\S+::\S+)", line):
            failed.add(m.group(1))
    return {test: s for test, s in out.items() if test not in failed}


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _commit() -> tuple[int | None, str]:
    sha = _git("rev-parse", "HEAD") or ""
    shallow = _git("rev-parse", "--is-shallow-repository") != "false"
    count = None if shallow else _git("rev-list", "--count", "HEAD")
    return (int(count) if count else None), sha


def _collect() -> list[str]:
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "extended"], cwd=ROOT,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"collecting the extended tests failed:\n{done.stdout}{done.stderr}")
    return [line.strip() for line in done.stdout.splitlines() if "::" in line]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.rotation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", action="store_true",
                        help="read `pytest --durations=0` output on stdin and write it to " + DURATIONS.name)
    args = parser.parse_args(argv)
    if args.record:  # several reports (a run in batches) add up; a test measured twice keeps its longer time
        measured = parse_durations(sys.stdin)
        kept = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
        kept |= {test: max(s, kept.get(test, 0.0)) for test, s in measured.items()}
        # Only extended tests: a report of a run that also took suite tests, or a test renamed or moved back
        # into the suite, would otherwise leave entries the rotation never reads.
        extended, before = set(_collect()), len(kept)
        kept = {test: s for test, s in kept.items() if test in extended}
        dropped = before - len(kept)
        DURATIONS.write_text(json.dumps(dict(sorted(kept.items())), indent=1) + "\n")
        print(f"recorded {len(measured)} durations in {DURATIONS.relative_to(ROOT)} ({len(kept)} in all; "
              f"{dropped} of tests that are not extended dropped)", file=sys.stderr)
        return 0
    measured = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    commits, sha = _commit()
    share = choose(_collect(), measured, commits, sha)
    where = f"commit {sha[:12] or '?'}" + (f" (#{commits})" if commits is not None else " (shallow: by its sha)")
    print(f"== extended: share {share.index + 1} of {share.count} for {where}, {len(share.ids)} tests, "
          f"about {share.estimate_s / 60:.0f} min measured:", file=sys.stderr)
    for test in share.ids:
        print(f"   {test}", file=sys.stderr)
    print("\n".join(share.ids))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
