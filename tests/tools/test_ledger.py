"""The tool ledger's file: a log every process that opens it reads; a line torn by a crash
is cut off, a long line is read whole, and a write that fails is a typed, retryable error
that records nothing."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from ratchet.errors import AdapterError, FenceRejectedError
from ratchet.runtime.ports import Fence
from ratchet.tools import ledger as ledger_module
from ratchet.tools.ledger import CallIntent, ToolLedger


def _fence(lease: int = 1, state: int = 1) -> Fence:
    return Fence(run_id="r1", lease_version=lease, state_version=state)


def _intent(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _commit(led: ToolLedger, key: str, output: str = "ok") -> None:
    fence = _fence()
    led.begin_call(
        key=key,
        tool="refund",
        intent_digest=_intent(key),
        approval_digest=None,
        fence=fence,
        expected_version=led.version,
        again=False,
        durable=False,
    )
    led.commit_call(
        key,
        namespace="tools",
        result={"tool": "refund", "output": output},
        committed_at=1,
        call=CallIntent("refund", _intent(key), None, fence),
    )


def test_two_handles_see_each_others_lines(tmp_path: Path) -> None:
    path = tmp_path / "tools.ledger"
    a, b = ToolLedger(path), ToolLedger(path)
    _commit(a, "from-a")
    assert b.status("from-a") == "committed"
    _commit(b, "from-b")
    assert a.status("from-b") == "committed"
    assert a.version == b.version == 3
    a.close()
    b.close()


def test_a_torn_line_is_cut_off_and_the_next_line_starts_where_it_did(tmp_path: Path) -> None:
    path = tmp_path / "tools.ledger"
    led = ToolLedger(path)
    _commit(led, "kept")
    end = os.path.getsize(path)
    led.close()
    # A crash mid-line: bytes with no newline.
    torn = b'{"t":"commit","k":"lost","receipt":"' + b"x" * 100_000
    with open(path, "ab") as f:
        f.write(torn)
    reopened = ToolLedger(path)
    assert reopened.status("lost") is None  # it never counted
    assert os.path.getsize(path) == end
    _commit(reopened, "after")
    third = ToolLedger(path)
    assert third.status("after") == "committed" and third.status("kept") == "committed"
    assert third.version == 3
    reopened.close()
    third.close()


def test_a_line_longer_than_the_read_window_is_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "tools.ledger"
    led = ToolLedger(path)
    big = "y" * 60_000
    _commit(led, "big", output=big)
    other = ToolLedger(path)
    row = other.row("big")
    assert row is not None and row.receipt is not None
    assert row.receipt.result["output"] == big
    led.close()
    other.close()


def test_a_log_from_another_writer_reads_and_its_torn_tail_is_cut(tmp_path: Path) -> None:
    path = tmp_path / "tools.ledger"
    lines = [
        b'{"instance":"tools-old","t":"meta"}\n',
        b'{"epoch":null,"lv":1,"run":"r1","sv":1,"t":"fence"}\n',
    ]
    path.write_bytes(b"".join(lines) + b'{"t":"fen')  # and a torn tail at the file's end
    led = ToolLedger(path)
    assert led.instance_id == "tools-old"
    with pytest.raises(FenceRejectedError):
        led.raise_fence(_fence(lease=0))
    _commit(led, "new")
    assert ToolLedger(path).status("new") == "committed"
    led.close()


def test_a_write_that_fails_is_a_typed_retryable_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    led = ToolLedger(tmp_path / "tools.ledger")

    def disk_full(*_args: object) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ledger_module.os, "write", disk_full)
    with pytest.raises(AdapterError) as caught:
        led.raise_fence(_fence(lease=2))
    assert caught.value.retryable is True
    assert "cannot be written" in str(caught.value)
    monkeypatch.undo()
    led.raise_fence(_fence(lease=2))  # nothing was recorded: the same fence goes now
    led.close()
