"""The fleet CLI as a user runs it: subprocesses of the installed ``ratchet`` command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ratchet.demo.examples import make_greeting_workspace
from ratchet.redis_server import RedisServer
from tests.conftest import test_sandbox_mode
from tests.worker.conftest import CHECKPOINT_KEY_HEX

# Each test is several `ratchet` processes and worker bursts: on a loaded 2-core machine
# one took past the suite's 120 s default (each process is bounded by its own timeout).
pytestmark = [pytest.mark.slow, pytest.mark.sandbox, pytest.mark.timeout(300)]

RATCHET = [sys.executable, "-m", "ratchet.cli.entry"]


def ratchet(
    *args: str, env: dict[str, str], cwd: Path, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*RATCHET, *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture
def env(redis_server: RedisServer, tmp_path: Path) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    out.update(
        RATCHET_REDIS_URL=redis_server.url,
        RATCHET_CHECKPOINT_KEY=CHECKPOINT_KEY_HEX,
        RATCHET_QUEUE=f"cli-{tmp_path.name}",
        RATCHET_LEASE_TTL_MS="1500",
        RATCHET_REAPER_INTERVAL_MS="200",
        RATCHET_LOG_LEVEL="WARNING",
        # The verifier is the example's own test, not agent-written code: bubblewrap
        # where it works, else the explicit opt-out (a fresh machine has no bubblewrap).
        RATCHET_VERIFIER_SANDBOX=test_sandbox_mode().value,
    )
    return out


def test_the_demo_completes_every_run_with_no_duplicate_effect(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    done = ratchet("demo", "--json", env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["completed"] == report["runs"] == 6
    assert report["duplicate_effects"] == 0
    assert report["workers_killed"] == 1
    assert report["takeovers"] >= 1
    assert set(report) >= {
        "runs",
        "completed",
        "duplicate_effects",
        "stale_writes_rejected",
        "takeovers",
        "workers_killed",
        "elapsed_s",
    }


def test_submit_run_worker_show_and_runs_work_together(env: dict[str, str], tmp_path: Path) -> None:
    submitted = ratchet(
        "submit",
        "--example",
        "greeting",
        "--workspace",
        str(tmp_path / "ws"),
        env=env,
        cwd=tmp_path,
    )
    assert submitted.returncode == 0, submitted.stderr
    run_id = submitted.stdout.strip()
    listed = json.loads(ratchet("runs", "--json", env=env, cwd=tmp_path).stdout)
    assert {r["run_id"]: r["phase"] for r in listed["runs"]}[run_id] == "running"
    worked = ratchet("worker", "--burst", env=env, cwd=tmp_path)
    assert worked.returncode == 0, worked.stderr[-2000:]
    shown = json.loads(ratchet("show", run_id, "--json", env=env, cwd=tmp_path).stdout)
    assert shown["phase"] == "completed"
    assert len(shown["executed"]) == 1
    assert shown["trace"][-1]["outcome"] == "completed"
    text = ratchet("show", run_id, env=env, cwd=tmp_path).stdout
    assert "completed" in text and "executed writes" in text


def test_approve_from_the_command_line_unfreezes_a_waiting_run(
    env: dict[str, str], tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    made = ratchet(
        "keys",
        "generate",
        "--kind",
        "approver",
        "--id",
        "alice",
        "--out",
        str(keys),
        "--json",
        env=env,
        cwd=tmp_path,
    )
    assert made.returncode == 0, made.stderr
    info = json.loads(made.stdout)
    assert (os.stat(info["private_key_path"]).st_mode & 0o777) == 0o600
    env = {**env, "RATCHET_APPROVERS_FILE": info["trust_file"]}
    root = make_greeting_workspace(tmp_path / "ws")
    task = {
        "scenario": {
            "schema_version": 1,
            "task_id": "fix-greeting",
            "task_version": "1",
            "policy_id": "default",
            "policy_version": "1",
            "permissions": ["read_file", "write_file", "run_verifier", "finish"],
            "allowed_paths": ["app.py"],
            "allowed_verifier_targets": ["unit"],
            "approval_required": ["write_file"],
            "budgets": {"proposals": 30, "steps": 20, "wall_clock_seconds": 3600, "cost_units": 0},
            "initial_files": {"app.py": (root / "app.py").read_text()},
            "verifier": {"target": "unit", "expected_files": {"app.py": 'print("Hello, world")\n'}},
        },
        "environment": {
            "root": "ws",
            "verifiers": {"unit": {"argv": [sys.executable, "test_app.py"]}},
        },
    }
    task_file = tmp_path / "task.yaml"
    task_file.write_text(yaml.safe_dump(task))
    run_id = ratchet(
        "submit", str(task_file), "--agent", "greeting", env=env, cwd=tmp_path
    ).stdout.strip()
    assert run_id
    ratchet("worker", "--burst", env=env, cwd=tmp_path)
    shown = json.loads(ratchet("show", run_id, "--json", env=env, cwd=tmp_path).stdout)
    assert shown["phase"] == "awaiting_approval"
    action_id = shown["pending"]["action"]["action_id"]
    text = ratchet("show", run_id, env=env, cwd=tmp_path).stdout
    assert f"ratchet approve {run_id} {action_id}" in " ".join(text.split())
    approved = ratchet(
        "approve", run_id, action_id, "--key", info["private_key_path"], env=env, cwd=tmp_path
    )
    assert approved.returncode == 0, approved.stderr
    ratchet("worker", "--burst", env=env, cwd=tmp_path)
    shown = json.loads(ratchet("show", run_id, "--json", env=env, cwd=tmp_path).stdout)
    assert shown["phase"] == "completed"
    assert shown["executed"][0]["receipt"]["approval_digest"] is not None


def test_errors_are_one_line_with_exit_code_two(env: dict[str, str], tmp_path: Path) -> None:
    missing = ratchet("show", "no-such-run", env=env, cwd=tmp_path)
    assert missing.returncode == 2
    assert missing.stderr.startswith("ratchet: error:")
    assert "Traceback" not in missing.stderr
    assert CHECKPOINT_KEY_HEX not in missing.stderr + missing.stdout
