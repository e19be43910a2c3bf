"""ratchet against unmodified MCP reference servers from PyPI: ``mcp-server-git`` (a write
that knows no idempotency keys: a commit) and ``mcp-server-sqlite`` (a server whose tools
carry no annotations and which needs ``mcp`` 1.x). Effects are counted outside ratchet:
commits in the repository's own log (read with the ``git`` program, never through
ratchet). A crash after the commit, with the server killed: without a declaration the run
waits for a review and the commit is never made twice; with the key recipe (the key as a
commit trailer, found by ``git_log``) the run recovers by itself, the commit once."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ratchet.errors import ConfigurationError
from ratchet.runtime import Phase, RunEngine
from ratchet.runtime.actions import Action, Risk, derive_idempotency_key
from ratchet.runtime.state import ReviewReason
from ratchet.tools import Toolbox, ToolsAdapter
from ratchet.tools.mcp import KeyRecipe, MCPConnection, McpDeclaration, mcp_tools
from tests.adapters.harness import Harness, SimulatedCrash, scenario
from tests.tools.reference_servers import GIT_SERVER, SQLITE_SERVER, reference_server

pytestmark = pytest.mark.slow

GIT_PROGRAM = reference_server(GIT_SERVER) if shutil.which("git") else "no git program"
SQLITE_PROGRAM = reference_server(SQLITE_SERVER)
needs_git_server = pytest.mark.skipif(not isinstance(GIT_PROGRAM, Path), reason=str(GIT_PROGRAM))
needs_sqlite_server = pytest.mark.skipif(
    not isinstance(SQLITE_PROGRAM, Path), reason=str(SQLITE_PROGRAM)
)
SCENARIO = scenario(permissions=["git_commit", "git_log", "finish"])


def git(repo: Path, *args: str) -> str:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "HOME": str(repo),
    }
    done = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return done.stdout


def staged_repo(root: Path) -> Path:
    """A repository with one commit and a change staged for the run to commit."""
    repo = root / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "app.py").write_text('print("Hello, wrold")\n')
    git(repo, "add", "app.py")
    git(repo, "commit", "-qm", "initial")
    (repo / "app.py").write_text('print("Hello, world")\n')
    git(repo, "add", "app.py")
    return repo


class Run(Harness):
    """The adapter harness with the declared tools' contracts handed to the engine."""

    def ports(self, adapter: Any, store: Any, probe: Any = None) -> dict[str, Any]:
        ports = super().ports(adapter, store, probe)
        if isinstance(adapter, ToolsAdapter):
            ports["tools"] = adapter.catalog
        return ports


class GitEnvironment:
    """Opens the run's environment as a new worker would: a new server process on the
    same repository, its tools (with ``declare``), one ledger file."""

    def __init__(self, repo: Path, ledger: Path, declare: dict[str, McpDeclaration] | None):
        self.repo = repo
        self.ledger = ledger
        self.declare = declare
        self.current: MCPConnection | None = None
        self.next_hook: Any = None
        self.pid_of: list[int] = []

    def open(self) -> Any:
        self.current = MCPConnection.stdio(
            [str(GIT_PROGRAM), "--repository", str(self.repo)], connect_timeout_s=60
        ).start()
        tools = mcp_tools(self.current, include=["git_commit", "git_log"], declare=self.declare)
        hook, self.next_hook = self.next_hook, None
        options: dict[str, Any] = {"hook": hook} if hook is not None else {}
        return Toolbox(tools).environment(SCENARIO, ledger=self.ledger, **options)

    def kill_server(self) -> None:
        """The worker and its server die together: every process running the server."""
        found = subprocess.run(
            ["pgrep", "-f", f"{GIT_PROGRAM} --repository {self.repo}"],
            capture_output=True,
            text=True,
            check=False,
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
    env = GitEnvironment(repo, tmp_path / "ledger.sqlite3", declare)
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
    log = git(repo, "log", "--format=%s").splitlines()
    assert log == ["Fix the greeting", "initial"]  # made once, not again


@needs_git_server
def test_with_the_key_recipe_a_cut_off_commit_is_found_by_git_log_and_made_once(
    tmp_path: Path,
) -> None:
    recipe = KeyRecipe(carry="message", tool="git_log", arguments={"repo_path": "REPO"})
    repo = tmp_path / "repo"
    declare = {
        "git_commit": McpDeclaration(
            keys=KeyRecipe(carry=recipe.carry, tool=recipe.tool, arguments={"repo_path": str(repo)})
        )
    }
    repo_seen, resumed, key = crash_after_the_commit(tmp_path, declare)
    assert repo_seen == repo
    assert resumed.state.phase is Phase.RUNNING and resumed.state.pending is None
    assert resumed.state.executed[-1].idempotency_key == key
    bodies = git(repo, "log", "--format=%B%x00").split("\x00")
    made = [b for b in bodies if f"Ratchet-Key: {key}" in b]
    assert len(made) == 1 and made[0].strip().startswith("Fix the greeting")
    assert len(git(repo, "log", "--format=%H").split()) == 2


@needs_sqlite_server
def test_a_legacy_handshake_leaves_an_mcp_1_server_s_stderr_clean(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The default handshake first asks to discover the server (the newest protocol); an
    mcp 1.x server answers with a page of validation errors on its stderr before the
    client falls back. protocol="legacy" starts with initialize: not one such line."""

    def errors_said(protocol: str) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="ratchet.tools.mcp.stderr"):
            conn = MCPConnection.stdio(
                [str(SQLITE_PROGRAM), "--db-path", str(tmp_path / f"{protocol}.db")],
                connect_timeout_s=60,
                protocol=protocol,
            ).start()
            assert [t.spec.name for t in mcp_tools(conn)]
            conn.close()
            tail = conn._errtail
            assert tail is not None
            tail.tail(wait_s=10)  # the server exited: every line it wrote is logged
        return [r.getMessage() for r in caplog.records if "validat" in r.getMessage()]

    assert errors_said("auto")  # the noise is real
    assert errors_said("legacy") == []


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
