"""One commit's path from the engine to the socket, measured and held against
``docs/architecture.md``.

The page lists, frame by frame, the code of ratchet's a worker's commit runs through from
the engine's operation to the write of the commit script on the socket, and states how
many frames and files that is on a marked line (``<!-- measured: frames=N files=M -->``).
This test runs a real commit (one job of a run, in this process, with no hooks, against a
real redis-server), reads the Python stack at the socket write of the commit script and
compares: a layer added, removed or renamed on the path fails here until the page says
so. Only ratchet's own frames are held to the page; redis-py's, between and below them,
change with redis-py's releases.
"""

from __future__ import annotations

import re
import secrets
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from pydantic import SecretStr

import ratchet
from ratchet.demo.examples import greeting_document, make_greeting_workspace
from ratchet.fleet.context import Fleet
from ratchet.fleet.settings import Settings
from ratchet.leasing import RedisStore
from ratchet.leasing.scripts import ScriptName, ScriptRunner
from ratchet.ops import submit
from ratchet.redis_server import RedisServer
from ratchet.worker.job import execute_run
from tests.conftest import test_sandbox_mode

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
SECTION = "## One commit's path, measured"
SRC = Path(ratchet.__file__).resolve().parent
ENGINE = SRC / "runtime" / "engine.py"
MARK = re.compile(r"<!-- measured: frames=(\d+) files=(\d+) -->")

Frame = tuple[Path, str]  # (file, qualified name of the function)


def _stack(frame: FrameType | None) -> list[Frame]:
    """``frame`` and its callers, outermost first."""
    frames: list[Frame] = []
    while frame is not None:
        frames.append((Path(frame.f_code.co_filename).resolve(), frame.f_code.co_qualname))
        frame = frame.f_back
    return frames[::-1]


def _own(path: Path) -> bool:
    return path.is_relative_to(SRC)


def _path(stack: list[Frame]) -> list[Frame]:
    """From the engine's outermost frame to ratchet's innermost one (the frame that hands
    the command to redis-py), redis-py's frames between them included."""
    start = next(i for i, (path, _) in enumerate(stack) if path == ENGINE)
    end = max(i for i, (path, _) in enumerate(stack) if _own(path))
    return stack[start : end + 1]


def _where(path: Path) -> str:
    """A file as the page names it: under ``src/ratchet``, or redis-py's ``redis/retry.py``."""
    return path.relative_to(SRC).as_posix() if _own(path) else f"{path.parent.name}/{path.name}"


def _listing(rows: list[tuple[str, str]]) -> str:
    return "\n".join(f"{where:<22}{name}" for where, name in rows)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    server = RedisServer(tmp_path / "redis").start()
    RedisStore(server.client()).identity.init_epoch()
    try:
        yield Fleet.connect(
            Settings(
                redis_url=SecretStr(server.url),
                state_dir=tmp_path / "state",
                queue=f"q-{secrets.token_hex(4)}",
                lease_ttl_ms=1500,
                renew_interval_ms=300,
                stall_timeout_ms=20_000,
                reaper_interval_ms=200,
                job_timeout_s=600,
                checkpoint_key=SecretStr(secrets.token_hex(32)),
                verifier_sandbox=test_sandbox_mode(),
            )
        )
    finally:
        server.kill()


def _measured(fleet: Fleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Frame]:
    """The path of the first commit a job makes from ``RunEngine.propose``, at the socket
    write of its commit script."""
    run_id = submit(fleet, greeting_document(make_greeting_workspace(tmp_path / "ws")))
    commit = ScriptRunner(fleet.store.client).sha_of(ScriptName.COMMIT).encode()
    writes: list[list[Frame]] = []
    sendall = socket.socket.sendall

    def recording(self: socket.socket, data: Any, *args: Any) -> None:
        if b"EVALSHA" in bytes(data[:64]) and commit in bytes(data[:128]):
            writes.append(_stack(sys._getframe(1)))
        sendall(self, data, *args)

    with monkeypatch.context() as patch:
        patch.setattr(socket.socket, "sendall", recording)
        report = execute_run(fleet, run_id, owner="w-1")
    assert (report.outcome, report.phase) == ("finished", "completed")
    paths = [_path(stack) for stack in writes if any(path == ENGINE for path, _ in stack)]
    proposed = [path for path in paths if path[0][1] == "RunEngine.propose"]
    assert proposed, "no commit from RunEngine.propose reached the socket"
    return proposed[0]


def _documented() -> tuple[int, int, str, str]:
    """The section's marked numbers, the line that carries them, and its listing (ratchet's
    own frames only: the lines that name a file under ``src/ratchet``)."""
    text = DOC.read_text(encoding="utf-8")
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    marked = [line for line in section.splitlines() if MARK.search(line)]
    assert len(marked) == 1, f"{SECTION!r} needs exactly one {MARK.pattern!r} line"
    frames, files = (int(n) for n in MARK.findall(marked[0])[0])
    block = section.split("```", 2)[1]
    rows = [row.split()[:2] for row in block.splitlines() if row.strip()]
    own = [(where, name) for where, name in rows if (SRC / where).is_file()]
    return frames, files, marked[0], _listing(own)


def test_the_documented_commit_path_is_the_measured_one(
    fleet: Fleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _measured(fleet, tmp_path, monkeypatch)
    own = [(file, name) for file, name in path if _own(file)]
    frames, files, line, listed = _documented()
    everything = _listing([(_where(file), name) for file, name in path])
    assert listed == _listing([(_where(file), name) for file, name in own]), (
        f"docs/architecture.md should list, as measured:\n{everything}"
    )
    measured = f"frames={len(own)} files={len({file for file, _ in own})}"
    assert f"frames={frames} files={files}" == measured, line
    assert f"{frames} frames" in line and f"{files} files" in line, line
