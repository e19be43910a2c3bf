"""Junk never takes a view down: parsers have a depth limit, stored records are read by
shape, a bad row renders as unreadable, and the console answers every request."""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ratchet.console import ConsoleData, serve_console
from ratchet.errors import ContractError
from ratchet.fleet.context import Fleet
from ratchet.fleet.runs import RunDocument
from ratchet.leasing import run_keys
from ratchet.ops import inspect_run, submit
from ratchet.redis_server import RedisServer
from ratchet.runtime.canonical import strict_json_loads
from tests.worker.conftest import CHECKPOINT_KEY_HEX

MakeWorkspace = Callable[..., tuple[Path, RunDocument]]


@pytest.mark.parametrize("depth", [65, 10_000, 200_000])
def test_deep_json_is_a_contract_error_not_a_recursion_error(depth: int) -> None:
    with pytest.raises(ContractError, match="nests deeper"):
        strict_json_loads("[" * depth + "]" * depth)
    assert strict_json_loads("[" * 64 + "]" * 64) is not None


@pytest.mark.parametrize(
    "junk",
    [b"[1, 2]", b'"text"', b"not json", b'{"a": ' * 50 + b"1" + b"}" * 50, b'{"a": 1, "a": 2}'],
)
def test_a_junk_incident_is_shown_as_unreadable_and_show_still_works(
    fleet: Fleet, workspace: MakeWorkspace, redis_server: RedisServer, tmp_path: Path, junk: bytes
) -> None:
    _root, document = workspace()
    run_id = submit(fleet, document)
    fleet.store.client.lpush(run_keys(run_id).incidents, b"123|" + junk)
    incidents = inspect_run(fleet, run_id).incidents
    assert incidents[0]["kind"] == "unreadable" and incidents[0]["at_ms"] == 123
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env.update(RATCHET_REDIS_URL=redis_server.url, RATCHET_CHECKPOINT_KEY=CHECKPOINT_KEY_HEX)
    for args in (["show", run_id], ["show", run_id, "--json"], ["runs"]):
        done = subprocess.run(
            [sys.executable, "-m", "ratchet.cli.entry", *args],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr


def test_one_broken_row_and_one_broken_page_never_take_the_console_down() -> None:
    def list_runs(_limit: int) -> list[dict[str, Any]]:
        return [
            {
                "run_id": "r-good",
                "phase": "running",
                "owner": None,
                "lease": "free",
                "generation": 2,
                "note": "",
            },
            {
                "run_id": "r-bad",
                "phase": None,
                "owner": None,
                "lease": "-",
                "generation": None,
                "note": "unreadable: RecursionError",
            },
        ]

    def run_detail(run_id: str, _now: int) -> dict[str, Any]:
        raise RecursionError("a document nested too deeply")

    server = serve_console(
        ConsoleData(list_runs=list_runs, run_detail=run_detail), port=0, background=True
    )
    try:
        host, port = str(server.server_address[0]), int(server.server_address[1])
        for path, status, text in (("/runs", 200, "r-good"), ("/runs/r-bad", 500, "unreadable")):
            conn = http.client.HTTPConnection(host, port, timeout=30)
            conn.request("GET", path)
            response = conn.getresponse()
            body = response.read().decode()
            conn.close()
            assert response.status == status and text in body
    finally:
        server.shutdown()
        server.server_close()
