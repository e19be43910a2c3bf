"""ratchet against unmodified MCP reference servers from PyPI: ``mcp-server-git`` (a write
that knows no idempotency keys: a commit) and ``mcp-server-sqlite`` (a server whose tools
carry no annotations and which needs ``mcp`` 1.x). Effects are counted outside ratchet:
commits in the repository read with dulwich, rows in the SQLite file read with
``sqlite3``. A crash after the write, with the server killed: without a declaration the
run waits for a review and the write is never made twice; with a lookup recipe (the key
as a commit trailer found by ``git_log``, the key in a row's column found by
``read_query``) the run recovers by itself, the write made once. The same crashes with
real worker processes SIGKILLed: tests/worker/test_mcp_recipe_fleet.py."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from mcp import MCPError
from mcp_types.version import LATEST_MODERN_VERSION

from ratchet.errors import ConfigurationError
from ratchet.runtime import Phase, RunEngine, TraceOutcome
from ratchet.runtime.actions import Action, Risk, derive_idempotency_key
from ratchet.runtime.state import ReviewReason
from ratchet.tools import Toolbox, ToolsAdapter
from ratchet.tools.mcp import MCPConnection, McpDeclaration, mcp_tools
from ratchet.tools.mcp.recipes import git_trailer, sql_key_column
from tests.adapters.harness import Harness, SimulatedCrash, scenario
from tests.tools.reference_servers import (
    GIT_SERVER,
    SQLITE_SERVER,
    commit_messages,
    notes_db,
    reference_server,
    rows,
    staged_repo,
)

pytestmark = pytest.mark.slow

GIT_PROGRAM = reference_server(GIT_SERVER)
SQLITE_PROGRAM = reference_server(SQLITE_SERVER)
needs_git_server = pytest.mark.skipif(not isinstance(GIT_PROGRAM, Path), reason=str(GIT_PROGRAM))
needs_sqlite_server = pytest.mark.skipif(
    not isinstance(SQLITE_PROGRAM, Path), reason=str(SQLITE_PROGRAM)
)
SCENARIO = scenario(permissions=["git_commit", "git_log", "finish"])
SQL_SCENARIO = scenario(permissions=["write_query", "finish"])


class Run(Harness):
    """The adapter harness with the declared tools' contracts handed to the engine."""

    def ports(self, adapter: Any, store: Any, probe: Any = None) -> dict[str, Any]:
        ports = super().ports(adapter, store, probe)
        if isinstance(adapter, ToolsAdapter):
            ports["tools"] = adapter.catalog
        return ports


class ServerEnvironment:
    """Opens the run's environment as a new worker would: a new server process (``argv``)
    on the same repository or database, its tools ``include`` (with ``declare``), one
    ledger file."""

    def __init__(
        self,
        argv: list[str],
        include: list[str],
        permitted: Any,
        ledger: Path,
        declare: dict[str, McpDeclaration] | None,
    ) -> None:
        self.argv = argv
        self.include = include
        self.permitted = permitted
        self.ledger = ledger
        self.declare = declare
        self.current: MCPConnection | None = None
        self.next_hook: Any = None

    def open(self) -> Any:
        self.current = MCPConnection.stdio(self.argv, connect_timeout_s=60).start()
        tools = mcp_tools(self.current, include=self.include, declare=self.declare)
        hook, self.next_hook = self.next_hook, None
        options: dict[str, Any] = {"hook": hook} if hook is not None else {}
        return Toolbox(tools).environment(self.permitted, ledger=self.ledger, **options)

    def kill_server(self) -> None:
        """The worker and its server die together: every process running the server."""
        found = subprocess.run(
            ["pgrep", "-f", " ".join(self.argv)], capture_output=True, text=True, check=False
        )
        for pid in (int(p) for p in found.stdout.split()):
            os.kill(pid, signal.SIGKILL)
        if self.current is not None:
            self.current.close()


