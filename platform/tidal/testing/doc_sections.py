"""One `## section` of a markdown page replaced in place: how each benchmark writes its latest
invocation into docs/benchmarks.md (benchmarks.common.update_doc) without touching the others."""

from __future__ import annotations


def with_section(text: str, section: str, body: str) -> str:
    """`text` with its `## section` replaced by `body` where it is (or appended last). A section is
    found by its whole title line, never a prefix: "X" must not replace "X, at a 1.5 GB state" too."""
    parts = text.split("\n## ")
    new = f"{section}\n\n{body.strip()}\n"
    sections = [new if p.split("\n", 1)[0] == section else p.rstrip() + "\n" for p in parts[1:]]
    if new not in sections:  # a new section goes last; an existing one keeps its place
        sections.append(new)
    return "\n## ".join([parts[0].rstrip() + "\n", *sections]).rstrip() + "\n"
