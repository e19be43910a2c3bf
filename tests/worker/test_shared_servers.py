"""A tool package on a shared stdio MCP server (``shared_stdio``): fifty jobs on one
worker start its server once, leak no process, connection or thread, and the worker's
stop takes the server with it."""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ratchet.fleet.context import Fleet
from ratchet.ops import submit
from ratchet.runtime import Scenario
from ratchet.tools.mcp import close_shared, shared_count
from ratchet.worker.job import execute_run
from tests.tools.conftest import _poll
from tests.tools.procs import children

pytestmark = pytest.mark.slow

PLUGIN = """
from ratchet.tools.mcp import mcp_tools, shared_stdio

ARGV = []
MADE = []

def tickets_list():
    MADE.append(1)
    tools = mcp_tools(shared_stdio(ARGV), prefix="tk_", include=["list_tickets"])
    return tools[0]
"""


@pytest.fixture
def plugin(tmp_path: Path) -> Iterator[Any]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "shared_plugin.py").write_text(PLUGIN)
    info = site / "shared_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: shared-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[ratchet.tools]\ntk_list_tickets = shared_plugin:tickets_list\n"
    )
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    module = importlib.import_module("shared_plugin")
    server = [sys.executable, "-m", "ratchet.testing.mcp_server"]
    module.ARGV[:] = [*server, "--state", str(tmp_path / "tickets")]
    close_shared()
    try:
        yield module
    finally:
        close_shared()
        sys.path.remove(str(site))
        sys.modules.pop("shared_plugin", None)
        importlib.invalidate_caches()


def test_fifty_jobs_start_the_server_once_and_leak_nothing(
    fleet: Fleet, workspace: Callable[..., Any], plugin: Any
) -> None:
    before = children()
    threads_before = threading.active_count()
    _, plain = workspace(runner="python")
    data = plain.scenario.model_dump(mode="json")
    scenario = Scenario.model_validate(
        {**data, "permissions": [*data["permissions"], "tk_list_tickets"]}
    )
    document = plain.model_copy(update={"scenario": scenario})
    threads_after_first: int | None = None
    for index in range(50):
        run_id = submit(fleet, document, run_id=f"r-shared-{index}")
        report = execute_run(fleet, run_id, owner="w-1")
        assert report.phase == "completed", report
        if threads_after_first is None:
            threads_after_first = threading.active_count()
    # Every submit and every job made the tool (100 times): one server process served all.
    assert len(plugin.MADE) == 100
    assert shared_count() == 1 and len(children() - before) == 1
    assert threading.active_count() <= (threads_after_first or 0) + 1  # no thread per job
    close_shared()
    _poll(lambda: not (children() - before), "the shared server outlived close_shared")
    _poll(lambda: threading.active_count() <= threads_before + 1, "threads left behind")