def commit_action(run: Harness, engine: RunEngine) -> Action:
    return Action.model_validate(
        {
            "action_id": f"a-{engine.state.next_seq}",
            "kind": "git_commit",
            "risk": "reversible_write",
            "args": {"repo_path": "", "message": "Fix the greeting"},
            "idempotency_key": derive_idempotency_key(engine.state.run_id, 1),
            "expected_env_version": engine.state.environment.version,
            "deadline_at": run.clock.now() + 600,
        }
    )


def crash_after_the_commit(
    tmp_path: Path, declare: dict[str, McpDeclaration] | None
) -> tuple[Path, RunEngine, str]:
    repo = staged_repo(tmp_path)
    argv = [str(GIT_PROGRAM), "--repository", str(repo)]
    env = ServerEnvironment(
        argv, ["git_commit", "git_log"], SCENARIO, tmp_path / "ledger.sqlite3", declare
    )
    run = Run(open_adapter=env.open, effects=lambda: 0, scenario=SCENARIO)

    def crash(stage: str) -> None:
        if stage == "after_call":  # the commit is made; nothing recorded it
            env.kill_server()
            raise SimulatedCrash(stage)

    env.next_hook = crash
    engine = run.start()
    action = commit_action(run, engine)
    action = action.model_copy(update={"args": {**action.args, "repo_path": str(repo)}})
    with pytest.raises(SimulatedCrash):
        engine.propose(action)
    resumed = run.resume(lease_version=2)
    resumed.reconcile()
    env.kill_server()
    return repo, resumed, action.idempotency_key or ""


@needs_git_server
def test_without_a_declaration_a_cut_off_commit_waits_for_a_review_and_is_never_made_twice(
    tmp_path: Path,
) -> None:
    repo, resumed, _ = crash_after_the_commit(tmp_path, None)
    assert resumed.state.phase is Phase.NEEDS_REVIEW
    assert resumed.state.review is not None
    assert resumed.state.review.reason is ReviewReason.OUTCOME_UNKNOWN
    assert [m.splitlines()[0] for m in commit_messages(repo)] == ["Fix the greeting", "initial"]


@needs_git_server
def test_with_the_key_recipe_a_cut_off_commit_is_found_by_git_log_and_made_once(
    tmp_path: Path,
) -> None:
    repo = tmp_path / "repo"
    declare = {"git_commit": McpDeclaration(keys=git_trailer(str(repo)))}
    repo_seen, resumed, key = crash_after_the_commit(tmp_path, declare)
    assert repo_seen == repo
    assert resumed.state.phase is Phase.RUNNING and resumed.state.pending is None
    assert resumed.state.executed[-1].idempotency_key == key
    messages = commit_messages(repo)
    assert len(messages) == 2
    assert messages[0] == f"Fix the greeting\n\nRatchet-Key: {key}"


def sql_action(run: Harness, engine: RunEngine, query: str) -> Action:
    return Action.model_validate(
        {
            "action_id": f"a-{engine.state.next_seq}",
            "kind": "write_query",
            "risk": "irreversible_external_write",
            "args": {"query": query},
            "idempotency_key": derive_idempotency_key(engine.state.run_id, 1),
            "expected_env_version": engine.state.environment.version,
            "deadline_at": run.clock.now() + 600,
        }
    )


def sql_run(tmp_path: Path, declare: dict[str, McpDeclaration] | None) -> tuple[Path, Any, Run]:
    db = notes_db(tmp_path)
    argv = [str(SQLITE_PROGRAM), "--db-path", str(db)]
    env = ServerEnvironment(
        argv, ["write_query"], SQL_SCENARIO, tmp_path / "ledger.sqlite3", declare
    )
    return db, env, Run(open_adapter=env.open, effects=lambda: 0, scenario=SQL_SCENARIO)


INSERT = "INSERT INTO notes (body, ratchet_key) VALUES ('printer on fire', :ratchet_key)"


