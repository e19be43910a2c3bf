"""The workspace adapter when SQLite or the disk fails under it: a journal another
process keeps locked past the busy timeout, and a workspace whose disk is full (a tmpfs
of its own, root only). Each failure is a typed, retryable AdapterError; nothing is
recorded that did not happen, and once the cause is gone the same write lands once."""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from ratchet.adapters import WorkspaceAdapter
from ratchet.chaos.drill.storefaults import Tmpfs
from ratchet.errors import AdapterError
from ratchet.runtime import Action, Fence
from tests.adapters.harness import RIGHT_GREETING, WRONG_GREETING, make_workspace


def write(key: str, content: str, expected: int) -> Action:
    return Action.model_validate(
        {
            "action_id": f"a-{key}",
            "kind": "write_file",
            "risk": "reversible_write",
            "args": {"path": "app.py", "content": content},
            "idempotency_key": key,
            "expected_env_version": expected,
            "deadline_at": 2**40,
        }
    )


FENCE = Fence(run_id="r", lease_version=1, state_version=1)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return make_workspace(tmp_path / "ws")


def journal_of(root: Path) -> Path:
    return root / ".ratchet" / "journal.sqlite3"


def lock(root: Path) -> sqlite3.Connection:
    """Another process's view of the journal, holding its write lock."""
    other = sqlite3.connect(journal_of(root), timeout=5, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    return other


def rows(root: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(journal_of(root)) as db:
        return [
            (str(k), str(s))
            for k, s in db.execute("SELECT idempotency_key, status FROM writes ORDER BY 1")
        ]


def test_a_journal_locked_past_the_busy_timeout_refuses_retryable_and_records_nothing(
    root: Path,
) -> None:
    with WorkspaceAdapter(root, ["app.py"], busy_timeout_s=0.2) as ws:
        action = write("k-1", RIGHT_GREETING, ws.observe().version)
        other = lock(root)
        try:
            before = ws.observe()  # a state already recorded: read, no lock needed
            (root / "app.py").write_text("edited while the journal is locked\n")
            for call in (
                lambda: ws.execute(action, action.intent_digest, FENCE, None),
                lambda: ws.raise_fence(FENCE),
                ws.observe,  # a new state must be recorded: that needs the lock
            ):
                with pytest.raises(AdapterError) as refused:
                    call()
                assert refused.value.retryable is True
                assert refused.value.context["error"] == "SQLITE_BUSY"
                assert type(refused.value) is AdapterError
            (root / "app.py").write_text(WRONG_GREETING)
            assert ws.observe() == before
        finally:
            other.rollback()
            other.close()
        assert rows(root) == []
        assert (root / "app.py").read_text() == WRONG_GREETING
        # The lock is gone: the same write lands, once.
        first = ws.execute(action, action.intent_digest, FENCE, None)
        again = ws.execute(action, action.intent_digest, FENCE, None)
        assert again == first and ws.effects == 1
        assert (root / "app.py").read_text() == RIGHT_GREETING


def test_opening_a_locked_journal_is_a_retryable_adapter_error(root: Path) -> None:
    WorkspaceAdapter(root, ["app.py"]).close()  # the journal exists
    other = lock(root)
    try:
        with pytest.raises(AdapterError) as refused:
            WorkspaceAdapter(root, ["app.py"], busy_timeout_s=0.2)
        assert refused.value.context == {"retryable": True, "error": "SQLITE_BUSY"}
        assert "cannot be opened" in refused.value.message
    finally:
        other.rollback()
        other.close()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Tmpfs]:
    if os.geteuid() != 0:
        pytest.skip("a tmpfs of its own needs root")
    disk = Tmpfs(tmp_path / "disk", size_mb=8)
    why = disk.mount()
    if why is not None:
        pytest.skip(why)
    try:
        yield disk
    finally:
        disk.unmount()


def test_a_full_workspace_disk_refuses_retryable_and_the_write_lands_once_freed(
    small_disk: Tmpfs,
) -> None:
    root = make_workspace(small_disk.point / "ws")
    with WorkspaceAdapter(root, ["app.py"]) as ws:
        action = write("k-1", RIGHT_GREETING * 2000, ws.observe().version)
        small_disk.fill()
        try:
            with pytest.raises(AdapterError) as refused:
                ws.execute(action, action.intent_digest, FENCE, None)
            assert refused.value.retryable is True
            assert ws.lookup("k-1") is None
            assert (root / "app.py").read_text() == WRONG_GREETING
        finally:
            small_disk.free()
        receipt = ws.execute(action, action.intent_digest, FENCE, None)
        assert ws.lookup("k-1") == receipt and ws.effects == 1
        assert (root / "app.py").read_text() == RIGHT_GREETING * 2000
        assert list((root / ".ratchet" / "tmp").iterdir()) == []
    with sqlite3.connect(journal_of(root)) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)


def test_a_disk_that_fills_after_the_replace_leaves_an_intent_the_next_call_settles(
    small_disk: Tmpfs,
) -> None:
    root = make_workspace(small_disk.point / "ws")

    def fill_after_replace(stage: str) -> None:
        if stage == "after_replace":
            small_disk.fill()

    with WorkspaceAdapter(root, ["app.py"], hook=fill_after_replace) as ws:
        action = write("k-1", RIGHT_GREETING, ws.observe().version)
        try:
            with pytest.raises(AdapterError) as refused:
                ws.execute(action, action.intent_digest, FENCE, None)
            assert refused.value.context == {
                "retryable": True,
                "error": "SQLITE_FULL",
                "detail": "database or disk is full",
            }
            # The file was replaced; its receipt could not be written: still an intent.
            assert (root / "app.py").read_text() == RIGHT_GREETING
            assert rows(root) == [("k-1", "intent")]
        finally:
            small_disk.free()
        # Recovery finds the file replaced and writes the receipt: one effect, no second.
        receipt = ws.lookup("k-1")
        assert receipt is not None and receipt.intent_digest == action.intent_digest
        assert ws.execute(action, action.intent_digest, FENCE, None) == receipt
        assert ws.effects == 1 and rows(root) == [("k-1", "committed")]
