"""The unmodified ``mcp-server-git`` and ``mcp-server-sqlite`` from PyPI as an operator runs
them on a fleet, with no Python of the operator's: declared
in the workers' settings (``RATCHET_MCP_SERVERS``), named by a task file, run by real
worker processes, one of them SIGKILLed right after the server made the commit and before
its receipt was committed (the ambiguous window). The commits are counted in the
repository's own history (read with dulwich): one, either way. Without a key recipe the
run waits for a reviewer;
with the trailer recipe (the key in the commit message, found by ``git_log``) the next
worker finds the commit and the run completes with nobody involved. The SQLite server's
INSERT is found the same way by its key column (``sql_key_column``): one row."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from ratchet.fleet.context import Fleet
from ratchet.fleet.mcp_servers import McpServerDeclaration
from ratchet.fleet.runs import EnvironmentSpec, McpServerSpec, RunDocument, ToolCheckSpec
from ratchet.fleet.settings import Settings
from ratchet.ops import inspect_run, submit
from ratchet.runtime.state import ReviewReason
from tests.tools.reference_servers import (
    GIT_SERVER,
    SQLITE_SERVER,
    commit_messages,
    notes_db,
    reference_server,
    rows,
    staged_repo,
)
from tests.worker.fleet_harness import phase, poll, tools_scenario, workers

pytestmark = pytest.mark.slow

GIT_PROGRAM = reference_server(GIT_SERVER) if shutil.which("git") else "no git program"
needs_git_server = pytest.mark.skipif(not isinstance(GIT_PROGRAM, Path), reason=str(GIT_PROGRAM))
MESSAGE = "Fix the greeting"


def commits(repo: Path) -> list[str]:
    """The subjects of the repository's commits, newest first (read with dulwich)."""
    return [message.splitlines()[0] for message in commit_messages(repo)]


def declared(settings: Settings, repo: Path, *, recipe: bool) -> Settings:
    commit: dict[str, Any] = {}
    if recipe:
        commit["keys"] = {
            "carry": "message",
            "tool": "git_log",
            "arguments": {"repo_path": str(repo), "max_count": 20},
        }
    servers = {
        "git": McpServerDeclaration.model_validate(
            {
                "command": [str(GIT_PROGRAM), "--repository", str(repo)],
                "tools": {"git_commit": commit, "git_log": {"risk": "read_only"}},
            }
        )
    }
    return settings.model_copy(update={"mcp_servers": servers})


def commit_document(repo: Path) -> RunDocument:
    scenario = tools_scenario("fix-greeting", ["git_commit", "git_log"], "committed")
    steps = [
        {"kind": "git_commit", "args": {"repo_path": str(repo), "message": MESSAGE}},
        {"kind": "run_verifier", "args": {"target": "committed"}},
        {"kind": "finish", "args": {"summary": "committed"}},
    ]
    check = ToolCheckSpec(
        tool="git_log",
        arguments={"repo_path": str(repo), "max_count": 1},
        contains=(f"Message: {MESSAGE}",),
    )
    return RunDocument(
        scenario=scenario,
        agent="scripted",
        agent_config={"steps": steps},
        environment=EnvironmentSpec(
            kind="tools",
            checks={"committed": check},
            mcp={"git": McpServerSpec(server="git")},
        ),
    )


def kill_after_the_commit(
    settings: Settings, repo: Path, run_id: str, window: str = "tool_after_call"
) -> Fleet:
    """A worker dies right after the server committed (in ``window``); another takes the
    run over."""
    fleet = Fleet.connect(settings)
    with workers(settings) as pool:
        (doomed,) = pool.start(1, env={"RATCHET_FAILPOINTS": f"{window}=kill"})
        doomed.join(timeout=120)
        assert doomed.exitcode == -9, doomed.exitcode  # it died in the window
        assert commits(repo).count(MESSAGE) == 1  # the commit happened; no receipt says so
        pool.start(1)
        poll(
            lambda: phase(fleet, run_id) in ("completed", "needs_review", "failed"),
            deadline_s=120,
            what="the run to settle",
        )
    return fleet


@needs_git_server
def test_a_commit_cut_off_by_a_killed_worker_is_found_by_the_recipe_once(
    settings: Settings, tmp_path: Path
) -> None:
    repo = staged_repo(tmp_path)
    with_recipe = declared(settings, repo, recipe=True)
    run_id = submit(Fleet.connect(with_recipe), commit_document(repo), run_id="r-git-recipe")
    fleet = kill_after_the_commit(with_recipe, repo, run_id)
    assert phase(fleet, run_id) == "completed"
    assert commits(repo) == [f"{MESSAGE}", "initial"]  # once, and nothing else
    assert "Ratchet-Key: " in commit_messages(repo)[0]
    outcomes = [e.outcome.value for e in inspect_run(fleet, run_id).state.trace]
    assert "reconciled" in outcomes and "review_opened" not in outcomes, outcomes


