"""``ratchet worker`` heals: a worker process that dies is logged and replaced, SIGTERM
drains with no replacement, and a crash loop ends the pool with a documented exit code and
a line saying why. Real processes (the installed command), a real redis-server."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from ratchet.fleet.context import Fleet
from ratchet.fleet.runs import RunDocument
from ratchet.fleet.settings import Settings
from ratchet.leasing import run_keys
from ratchet.ops import submit
from ratchet.redis_server import RedisServer
from ratchet.worker.pool import CRASH_LOOP_DEATHS, EXIT_CRASH_LOOP, RestartPolicy
from tests.worker.fleet_harness import phase, poll
from tests.worker.processes import gone, running_pool

# --- the policy (pure) -------------------------------------------------------------------------


def test_quick_deaths_double_the_backoff_up_to_the_cap_then_count_as_a_crash_loop() -> None:
    policy = RestartPolicy(base_ms=100, cap_ms=350, stable_after_ms=10_000, crash_loop_deaths=5)
    quick, delays = 0, []
    for _ in range(4):
        quick, delay = policy.after_death(quick, lived_ms=20)
        delays.append(delay)
    assert delays == [100, 200, 350, 350]
    assert policy.after_death(quick, lived_ms=20) == (5, None)


def test_a_process_that_lived_a_while_resets_its_slots_count() -> None:
    policy = RestartPolicy(base_ms=100, cap_ms=10_000, stable_after_ms=10_000, crash_loop_deaths=3)
    quick, _ = policy.after_death(0, lived_ms=5)
    quick, _ = policy.after_death(quick, lived_ms=5)
    assert quick == 2
    assert policy.after_death(quick, lived_ms=10_000) == (0, 100)


def test_settings_refuse_a_restart_backoff_above_its_cap() -> None:
    with pytest.raises(ValueError, match="worker_restart_backoff_ms"):
        Settings(worker_restart_backoff_ms=5000, worker_restart_backoff_max_ms=1000)


# --- the pool (real processes) -----------------------------------------------------------------


def owners(fleet: Fleet, run_id: str) -> set[str]:
    raw = fleet.store.client.lrange(run_keys(run_id).history, 0, -1)
    return {owner for entry in raw if (owner := entry.decode().split("|")[3])}


pool_test = pytest.mark.slow


@pool_test
def test_a_killed_worker_is_logged_and_replaced_and_sigterm_then_drains_with_no_restart(
    fleet: Fleet,
    settings: Settings,
    tmp_path: Path,
    workspace: Callable[..., tuple[Path, RunDocument]],
) -> None:
    with running_pool(settings, tmp_path) as pool:
        first = pool.one_worker()
        os.kill(first, signal.SIGKILL)
        second = pool.one_worker(other_than=first)
        assert gone(first)
        poll(
            lambda: os.getpgid(second) == second,
            deadline_s=30,
            what="the new worker process in a process group of its own",
        )
        poll(lambda: "started in place" in pool.log, deadline_s=30, what="the restart line")
        assert (
            f"worker process {first} (slot 0) died: killed by SIGKILL (death 1 of this pool)"
        ) in pool.log

        _, document = workspace()
        run_id = submit(fleet, document)
        poll(
            lambda: phase(fleet, run_id) == "completed",
            deadline_s=90,
            what="the run completed by the replacement",
        )
        assert {owner.rsplit("-", 1)[-1] for owner in owners(fleet, run_id)} == {str(second)}

        pool.proc.send_signal(signal.SIGTERM)
        assert pool.wait() == 0, pool.log[-3000:]
        assert gone(second)
        log = pool.log
        stopped_at = log.index("SIGTERM: stopping")
        assert f"worker process {second} (slot 0) stopped: exit code 0" in log[stopped_at:]
        assert log.count("started in place") == 1  # nothing was restarted after SIGTERM
        assert log.count("died:") == 1


@pool_test
def test_workers_that_die_as_they_start_end_the_pool_with_the_crash_loop_code(
    redis_server: RedisServer,
    settings: Settings,
    tmp_path: Path,
) -> None:
    with running_pool(settings, tmp_path) as pool:
        first = pool.one_worker()  # the pool passed its own start-up checks
        # From now on every new worker refuses to start: the store may evict keys.
        redis_server.client().config_set("maxmemory-policy", "allkeys-lru")
        # (It may be gone already: it had not checked the store yet and refused too.)
        with contextlib.suppress(ProcessLookupError):
            os.kill(first, signal.SIGKILL)
        assert pool.wait() == EXIT_CRASH_LOOP, pool.log[-3000:]
    log = pool.log
    assert "refusing to start" in log
    assert log.count("died:") == CRASH_LOOP_DEATHS
    give_up = [line for line in log.splitlines() if "giving up" in line]
    assert len(give_up) == 1
    assert "a crash loop" in give_up[0] and f"exit code {EXIT_CRASH_LOOP}" in give_up[0]
    assert f"death {CRASH_LOOP_DEATHS} of this pool" in give_up[0]
