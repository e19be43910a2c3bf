"""Checkpoint builders for the saver's tests (ids from a chosen clock, simple configs)."""

from __future__ import annotations

import itertools
import time
from typing import Any
from uuid import UUID

from langgraph.checkpoint.base import Checkpoint

_seq = itertools.count(1)


def uuid6_at(unix_ns: int) -> str:
    """A LangGraph-style UUIDv6 checkpoint id for a worker whose clock reads ``unix_ns``."""
    timestamp = unix_ns // 100 + 0x01B21DD213814000 + next(_seq)
    uuid_int = ((timestamp >> 12) & 0xFFFFFFFFFFFF) << 80
    uuid_int |= (timestamp & 0x0FFF) << 64
    uuid_int |= (next(_seq) & 0x3FFF) << 48
    uuid_int = (uuid_int & ~(0xF000 << 64)) | (6 << 76)  # version 6
    uuid_int = (uuid_int & ~(0xC000 << 48)) | (0x8000 << 48)  # RFC 4122 variant
    return str(UUID(int=uuid_int))


def checkpoint(
    values: dict[str, Any] | None = None,
    *,
    clock_offset_s: int = 0,
    versions: dict[str, Any] | None = None,
) -> Checkpoint:
    """A checkpoint whose id comes from a clock ``clock_offset_s`` off the real one."""
    values = values or {}
    return Checkpoint(
        v=1,
        id=uuid6_at(time.time_ns() + clock_offset_s * 1_000_000_000),
        ts="2026-01-01T00:00:00+00:00",
        channel_values=values,
        channel_versions=versions if versions is not None else dict.fromkeys(values, 1),
        versions_seen={},
        pending_sends=[],
        updated_channels=None,
    )  # type: ignore[typeddict-unknown-key]


def config(
    thread_id: str, *, parent: str | None = None, lease: Any = None, ns: str = ""
) -> dict[str, Any]:
    conf: dict[str, Any] = {"thread_id": thread_id, "checkpoint_ns": ns}
    if parent is not None:
        conf["checkpoint_id"] = parent
    if lease is not None:
        conf["ratchet_lease"] = lease.as_config()
    return {"configurable": conf}


def ids(saver: Any, thread_id: str) -> list[str]:
    """Checkpoint ids of a thread's root namespace, newest first."""
    return [t.checkpoint["id"] for t in saver.list(config(thread_id))]


def wait_store_ms(saver: Any, thread_id: str, until_ms: int, *, deadline_s: float = 30.0) -> int:
    """Poll the store's clock (``TIME`` inside lease_info) until it reads ``until_ms`` or
    later; return that reading, or fail after ``deadline_s`` of this process's time."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        now = int(saver.lease_info(thread_id).now_ms)
        if now >= until_ms:
            return now
        time.sleep(0.005)
    raise AssertionError(f"the store's clock did not reach {until_ms} within {deadline_s}s")
