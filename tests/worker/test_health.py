"""``ratchet health`` (the worker container's healthcheck) against a real pool: it counts
the worker processes of this host that RQ has registered and that are alive."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ratchet.fleet.settings import Settings
from tests.worker.fleet_harness import poll
from tests.worker.processes import pool_env, running_pool

pytestmark = pytest.mark.slow

RATCHET = [sys.executable, "-m", "ratchet.cli.entry"]


def health(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*RATCHET, "health", *args],
        env=pool_env(settings),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def report(settings: Settings) -> dict[str, Any]:
    done = health(settings, "--json")
    assert done.returncode in (0, 1), done.stderr
    data: dict[str, Any] = json.loads(done.stdout)
    return data


def test_health_fails_with_no_worker_and_passes_once_the_pool_runs(
    settings: Settings,
    tmp_path: Path,
) -> None:
    idle = health(settings)
    assert idle.returncode == 1
    assert idle.stderr.splitlines() == [
        f"ratchet: unhealthy: 0 live worker processes of this host on queue "
        f"{settings.queue}, at least 1 needed"
    ]
    with running_pool(settings, tmp_path) as pool:
        poll(lambda: health(settings).returncode == 0, deadline_s=60, what="ratchet health passing")
        too_many = health(settings, "--min-workers", "2")
        assert too_many.returncode == 1
        assert "1 live worker processes" in too_many.stderr
        pool.proc.send_signal(signal.SIGTERM)
        assert pool.wait() == 0


def test_a_killed_worker_counts_as_dead_at_once_though_rq_still_lists_it(
    settings: Settings,
    tmp_path: Path,
) -> None:
    with running_pool(settings, tmp_path) as pool:
        first = pool.one_worker()
        poll(lambda: report(settings)["alive"] == 1, deadline_s=60, what="one live worker")
        os.kill(first, signal.SIGKILL)
        second = pool.one_worker(other_than=first)
        seen: dict[str, Any] = {}

        def both_listed() -> bool:
            seen.update(report(settings))
            by_pid = {w["pid"]: w["alive"] for w in seen["workers"]}
            return by_pid.get(first) is False and by_pid.get(second) is True

        poll(both_listed, deadline_s=60, what="the dead and the new worker both listed")
        assert seen["healthy"] is True and seen["alive"] == 1
        pool.proc.send_signal(signal.SIGTERM)
        assert pool.wait() == 0
