"""The payments service the integrations' shop agents act on, as seen from outside
ratchet: a folder (``PAI_SHOP_DIR``) shared by every process of a test. An effect is a
file named by its idempotency key, created at most once; every call and every model
request is a line in a log, so a test counts them from outside.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

from ratchet.tools import ToolCall

SHOP_DIR_ENV = "PAI_SHOP_DIR"


def shop_dir() -> Path:
    return Path(os.environ[SHOP_DIR_ENV])


def log(name: str, entry: dict[str, Any]) -> None:
    with open(shop_dir() / name, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(entry) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def _lines(name: str) -> list[dict[str, Any]]:
    path = shop_dir() / name
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def tool_calls(tool: str) -> int:
    """How many times the service was called for ``tool`` (repeats included)."""
    return sum(1 for e in _lines("calls.log") if e["tool"] == tool)


def effects(tool: str) -> int:
    """How many effects ``tool`` made (one file each, made at most once per key)."""
    folder = shop_dir() / tool
    return len(list(folder.iterdir())) if folder.exists() else 0


def model_requests(agent: str) -> int:
    """How many times the model of ``agent`` was asked, in every process."""
    return sum(1 for e in _lines("model.log") if e["agent"] == agent)


def effect(tool: str, record: dict[str, Any], call: ToolCall | None) -> dict[str, Any]:
    """Make the effect once per idempotency key (a new key when there is none)."""
    key = call.idempotency_key if call is not None and call.idempotency_key else uuid.uuid4().hex
    log("calls.log", {"tool": tool, "key": key})
    folder = shop_dir() / tool
    folder.mkdir(exist_ok=True)
    path = folder / key
    try:
        with open(path, "x", encoding="utf-8") as fh:
            fh.write(json.dumps(record))
    except FileExistsError:  # the same key again: the stored outcome, no second effect
        return {**json.loads(path.read_text(encoding="utf-8")), "repeat": True}
    return record