@needs_sqlite_server
def test_a_sql_write_without_the_key_placeholder_is_refused_at_the_gate_and_never_sent(
    tmp_path: Path,
) -> None:
    """Without the key in the row no read could find the call: the proposal is refused
    before the intent is committed (no ledger row, no call), in one line."""
    declare = {"write_query": McpDeclaration(keys=sql_key_column("notes"))}
    db, env, run = sql_run(tmp_path, declare)
    engine = run.start()
    action = sql_action(run, engine, "INSERT INTO notes (body) VALUES ('printer on fire')")
    assert engine.propose(action).outcome is TraceOutcome.REJECTED_SCHEMA
    said = str(engine.state.trace[-1].detail)  # a repr: a line break shows as a backslash-n
    assert "'query' must hold :ratchet_key where ratchet writes the call's key" in said
    assert "\\n" not in said
    assert engine.state.pending is None and engine.state.executed == ()
    assert rows(db) == []
    assert env.current is not None
    described = {t.spec.name: t.spec.description for t in mcp_tools(env.current, declare=declare)}
    assert ":ratchet_key" in described["write_query"]  # the model is told where it goes
    env.kill_server()


@needs_sqlite_server
def test_with_the_sql_key_column_recipe_a_cut_off_insert_is_found_with_its_intent_and_made_once(
    tmp_path: Path,
) -> None:
    """The row carries the key and the intent digest: the lookup finds the row, names
    its intent (the run's own), and the run goes on with one row and no review."""
    recipe = sql_key_column("notes", intent_column="intent")
    db, env, run = sql_run(tmp_path, {"write_query": McpDeclaration(keys=recipe)})
    with sqlite3.connect(db) as alter:
        alter.execute("ALTER TABLE notes ADD COLUMN intent TEXT")
    alter.close()

    def crash(stage: str) -> None:
        if stage == "after_call":  # the row is in; nothing recorded it
            env.kill_server()
            raise SimulatedCrash(stage)

    env.next_hook = crash
    engine = run.start()
    query = (
        "INSERT INTO notes (body, ratchet_key, intent) "
        "VALUES ('printer on fire', :ratchet_key, :ratchet_intent)"
    )
    action = sql_action(run, engine, query)
    with pytest.raises(SimulatedCrash):
        engine.propose(action)
    resumed = run.resume(lease_version=2)
    resumed.reconcile()
    env.kill_server()
    assert resumed.state.phase is Phase.RUNNING and resumed.state.pending is None
    receipt = resumed.state.executed[-1]
    assert receipt.idempotency_key == action.idempotency_key
    assert receipt.intent_digest == action.intent_digest
    assert rows(db, "SELECT body, ratchet_key, intent FROM notes") == [
        ("printer on fire", action.idempotency_key, action.intent_digest)
    ]


#: What a server's stderr must not say after ratchet's handshake.
NOISE = re.compile(r"traceback|validat|error|warning|exception", re.IGNORECASE)


