"""Stdio MCP servers kept for the worker's life (``shared_stdio``): one server process per
distinct server however many jobs use it, its tools listed once, a dead server replaced
before a job gets it, and nothing left when the process stops sharing."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ratchet.tools.mcp import close_shared, mcp_tools, shared_count, shared_stdio
from tests.tools.conftest import _poll
from tests.tools.procs import children, state_of


def server_argv(root: Path, pid_file: Path) -> list[str]:
    state = str(root / "state")
    return [
        sys.executable,
        "-m",
        "ratchet.testing.mcp_server",
        "--state",
        state,
        "--pid-file",
        str(pid_file),
    ]


@pytest.fixture
def shared() -> Iterator[None]:
    close_shared()
    try:
        yield
    finally:
        close_shared()


def test_one_server_for_every_use_and_its_tools_listed_once(tmp_path: Path, shared: None) -> None:
    before = children()
    argv = server_argv(tmp_path, tmp_path / "pid")
    first = shared_stdio(argv)
    tools = [t.spec.name for t in mcp_tools(first)]
    for _ in range(20):
        again = shared_stdio(argv)
        assert again is first
        assert [t.spec.name for t in mcp_tools(again)] == tools
    assert first._listed is not None  # asked once, kept with the connection
    assert shared_count() == 1 and len(children() - before) == 1
    other = shared_stdio(argv, env={"EXTRA": "1"})  # another environment: another server
    assert other is not first and shared_count() == 2
    close_shared()
    assert shared_count() == 0 and not first.alive and not other.alive
    _poll(lambda: not (children() - before), "servers still running after close_shared")


def test_a_server_that_died_is_replaced_before_the_next_use(tmp_path: Path, shared: None) -> None:
    pid_file = tmp_path / "pid"
    argv = server_argv(tmp_path, pid_file)
    first = shared_stdio(argv)
    pid = int(_poll(lambda: pid_file.exists() and pid_file.read_text(), "no pid file"))
    os.kill(pid, signal.SIGKILL)
    _poll(lambda: state_of(pid) == "Z" or not Path(f"/proc/{pid}").exists(), "server alive")
    replaced = shared_stdio(argv)
    assert replaced is not first and replaced.alive and not first.alive
    assert [t.spec.name for t in mcp_tools(replaced)]  # the new one answers
    assert shared_count() == 1
