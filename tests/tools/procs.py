"""Child processes of the test process, read from /proc (tests that count servers)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["children", "state_of"]


def children() -> set[int]:
    """This process's live child processes."""
    found: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            text = (task / "children").read_text().split()
        except OSError:  # a thread that ended meanwhile
            continue
        found.update(int(p) for p in text)
    return {p for p in found if Path(f"/proc/{p}").exists() and state_of(p) != "Z"}


def state_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"