def server_said(
    argv: list[str], caplog: pytest.LogCaptureFixture, **options: Any
) -> tuple[str, list[str]]:
    """Connect to the stdio server ``argv``, list its tools, close: the protocol version
    negotiated, and every line the server wrote on its stderr meanwhile."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ratchet.tools.mcp.stderr"):
        conn = MCPConnection.stdio(argv, connect_timeout_s=60, **options).start()
        version = conn.client.protocol_version
        assert [t.spec.name for t in mcp_tools(conn)]
        conn.close()
        tail = conn._errtail
        assert tail is not None
        tail.tail(wait_s=10)  # the server exited: every line it wrote is logged
    return version, [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("server", ["mcp-server-sqlite (mcp 1.x)", "mcp-server-git (mcp 2.x)"])
@pytest.mark.parametrize("protocol", ["auto", "legacy"])
def test_the_default_handshake_leaves_mcp_1_and_mcp_2_servers_stderr_clean(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, server: str, protocol: str
) -> None:
    """Not a line on either server's stderr, with the default handshake as with
    "legacy": both start with initialize, which a 1.x and a 2.x server both take."""
    if server.startswith("mcp-server-sqlite"):
        if not isinstance(SQLITE_PROGRAM, Path):
            pytest.skip(SQLITE_PROGRAM)
        argv = [str(SQLITE_PROGRAM), "--db-path", str(tmp_path / "db.sqlite3")]
    else:
        if not isinstance(GIT_PROGRAM, Path):
            pytest.skip(GIT_PROGRAM)
        argv = [str(GIT_PROGRAM), "--repository", str(staged_repo(tmp_path))]
    version, said = server_said(argv, caplog, protocol=protocol)
    assert version == "2025-11-25"
    assert said == []


@needs_sqlite_server
def test_the_noise_check_sees_an_mcp_1_server_answer_a_discovery(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """What the SDK's own default sends first (``server/discover``), an mcp 1.x server
    answers with a page of validation errors on its stderr: the check above would see it."""
    argv = [str(SQLITE_PROGRAM), "--db-path", str(tmp_path / "db.sqlite3")]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ratchet.tools.mcp.stderr"):
        conn = MCPConnection.stdio(argv, connect_timeout_s=60).start()
        with pytest.raises(MCPError):
            conn._run(
                lambda client: client.session.send_discover(LATEST_MODERN_VERSION), 10, "probe"
            )
        conn.close()
        tail = conn._errtail
        assert tail is not None
        tail.tail(wait_s=10)
    said = [r.getMessage() for r in caplog.records]
    assert any(NOISE.search(line) for line in said) and len(said) > 20


@needs_sqlite_server
def test_over_http_an_mcp_1_server_answers_the_discovery_with_a_400_and_no_error(
    tmp_path: Path,
) -> None:
    """Over streamable HTTP the default asks ``server/discover`` first (the
    specification's way there): a server on mcp 1.x (FastMCP from the sqlite server's
    environment) refuses it with HTTP 400, logs no validation error, and is then served
    with initialize."""
    script = tmp_path / "one_x.py"
    script.write_text(ONE_X_HTTP_SERVER)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = tmp_path / "server.log"
    python = Path(str(SQLITE_PROGRAM)).with_name("python")
    with log.open("wb") as err:
        server = subprocess.Popen(
            [str(python), str(script), str(port)], stdout=err, stderr=subprocess.STDOUT
        )
    try:
        wait_listening(server, port)
        with MCPConnection.http(f"http://127.0.0.1:{port}/mcp", connect_timeout_s=60) as conn:
            assert conn.client.protocol_version == "2025-11-25"
            result = conn.call_tool("add", {"a": 2, "b": 3})
            assert not result.is_error
            # Read before the session ends: mcp 1.x logs an error of its own when a client
            # closes its event stream (with either handshake), which is not the handshake's.
            handshake = log.read_text()
    finally:
        server.terminate()
        server.wait(30)
    assert '"POST /mcp HTTP/1.1" 400' in handshake  # the discovery, refused
    assert not re.search(r"validat|traceback|error", handshake, re.IGNORECASE)


ONE_X_HTTP_SERVER = """
import sys
from mcp.server.fastmcp import FastMCP

app = FastMCP("one-x", port=int(sys.argv[1]))


@app.tool()
def add(a: int, b: int) -> int:
    return a + b


app.run(transport="streamable-http")
"""


def wait_listening(server: subprocess.Popen[bytes], port: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"the server exited ({server.returncode})")
        with socket.socket() as client:
            if client.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError("the server is not listening")


@needs_sqlite_server
def test_the_sqlite_server_s_unannotated_read_is_a_write_until_the_operator_loosens_it(
    tmp_path: Path,
) -> None:
    conn = MCPConnection.stdio(
        [str(SQLITE_PROGRAM), "--db-path", str(tmp_path / "db.sqlite3")], connect_timeout_s=60
    ).start()
    try:
        plain = {t.spec.name: t.spec for t in mcp_tools(conn)}
        assert plain["read_query"].risk is Risk.IRREVERSIBLE_EXTERNAL_WRITE  # no annotations
        read_only = {"read_query": McpDeclaration(risk=Risk.READ_ONLY)}
        with pytest.raises(ConfigurationError, match="loosens"):
            mcp_tools(conn, declare=read_only)
        loosened = {t.spec.name: t.spec for t in mcp_tools(conn, declare=read_only, loosen=True)}
        assert loosened["read_query"].risk is Risk.READ_ONLY
        assert loosened["write_query"].risk is Risk.IRREVERSIBLE_EXTERNAL_WRITE
    finally:
        conn.close()