@needs_git_server
def test_without_a_recipe_the_cut_off_commit_waits_for_a_reviewer_and_is_not_repeated(
    settings: Settings, tmp_path: Path
) -> None:
    repo = staged_repo(tmp_path)
    plain = declared(settings, repo, recipe=False)
    run_id = submit(Fleet.connect(plain), commit_document(repo), run_id="r-git-review")
    fleet = kill_after_the_commit(plain, repo, run_id)
    assert phase(fleet, run_id) == "needs_review"
    assert commits(repo) == [MESSAGE, "initial"]
    case = inspect_run(fleet, run_id).state.review
    assert case is not None and case.reason is ReviewReason.OUTCOME_UNKNOWN
    assert case.pending.action.kind == "git_commit"
    assert case.pending.action.args["message"] == MESSAGE


@needs_git_server
def test_a_commit_the_ledger_recorded_before_the_kill_is_reconciled_without_a_recipe(
    settings: Settings, tmp_path: Path
) -> None:
    repo = staged_repo(tmp_path)
    plain = declared(settings, repo, recipe=False)
    run_id = submit(Fleet.connect(plain), commit_document(repo), run_id="r-git-recorded")
    fleet = kill_after_the_commit(plain, repo, run_id, window="after_adapter_before_receipt")
    assert phase(fleet, run_id) == "completed"
    assert commits(repo) == [MESSAGE, "initial"]
    outcomes = [e.outcome.value for e in inspect_run(fleet, run_id).state.trace]
    assert "reconciled" in outcomes


SQLITE_PROGRAM = reference_server(SQLITE_SERVER)
needs_sqlite_server = pytest.mark.skipif(
    not isinstance(SQLITE_PROGRAM, Path), reason=str(SQLITE_PROGRAM)
)
NOTE = "hello from ratchet"


def sqlite_declared(settings: Settings, db: Path) -> Settings:
    servers = {
        "notes": McpServerDeclaration.model_validate(
            {
                # mcp 1.x: the default handshake leaves it no errors to print (docs/mcp.md)
                "command": [str(SQLITE_PROGRAM), "--db-path", str(db)],
                "loosen": True,  # its read_query carries no annotation: read-only by word
                "tools": {
                    "read_query": {"risk": "read_only"},
                    "write_query": {
                        "refusal": r"^(Database )?[Ee]rror:",
                        "keys": {"sql_key_column": {"table": "notes"}},
                    },
                },
            }
        )
    }
    return settings.model_copy(update={"mcp_servers": servers})


def note_document() -> RunDocument:
    scenario = tools_scenario("write-note", ["write_query", "read_query"], "noted")
    insert = f"INSERT INTO notes (body, ratchet_key) VALUES ('{NOTE}', :ratchet_key)"
    steps = [
        {"kind": "write_query", "args": {"query": insert}},
        {"kind": "run_verifier", "args": {"target": "noted"}},
        {"kind": "finish", "args": {"summary": "noted"}},
    ]
    check = ToolCheckSpec(
        tool="read_query", arguments={"query": "SELECT body FROM notes"}, contains=(NOTE,)
    )
    return RunDocument(
        scenario=scenario,
        agent="scripted",
        agent_config={"steps": steps},
        environment=EnvironmentSpec(
            kind="tools", checks={"noted": check}, mcp={"notes": McpServerSpec(server="notes")}
        ),
    )


@needs_sqlite_server
def test_an_insert_cut_off_by_a_killed_worker_is_found_by_its_key_column_once(
    settings: Settings, tmp_path: Path
) -> None:
    db = notes_db(tmp_path)
    declared_sqlite = sqlite_declared(settings, db)
    run_id = submit(Fleet.connect(declared_sqlite), note_document(), run_id="r-sql-recipe")
    fleet = Fleet.connect(declared_sqlite)
    with workers(declared_sqlite) as pool:
        (doomed,) = pool.start(1, env={"RATCHET_FAILPOINTS": "tool_after_call=kill"})
        doomed.join(timeout=120)
        assert doomed.exitcode == -9, doomed.exitcode
        assert [r[0] for r in rows(db)] == [NOTE]  # the row is there; nothing recorded it
        pool.start(1)
        poll(
            lambda: phase(fleet, run_id) in ("completed", "needs_review", "failed"),
            deadline_s=120,
            what="the run to settle",
        )
    assert phase(fleet, run_id) == "completed"
    ((body, key),) = rows(db)  # once, with the write's key in its column
    state = inspect_run(fleet, run_id).state
    assert body == NOTE and state.cached(key) is not None
    outcomes = [e.outcome.value for e in state.trace]
    assert "reconciled" in outcomes and "review_opened" not in outcomes, outcomes
