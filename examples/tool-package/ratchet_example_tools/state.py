"""The folder the example tools keep their state in: the worker's ``EXAMPLE_TOOLS_DIR``."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["state_dir"]


def state_dir() -> Path:
    """The state folder (made if missing)."""
    named = os.environ.get("EXAMPLE_TOOLS_DIR")
    folder = Path(named) if named else Path.home() / ".local" / "state" / "ratchet-example-tools"
    folder.mkdir(parents=True, exist_ok=True)
    return folder
