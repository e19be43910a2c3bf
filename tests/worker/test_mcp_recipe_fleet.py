"""Lookup recipes drilled with real worker processes and the unmodified reference MCP
servers: a worker is SIGKILLed inside an MCP call (a failpoint, as in a drill), the next
worker takes the run over, and the effect is counted where it happened: rows in the SQLite
file (``sqlite3``), commits in the repository (dulwich).

* In the ambiguous window (``tool_after_call``: the server ran the write, nothing recorded
  it): with the recipe the next worker finds the key by the server's own read and the
  run completes, no review, the write made once; without it the run waits in
  ``needs_review`` with the exact call and its key, and the write is never made again.
* Before the call (``tool_before_call``): the recipe's read finds no key and the call is
  made once.

The servers run in the workers, started by a tool package (``shared_stdio``) the way an
operator installs one: the package below, on ``sys.path`` with its entry points.
"""

from __future__ import annotations

import importlib
import json
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ratchet.demo.examples import RIGHT_GREETING, greeting_document, make_greeting_workspace
from ratchet.fleet.context import Fleet
from ratchet.fleet.settings import Settings
from ratchet.ops import inspect_run, submit
from ratchet.runtime import Phase, ReviewReason, Scenario
from ratchet.tools.mcp import close_shared
from tests.tools.reference_servers import (
    GIT_SERVER,
    SQLITE_SERVER,
    commit_messages,
    notes_db,
    reference_server,
    rows,
    staged_repo,
)
from tests.worker.fleet_harness import phase, poll, workers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

GIT_PROGRAM = reference_server(GIT_SERVER)
SQLITE_PROGRAM = reference_server(SQLITE_SERVER)
needs_git_server = pytest.mark.skipif(not isinstance(GIT_PROGRAM, Path), reason=str(GIT_PROGRAM))
needs_sqlite_server = pytest.mark.skipif(
    not isinstance(SQLITE_PROGRAM, Path), reason=str(SQLITE_PROGRAM)
)

#: The tool package: each factory returns one MCP tool over the worker's shared server.
#: ``sql_``/``git_`` tools recover by the shipped recipes; ``bare_`` ones declare none.
PLUGIN = """
from ratchet.tools.mcp import McpDeclaration, mcp_tools, shared_stdio
from ratchet.tools.mcp.recipes import git_trailer, sql_key_column

SQLITE = {sqlite!r}
GIT = {git!r}
REPO = {repo!r}


def _one(argv, prefix, name, declare=None):
    (made,) = mcp_tools(shared_stdio(argv), prefix=prefix, include=[name], declare=declare)
    return made


def sql_write_query():
    recipe = McpDeclaration(keys=sql_key_column("notes"))
    return _one(SQLITE, "sql_", "write_query", {{"write_query": recipe}})


def bare_write_query():
    return _one(SQLITE, "bare_", "write_query")


def git_commit():
    return _one(GIT, "", "git_commit", {{"git_commit": McpDeclaration(keys=git_trailer(REPO))}})


def bare_git_commit():
    return _one(GIT, "bare_", "git_commit")
"""

ENTRY_POINTS = """[ratchet.tools]
sql_write_query = recipe_servers:sql_write_query
bare_write_query = recipe_servers:bare_write_query
git_commit = recipe_servers:git_commit
bare_git_commit = recipe_servers:bare_git_commit
"""

INSERT = "INSERT INTO notes (body, ratchet_key) VALUES ('printer on fire', :ratchet_key)"
PLAIN_INSERT = "INSERT INTO notes (body) VALUES ('printer on fire')"


