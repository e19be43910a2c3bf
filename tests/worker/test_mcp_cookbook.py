"""docs/mcp-cookbook.md as a user runs it: the tool package the page shows (its module and
entry points, verbatim) installed over the unmodified reference servers from PyPI, each
in its own virtual environment; the page's task files and plans (paths changed to a
scratch repository and database) run on a worker. A worker killed right after a write,
with the server: the git commit is found by the key recipe (or waits for a review without
it), the SQLite INSERT waits for a review; each effect happens once. Effects are counted
outside ratchet: the repository's own log (the ``git`` program), the database's rows."""

from __future__ import annotations

import importlib
import os
import sqlite3
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ratchet.chaos.failpoints import FailpointFired
from ratchet.errors import AdapterError
from ratchet.fleet.context import Fleet
from ratchet.fleet.settings import Settings
from ratchet.ops import inspect_run, submit
from ratchet.ops.taskfile import load_task_file
from ratchet.runtime import Phase
from ratchet.runtime.state import ReviewReason
from ratchet.tools import ToolCall, load_entry_point_tool
from ratchet.tools.mcp import close_shared
from ratchet.worker.hooks import WorkerHooks
from ratchet.worker.job import execute_run
from tests.docs_blocks import ROOT, named
from tests.tools.reference_servers import GIT_SERVER, SQLITE_SERVER, reference_server
from tests.worker.fleet_harness import poll

pytestmark = pytest.mark.slow

PAGE = ROOT / "docs" / "mcp-cookbook.md"
SUBJECT = "Fix the greeting"


@pytest.fixture(scope="module")
def servers() -> tuple[Path, Path]:
    """The two servers' programs (installed into a cache once), or the test is skipped."""
    found = [reference_server(GIT_SERVER), reference_server(SQLITE_SERVER)]
    for program in found:
        if not isinstance(program, Path):
            pytest.skip(str(program))
    return found[0], found[1]  # type: ignore[return-value]


def git(repo: Path, *args: str) -> str:
    """The ``git`` program on ``repo``, with no configuration but a committer."""
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


@pytest.fixture
def cookbook(
    servers: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Any]:
    """The page's package installed, the worker's settings pointing at a scratch
    repository (one commit, the fix left in the working tree) and database (an empty
    ``orders`` table). Yields the imported module."""
    site = tmp_path / "site"
    info = site / "reference_tools-1.0.dist-info"
    info.mkdir(parents=True)
    (site / "reference_tools.py").write_text(named(PAGE, "package").text, encoding="utf-8")
    toml = tomllib.loads(named(PAGE, "entry-points").text)
    points = toml["project"]["entry-points"]["ratchet.tools"]
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: reference-tools\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[ratchet.tools]\n" + "".join(f"{name} = {value}\n" for name, value in points.items())
    )
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "app.py").write_text('print("Hello, wrold")\n')
    git(repo, "add", "app.py")
    git(repo, "commit", "-qm", "initial")
    (repo / "app.py").write_text('print("Hello, world")\n')
    db = tmp_path / "app.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE orders (ref TEXT UNIQUE, cents INTEGER)")
    git_program, sqlite_program = servers
    for name, value in {
        "GIT_MCP_SERVER": git_program,
        "GIT_MCP_REPOSITORY": repo,
        "SQLITE_MCP_SERVER": sqlite_program,
        "SQLITE_MCP_DB": db,
    }.items():
        monkeypatch.setenv(name, str(value))
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    close_shared()
    try:
        yield importlib.import_module("reference_tools")
    finally:
        close_shared()
        sys.path.remove(str(site))
        sys.modules.pop("reference_tools", None)
        importlib.invalidate_caches()


def repo_of(module: Any) -> Path:
    return Path(module.repository())


def rows(module: Any) -> list[tuple[str, int]]:
    with sqlite3.connect(module.database()) as conn:
        return list(conn.execute("SELECT ref, cents FROM orders"))


def submitted(
    fleet: Fleet,
    folder: Path,
    run_id: str,
    which: str,
    module: Any,
    edit: Callable[[str], str] = lambda text: text,
) -> str:
    """The page's task file and plan for ``which`` (git, sqlite), through the parser
    ``ratchet submit`` uses; the page's /srv paths made the scratch ones."""
    folder.mkdir()
    task = folder / "task.yaml"
    task.write_text(edit(named(PAGE, f"{which}-task").text), encoding="utf-8")
    plan = folder / "plan.yaml"
    text = named(PAGE, f"{which}-plan").text.replace("/srv/repo", str(repo_of(module)))
    plan.write_text(text, encoding="utf-8")
    return submit(fleet, load_task_file(task, str(plan)), run_id=run_id)


class DieAfterCall(WorkerHooks):
    """The worker dies right after the n-th write's call returned (nothing recorded it)."""

    def __init__(self, n: int) -> None:
        self.left = n

    def write_stage(self, stage: str) -> None:
        if stage == "after_call":
            self.left -= 1
            if self.left == 0:
                raise FailpointFired("after_call")


