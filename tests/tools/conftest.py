"""Fixtures for the tools tests.

``tickets``: the tickets MCP server (``ratchet.testing.mcp_server``) for real, on one state
folder: servers started over stdio (one per connection) or streamable HTTP, each writing
its process id to a file of its own so a test can kill or pause exactly that server.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from ratchet.testing.mcp_server import TicketStats, stats
from ratchet.tools.mcp import MCPConnection
from tests.tools.plugins import installed  # noqa: F401 - a fixture of these tests

DEADLINE_S = 15.0


def _gone(pid: int) -> bool:
    """The process has exited (a zombie waiting to be reaped counts)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True
    return state in ("Z", "X")


def _poll(check: Any, what: str) -> Any:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {DEADLINE_S}s")
        time.sleep(0.02)


class Tickets:
    """Tickets servers on one state folder, and the connections to them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.state = root / "state"
        self.root.mkdir(parents=True, exist_ok=True)
        self._pid_files: dict[int, Path] = {}
        self._connections: list[MCPConnection] = []
        self._processes: list[subprocess.Popen[bytes]] = []
        self._count = 0

    def argv(self, *flags: str, pid_file: Path | None = None) -> list[str]:
        argv = [sys.executable, "-m", "ratchet.testing.mcp_server", "--state", str(self.state)]
        if pid_file is not None:
            argv += ["--pid-file", str(pid_file)]
        return [*argv, *flags]

    def _pid_file(self) -> Path:
        self._count += 1
        return self.root / f"server-{self._count}.pid"

    def connect(
        self, *flags: str, env: Mapping[str, str] | None = None, **options: Any
    ) -> MCPConnection:
        """A started stdio connection to a new server with ``flags``."""
        pid_file = self._pid_file()
        conn = MCPConnection.stdio(self.argv(*flags, pid_file=pid_file), env=env, **options)
        self.adopt(conn)
        self._pid_files[id(conn)] = pid_file
        return conn.start()

    def adopt(self, conn: MCPConnection) -> MCPConnection:
        """Close ``conn`` when the test ends."""
        self._connections.append(conn)
        return conn

    def pid(self, conn: MCPConnection) -> int:
        pid_file = self._pid_files[id(conn)]
        return int(_poll(lambda: pid_file.exists() and pid_file.read_text(), "no pid file"))

    def kill(self, conn: MCPConnection, *, close: bool = True) -> None:
        """SIGKILL the server behind ``conn`` and wait until it is gone."""
        pid = self.pid(conn)
        os.kill(pid, signal.SIGKILL)
        _poll(lambda: _gone(pid), f"server {pid} still alive")
        if close:
            conn.close()

    def pause(self, conn: MCPConnection) -> int:
        pid = self.pid(conn)
        os.kill(pid, signal.SIGSTOP)
        return pid

    def stats(self) -> TicketStats:
        return stats(self.state)

    def serve_http(self, *flags: str, env: Mapping[str, str] | None = None) -> str:
        """Start a server over streamable HTTP on a free loopback port; its URL."""
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        log = (self.root / f"http-{port}.log").open("wb")
        process = subprocess.Popen(
            [*self.argv(*flags), "--transport", "http", "--port", str(port)],
            env={**os.environ, **(env or {})},
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        log.close()
        self._processes.append(process)

        def listening() -> bool:
            if process.poll() is not None:
                raise AssertionError(f"the HTTP server exited ({process.returncode})")
            with socket.socket() as client:
                return client.connect_ex(("127.0.0.1", port)) == 0

        _poll(listening, "the HTTP server is not listening")
        return f"http://127.0.0.1:{port}/mcp"

    def close(self) -> None:
        for conn in self._connections:
            conn.close()
        for process in self._processes:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(DEADLINE_S)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(DEADLINE_S)


@pytest.fixture
def tickets(tmp_path: Path) -> Iterator[Tickets]:
    box = Tickets(tmp_path / "tickets")
    yield box
    box.close()