@dataclass
class Servers:
    """Where the package's servers keep their state: the SQLite file and the repository."""

    db: Path
    repo: Path


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Servers]:
    """The tool package installed the way pip leaves one (spawned workers inherit
    ``sys.path``), over a fresh database and repository."""
    db = notes_db(tmp_path)
    repo = staged_repo(tmp_path)
    site = tmp_path / "site"
    site.mkdir()
    sqlite_argv = [str(SQLITE_PROGRAM), "--db-path", str(db)]
    git_argv = [str(GIT_PROGRAM), "--repository", str(repo)]
    (site / "recipe_servers.py").write_text(
        PLUGIN.format(sqlite=sqlite_argv, git=git_argv, repo=str(repo))
    )
    info = site / "recipe_servers-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: recipe-servers\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    try:
        yield Servers(db, repo)
    finally:
        close_shared()  # the servers submit started in this process
        sys.path.remove(str(site))
        sys.modules.pop("recipe_servers", None)
        importlib.invalidate_caches()


def document(root: Path, tool: str, args: dict[str, Any]) -> Any:
    """The greeting task with one MCP write first: the scripted agent calls ``tool`` with
    ``args``, fixes the greeting, verifies and finishes."""
    plain = greeting_document(root, runner="python")
    data = plain.scenario.model_dump(mode="json")
    scenario = Scenario.model_validate({**data, "permissions": [*data["permissions"], tool]})
    steps = [
        {"kind": tool, "args": args},
        {"kind": "write_file", "args": {"path": "app.py", "content": RIGHT_GREETING}},
        {"kind": "run_verifier", "args": {"target": "unit"}},
        {"kind": "finish", "args": {"summary": "filed and fixed"}},
    ]
    return plain.model_copy(
        update={"scenario": scenario, "agent": "scripted", "agent_config": {"steps": steps}}
    )


@dataclass
class Outcome:
    run_id: str
    fired: list[dict[str, Any]]  # the failpoint log: what fired, in which worker's lease


def kill_then_take_over(
    settings: Settings, fleet: Fleet, tmp_path: Path, tool: str, args: dict[str, Any], point: str
) -> Outcome:
    """Submit the run; a worker SIGKILLs itself at failpoint ``point`` of the MCP call; a
    second worker takes the run over once the lease expired, until the run settles."""
    root = make_greeting_workspace(tmp_path / "ws")
    run_id = submit(fleet, document(root, tool, args), run_id=f"r-{tool}-{point}")
    fired_log = tmp_path / "failpoints.jsonl"
    with workers(settings) as pool:
        env = {"RATCHET_FAILPOINTS": f"{point}=kill", "RATCHET_FAILPOINTS_LOG": str(fired_log)}
        (doomed,) = pool.start(1, env=env)
        poll(lambda: not doomed.is_alive(), deadline_s=90, what="the worker killed in the call")
        assert doomed.exitcode == -signal.SIGKILL
        pool.start(1)
        poll(
            lambda: phase(fleet, run_id) in ("completed", "needs_review", "failed"),
            deadline_s=120,
            what="the run settled by the next worker",
        )
    fired = [json.loads(line) for line in fired_log.read_text().splitlines()]
    return Outcome(run_id, fired)


def first_output(view: Any) -> Any:
    """The output the receipt of the run's first write (the MCP call) keeps."""
    return json.loads(view.state.executed[0].receipt.result["output"])


@needs_sqlite_server
def test_a_worker_killed_after_the_insert_ran_is_recovered_by_the_key_column_no_review(
    settings: Settings, fleet: Fleet, servers: Servers, tmp_path: Path
) -> None:
    done = kill_then_take_over(
        settings, fleet, tmp_path, "sql_write_query", {"query": INSERT}, "tool_after_call"
    )
    assert [f["window"] for f in done.fired] == ["tool_after_call"]
    view = inspect_run(fleet, done.run_id)
    assert view.state.phase is Phase.COMPLETED, view.state.stop_reason
    assert view.state.review is None
    key = view.state.executed[0].idempotency_key
    assert first_output(view) == {"found_by": "read_query", "key": key}  # not sent again
    assert rows(servers.db) == [("printer on fire", key)]  # exactly one row, with its key