def cut_off_then_resumed(
    fleet: Fleet, settings: Settings, tmp_path: Path, run_id: str, n: int
) -> Any:
    """Job one dies after the n-th write's call, its servers with it; after the lease
    expired, a worker on another host takes the run. Its report."""
    with pytest.raises(FailpointFired):
        execute_run(fleet, run_id, owner="w-a", hooks=DieAfterCall(n))
    close_shared()  # the worker's process is gone, and the servers it started
    poll(lambda: not fleet.store.read_run(run_id).lease_live, deadline_s=30, what="expiry")
    elsewhere = Fleet.connect(
        settings.model_copy(update={"host": "far", "state_dir": tmp_path / "far"})
    )
    return execute_run(elsewhere, run_id, owner="w-far")


def commits(module: Any) -> list[str]:
    return git(repo_of(module), "log", "--format=%B%x00").split("\x00")[:-1]


def test_the_git_plan_stages_and_commits_once_and_completes(
    fleet: Fleet, cookbook: Any, tmp_path: Path
) -> None:
    run_id = submitted(fleet, tmp_path / "submit", "r-cook-git", "git", cookbook)
    report = execute_run(fleet, run_id, owner="w-1")
    assert report.phase == "completed", report
    made = commits(cookbook)
    assert len(made) == 2 and made[0].strip().startswith(SUBJECT)
    assert "\nRatchet-Key: " in made[0]  # the key recipe's trailer
    assert git(repo_of(cookbook), "status", "--porcelain") == ""


def test_a_commit_cut_off_after_it_was_made_is_found_by_git_log_and_made_once(
    fleet: Fleet, settings: Settings, cookbook: Any, tmp_path: Path
) -> None:
    run_id = submitted(fleet, tmp_path / "submit", "r-cook-git-cut", "git", cookbook)
    report = cut_off_then_resumed(fleet, settings, tmp_path, run_id, 2)  # add, then commit
    assert report.phase == "completed", report
    assert len(commits(cookbook)) == 2
    outcomes = [e.outcome.value for e in inspect_run(fleet, run_id).state.trace]
    assert "reconciled" in outcomes, outcomes


def test_without_the_recipe_a_cut_off_commit_waits_for_a_review_and_is_made_once(
    fleet: Fleet,
    settings: Settings,
    cookbook: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cookbook, "git_declarations", dict)
    run_id = submitted(fleet, tmp_path / "submit", "r-cook-git-review", "git", cookbook)
    report = cut_off_then_resumed(fleet, settings, tmp_path, run_id, 2)
    assert report.phase == "needs_review", report
    state = inspect_run(fleet, run_id).state
    assert state.review is not None and state.review.reason is ReviewReason.OUTCOME_UNKNOWN
    made = commits(cookbook)
    assert len(made) == 2 and "Ratchet-Key" not in made[0]


def test_git_refuses_with_an_error_result_a_refusal_with_no_effect(cookbook: Any) -> None:
    tool = load_entry_point_tool("git_commit")
    call = ToolCall(run_id="r-1", tool="git_commit", idempotency_key="k-1", fence=None)
    repo = str(repo_of(cookbook))
    with pytest.raises(AdapterError) as refused:  # nothing is staged yet
        tool.run({"repo_path": repo, "message": "nothing"}, call)
    assert refused.value.retryable is False
    assert len(commits(cookbook)) == 1


def test_the_sqlite_task_as_shown_waits_for_an_approval_before_the_insert(
    fleet: Fleet, cookbook: Any, tmp_path: Path
) -> None:
    run_id = submitted(fleet, tmp_path / "submit", "r-cook-sql-approve", "sqlite", cookbook)
    report = execute_run(fleet, run_id, owner="w-1")
    assert report.phase == Phase.AWAITING_APPROVAL.value, report
    assert rows(cookbook) == []


def unattended(text: str) -> str:
    shown = "approval_required: [sqlite_write_query]"
    assert shown in text
    return text.replace(shown, "approval_required: []")


def test_the_sqlite_plan_without_approval_inserts_once_and_completes(
    fleet: Fleet, cookbook: Any, tmp_path: Path
) -> None:
    run_id = submitted(fleet, tmp_path / "submit", "r-cook-sql", "sqlite", cookbook, unattended)
    report = execute_run(fleet, run_id, owner="w-1")
    assert report.phase == "completed", report
    assert rows(cookbook) == [("A-1", 1250)]


def test_an_insert_cut_off_after_it_was_sent_waits_for_a_review_and_happens_once(
    fleet: Fleet, settings: Settings, cookbook: Any, tmp_path: Path
) -> None:
    run_id = submitted(fleet, tmp_path / "submit", "r-cook-sql-cut", "sqlite", cookbook, unattended)
    report = cut_off_then_resumed(fleet, settings, tmp_path, run_id, 1)
    assert report.phase == "needs_review", report
    assert rows(cookbook) == [("A-1", 1250)]


def test_a_failed_insert_is_a_refusal_only_with_the_declared_pattern(
    cookbook: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    statement = {"query": "INSERT INTO missing (ref) VALUES ('A-1')"}
    call = ToolCall(run_id="r-1", tool="sqlite_write_query", idempotency_key="k-1", fence=None)
    with pytest.raises(AdapterError) as refused:
        load_entry_point_tool("sqlite_write_query").run(statement, call)
    assert refused.value.retryable is False
    # Undeclared, the same answer is an output: the write would count as done.
    monkeypatch.setattr(cookbook, "sqlite_declarations", dict)
    loose = load_entry_point_tool("sqlite_write_query")
    assert str(loose.run(statement, call)).startswith("Database error: no such table")
