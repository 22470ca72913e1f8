"""Just enough shell parsing to read cluster-launcher commands: which program a `ray start` or
`mlflow server` line runs, with which flags and which environment variables."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from typing import Any

# Shell separators between simple commands: ; && || newline, and a lone & (not 2>&1 or &>).
_SEPARATORS = re.compile(r"\s*(?:;|&&|\|\||\n|(?<![>&])&(?![&>]))\s*")
_ASSIGNMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)", re.DOTALL)


def under(path: str, root: str) -> bool:
    """`path` is the folder `root` or lies below it."""
    root = root.rstrip("/")
    return bool(root) and (path.rstrip("/") == root or path.startswith(root + "/"))


def shell_steps(command: str) -> Iterator[tuple[dict[str, str], list[str]]]:
    """Each simple command of a shell line, with the variables it gets from this line (earlier
    `export`s and its own `NAME=value` prefix) and its words, assignments removed."""
    exported: dict[str, str] = {}
    for segment in _SEPARATORS.split(command):
        words = shell_words(segment)
        if words[:1] == ["export"]:
            exported.update(m.groups() for w in words[1:] if (m := _ASSIGNMENT.fullmatch(w)))
            yield dict(exported), words
            continue
        i = 0
        while i < len(words) and _ASSIGNMENT.fullmatch(words[i]):
            i += 1
        if words[i:]:
            prefix = dict(m.groups() for w in words[:i] if (m := _ASSIGNMENT.fullmatch(w)))
            yield {**exported, **prefix}, words[i:]


def runs(words: list[str], program: str, subcommand: str) -> bool:
    """`words` run `program subcommand` (`ray start`, `~/venv/bin/ray start`, `nohup mlflow server`)."""
    return any(w.rsplit("/", 1)[-1] == program and nxt == subcommand for w, nxt in zip(words, words[1:], strict=False))


def shell_words(line: str) -> list[str]:
    try:
        return shlex.split(line)
    except ValueError:
        return line.split()


def flags_of(words: list[str]) -> dict[str, str]:
    """`--key=value` / `--key value` flags (enough for `ray start` and `mlflow server`)."""
    flags: dict[str, str] = {}
    for i, word in enumerate(words):
        if not word.startswith("--"):
            continue
        key, eq, value = word[2:].partition("=")
        if not eq and i + 1 < len(words) and not words[i + 1].startswith("--"):
            value = words[i + 1]
        flags[key] = value
    return flags


def number(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_labels(text: str) -> dict[str, str]:
    pairs = (item.partition("=") for item in text.split(",") if "=" in item)
    return {k.strip(): v.strip() for k, _, v in pairs}


def parse_resources(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text.strip().strip("'\""))
    except ValueError:
        try:
            value = json.loads(json.loads(text))  # KubeRay's '"{\"a\": 1}"' form
        except (ValueError, TypeError):
            return {}
    return value if isinstance(value, dict) else {}