@needs_sqlite_server
def test_without_the_recipe_the_same_kill_waits_for_a_review_with_the_exact_call_and_key(
    settings: Settings, fleet: Fleet, servers: Servers, tmp_path: Path
) -> None:
    done = kill_then_take_over(
        settings, fleet, tmp_path, "bare_write_query", {"query": PLAIN_INSERT}, "tool_after_call"
    )
    view = inspect_run(fleet, done.run_id)
    assert view.state.phase is Phase.NEEDS_REVIEW
    case = view.state.review
    assert case is not None and case.reason is ReviewReason.OUTCOME_UNKNOWN
    action = case.pending.action
    assert (action.kind, dict(action.args)) == ("bare_write_query", {"query": PLAIN_INSERT})
    assert action.idempotency_key is not None and action.idempotency_key.startswith("ik-")
    assert done.fired[0]["run_id"] == done.run_id
    assert rows(servers.db) == [("printer on fire", None)]  # made once, never again


@needs_sqlite_server
def test_a_worker_killed_before_the_insert_was_sent_makes_it_once(
    settings: Settings, fleet: Fleet, servers: Servers, tmp_path: Path
) -> None:
    done = kill_then_take_over(
        settings, fleet, tmp_path, "sql_write_query", {"query": INSERT}, "tool_before_call"
    )
    assert [f["window"] for f in done.fired] == ["tool_before_call"]
    view = inspect_run(fleet, done.run_id)
    assert view.state.phase is Phase.COMPLETED, view.state.stop_reason
    key = view.state.executed[0].idempotency_key
    assert first_output(view) == "[{'affected_rows': 1}]"  # the server's own answer
    assert rows(servers.db) == [("printer on fire", key)]


def commit_args(servers: Servers) -> dict[str, Any]:
    return {"repo_path": str(servers.repo), "message": "Fix the greeting"}


@needs_git_server
def test_a_worker_killed_after_the_commit_is_recovered_by_its_trailer_no_review(
    settings: Settings, fleet: Fleet, servers: Servers, tmp_path: Path
) -> None:
    done = kill_then_take_over(
        settings, fleet, tmp_path, "git_commit", commit_args(servers), "tool_after_call"
    )
    assert [f["window"] for f in done.fired] == ["tool_after_call"]
    view = inspect_run(fleet, done.run_id)
    assert view.state.phase is Phase.COMPLETED, view.state.stop_reason
    key = view.state.executed[0].idempotency_key
    assert first_output(view) == {"found_by": "git_log", "key": key}  # not sent again
    assert commit_messages(servers.repo) == [
        f"Fix the greeting\n\nRatchet-Key: {key}",
        "initial\n",
    ]


@needs_git_server
def test_without_the_trailer_recipe_a_killed_commit_waits_for_a_review_made_once(
    settings: Settings, fleet: Fleet, servers: Servers, tmp_path: Path
) -> None:
    done = kill_then_take_over(
        settings, fleet, tmp_path, "bare_git_commit", commit_args(servers), "tool_after_call"
    )
    view = inspect_run(fleet, done.run_id)
    assert view.state.phase is Phase.NEEDS_REVIEW
    case = view.state.review
    assert case is not None and case.reason is ReviewReason.OUTCOME_UNKNOWN
    assert (case.pending.action.kind, dict(case.pending.action.args)) == (
        "bare_git_commit",
        commit_args(servers),
    )
    assert commit_messages(servers.repo) == ["Fix the greeting", "initial\n"]


@needs_git_server
def test_a_worker_killed_before_the_commit_was_sent_commits_once(
    settings: Settings, fleet: Fleet, servers: Servers, tmp_path: Path
) -> None:
    done = kill_then_take_over(
        settings, fleet, tmp_path, "git_commit", commit_args(servers), "tool_before_call"
    )
    assert [f["window"] for f in done.fired] == ["tool_before_call"]
    view = inspect_run(fleet, done.run_id)
    assert view.state.phase is Phase.COMPLETED, view.state.stop_reason
    key = view.state.executed[0].idempotency_key
    assert str(first_output(view)).startswith("Changes committed successfully")
    assert commit_messages(servers.repo) == [
        f"Fix the greeting\n\nRatchet-Key: {key}",
        "initial\n",
    ]
