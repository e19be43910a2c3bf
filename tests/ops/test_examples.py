"""The example in ``examples/greeting`` as ``examples/README.md`` walks through it: the real
``ratchet`` command in subprocesses against a real redis-server, with the example's own
task file, workspace and agent (imported by the workers as ``greeting.agent:make_agent``
under ``RATCHET_AGENTS=greeting``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ratchet.agents import AgentPolicy
from ratchet.errors import ConfigurationError
from ratchet.ops.taskfile import load_task_file
from ratchet.redis_server import RedisServer
from tests.conftest import test_sandbox_mode
from tests.gitremotes import branch_log, writes_by_key
from tests.worker.conftest import CHECKPOINT_KEY_HEX

# A tour is a dozen `ratchet` processes (each a Python start and its imports) and worker
# bursts; on a loaded 2-core machine one took past the suite's 120 s default.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "greeting"
AGENT = "greeting.agent:make_agent"
RATCHET = [sys.executable, "-m", "ratchet.cli.entry"]
WRONG = 'print("Hello, wrold")\n'
RIGHT = 'print("Hello, world")\n'


def copy_example(parent: Path, name: str) -> Path:
    """A fresh copy of the example folder (its workspace is written by the run)."""
    return Path(
        shutil.copytree(
            EXAMPLE, parent / name, ignore=shutil.ignore_patterns("__pycache__", ".ratchet")
        )
    )


class Cli:
    """The ``ratchet`` command as the walkthrough runs it, in one folder, one environment."""

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        self.cwd = cwd
        self.env = env

    def run(self, *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [*RATCHET, *args],
            env=self.env,
            cwd=self.cwd,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        if ok and done.returncode != 0:
            raise AssertionError(
                f"ratchet {' '.join(args)} exited {done.returncode}: {done.stderr[-2000:]}"
            )
        return done

    def json(self, *args: str) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.run(*args, "--json").stdout)
        return data

    def work(self) -> None:
        """Process the queue until it is empty (``ratchet worker --burst``)."""
        self.run("worker", "--burst")


@pytest.fixture
def cli(redis_server: RedisServer, tmp_path: Path) -> Cli:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env.update(
        RATCHET_REDIS_URL=redis_server.url,
        RATCHET_CHECKPOINT_KEY=CHECKPOINT_KEY_HEX,
        RATCHET_QUEUE=f"examples-{tmp_path.name}",
        RATCHET_LOG_LEVEL="WARNING",
        RATCHET_VERIFIER_SANDBOX=test_sandbox_mode().value,
        RATCHET_AGENTS="greeting",
        PYTHONPATH=str(tmp_path),
        USER="olga",
    )
    cli = Cli(tmp_path, env)
    for kind, signer, trust in (
        ("approver", "alice", "RATCHET_APPROVERS_FILE"),
        ("reviewer", "rita", "RATCHET_REVIEWERS_FILE"),
    ):
        made = cli.json("keys", "generate", "--kind", kind, "--id", signer, "--out", "keys")
        env[trust] = made["trust_file"]
    copy_example(tmp_path, "greeting")
    return cli


def test_the_example_task_file_loads_with_the_example_agent(tmp_path: Path) -> None:
    root = copy_example(tmp_path, "greeting")
    document = load_task_file(root / "task.yaml", AGENT)
    assert document.agent == AGENT
    assert Path(document.environment.root) == (root / "workspace").resolve()
    assert document.scenario.approval_required == ("write_file",)
    assert set(document.environment.verifiers) == set(document.scenario.allowed_verifier_targets)
    assert (root / "workspace" / "app.py").read_text() == WRONG
    sys.path.insert(0, str(tmp_path))
    try:
        agent = AgentPolicy(prefixes=("greeting",)).build(AGENT, dict(document.agent_config))
        assert agent.next_step is not None
        with pytest.raises(ConfigurationError) as refused:
            AgentPolicy().build(AGENT, dict(document.agent_config))
        assert refused.value.field == "agent"
        with pytest.raises(ConfigurationError) as bad:
            AgentPolicy(prefixes=("greeting",)).build(AGENT, {"typo": 7})
        assert bad.value.field == "agent_config.typo"
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m == "greeting" or m.startswith("greeting.")]:
            del sys.modules[name]


def test_the_example_agent_completes_the_run_once_its_write_is_approved(cli: Cli) -> None:
    run_id = cli.run("submit", "greeting/task.yaml", "--agent", AGENT).stdout.strip()
    assert cli.json("runs")["runs"][0]["run_id"] == run_id
    cli.work()
    shown = cli.json("show", run_id)
    assert shown["phase"] == "awaiting_approval"
    action = shown["pending"]["action"]
    assert (action["kind"], action["args"]) == ("write_file", {"path": "app.py", "content": RIGHT})
    assert (cli.cwd / "greeting/workspace/app.py").read_text() == WRONG  # nothing written yet
    cli.run("approve", run_id, action["action_id"], "--key", "keys/approver-alice.pem")
    cli.work()
    shown = cli.json("show", run_id)
    assert shown["phase"] == "completed"
    assert [e["idempotency_key"] for e in shown["executed"]] == [action["idempotency_key"]]
    assert shown["executed"][0]["receipt"]["approval_digest"] is not None
    assert [e["outcome"] for e in shown["trace"]][-3:] == ["executed", "verified", "completed"]
    assert (cli.cwd / "greeting/workspace/app.py").read_text() == RIGHT


def test_a_second_run_of_the_example_is_cancelled_and_its_write_dropped(cli: Cli) -> None:
    copy_example(cli.cwd, "second")
    run_id = cli.run("submit", "second/task.yaml", "--agent", AGENT).stdout.strip()
    cli.work()
    assert cli.json("show", run_id)["phase"] == "awaiting_approval"
    requested = cli.json("cancel", run_id, "--reason", "not needed any more")
    assert requested["phase_before"] == "awaiting_approval"
    cli.work()
    shown = cli.json("show", run_id)
    assert shown["phase"] == "cancelled"
    last = shown["trace"][-1]
    assert last["outcome"] == "cancelled"
    assert (last["detail"]["by"], last["detail"]["request_id"]) == ("olga", requested["request_id"])
    assert "dropped_key" in last["detail"]
    assert shown["executed"] == []
    assert (cli.cwd / "second/workspace/app.py").read_text() == WRONG
    # A cancelled run stays cancelled: nothing is left to cancel or retry.
    assert cli.run("cancel", run_id, "--reason", "again", ok=False).returncode == 2
    assert cli.run("retry", run_id, "--reason", "again", ok=False).returncode == 2


def test_a_conflict_from_another_caller_is_replanned_under_a_new_key(cli: Cli) -> None:
    copy_example(cli.cwd, "conflict")
    run_id = "tour-conflict"
    wrote = subprocess.run(
        [sys.executable, "greeting/other_writer.py", "conflict/workspace", run_id],
        env=cli.env,
        cwd=cli.cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    foreign_key = wrote.stdout.split()[-1]
    cli.run("submit", "conflict/task.yaml", "--agent", AGENT, "--run-id", run_id)
    cli.work()
    pending = cli.json("show", run_id)["pending"]["action"]
    assert pending["idempotency_key"] == foreign_key
    cli.run("approve", run_id, pending["action_id"], "--key", "keys/approver-alice.pem")
    cli.work()
    shown = cli.json("show", run_id)
    assert shown["phase"] == "needs_review"
    assert shown["review"]["reason"] == "intent_conflict"
    cli.run("review", run_id, "--decision", "replan", "--key", "keys/reviewer-rita.pem")
    cli.work()
    replanned = cli.json("show", run_id)["pending"]["action"]
    assert replanned["idempotency_key"] != foreign_key
    cli.run("approve", run_id, replanned["action_id"], "--key", "keys/approver-alice.pem")
    cli.work()
    shown = cli.json("show", run_id)
    assert shown["phase"] == "completed"
    assert [e["idempotency_key"] for e in shown["executed"]] == [replanned["idempotency_key"]]
    assert (cli.cwd / "conflict/workspace/app.py").read_text() == (
        'print("Hello, world")  # edited by another caller\n'
    )


def test_the_example_on_a_git_workspace_completes_with_one_commit_on_the_remote(
    cli: Cli,
) -> None:
    """The walkthrough's "On a git workspace": make the remote with the example's own
    script, point task-git.yaml at it, submit, approve, and find the write as one commit
    on the run's branch (the example's folder is not touched)."""
    made = subprocess.run(
        [sys.executable, "greeting/make_remote.py", "remote/greeting.git"],
        cwd=cli.cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    url = made.stdout.strip()
    assert url == (cli.cwd / "remote/greeting.git").resolve().as_uri()
    task = cli.cwd / "greeting/task-git.yaml"
    task.write_text(task.read_text().replace("file:///tmp/ratchet-greeting.git", url))
    run_id = cli.run("submit", "greeting/task-git.yaml", "--agent", AGENT).stdout.strip()
    cli.work()
    shown = cli.json("show", run_id)
    assert shown["phase"] == "awaiting_approval"
    assert shown["status"]["environment_parts"]["git remote"] == "shared"
    assert shown["status"]["host"] is None
    assert "shared" in shown["status"]["host_note"]  # not "recorded before hosts"
    action = shown["pending"]["action"]
    change = shown["pending_change"]
    assert change["current"] is not None and change["diff"]  # read from the remote's branch
    cli.run("approve", run_id, action["action_id"], "--key", "keys/approver-alice.pem")
    cli.work()
    shown = cli.json("show", run_id)
    assert shown["phase"] == "completed"
    commits = writes_by_key(cli.cwd / "remote/greeting.git", f"ratchet/{run_id}")
    assert commits == {action["idempotency_key"]: 1}
    receipt = shown["executed"][0]["receipt"]
    assert (
        receipt["result"]["commit"]
        == branch_log(cli.cwd / "remote/greeting.git", f"ratchet/{run_id}")[0].commit
    )
    assert (cli.cwd / "greeting/workspace/app.py").read_text() == WRONG  # the folder: untouched
