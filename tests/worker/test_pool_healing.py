"""``ratchet worker`` heals: a worker process that dies is logged and replaced, SIGTERM
drains with no replacement, and a crash loop ends the pool with a documented exit code and
a line saying why. Real processes (the installed command), a real redis-server."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from ratchet.leasing import RedisServer, run_keys
from ratchet.worker.context import Fleet
from ratchet.worker.ops import submit
from ratchet.worker.pool import CRASH_LOOP_DEATHS, EXIT_CRASH_LOOP, RestartPolicy
from ratchet.worker.runs import RunDocument
from ratchet.worker.settings import Settings
from tests.worker.conftest import CHECKPOINT_KEY_HEX
from tests.worker.fleet_harness import phase, poll

RATCHET = [sys.executable, "-m", "ratchet.cli.entry"]


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


def worker_pids(parent: int) -> set[int]:
    """The live worker processes of the pool ``parent``: its children that run
    multiprocessing's spawn entry point (not its resource tracker)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == parent and state != "Z" and b"spawn_main" in cmdline:
            found.add(int(entry.name))
    return found


def gone(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@dataclass
class Pool:
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def one_worker(self, *, other_than: int | None = None) -> int:
        """Wait for exactly one live worker process (not ``other_than``); its pid."""
        found: list[int] = []

        def single() -> bool:
            pids = worker_pids(self.proc.pid) - {other_than}
            found[:] = sorted(pids)
            return len(pids) == 1

        poll(single, deadline_s=60, what="one live worker process in the pool")
        return found[0]

    def wait(self, timeout_s: float = 120) -> int:
        return self.proc.wait(timeout=timeout_s)


def pool_env(settings: Settings) -> dict[str, str]:
    """The environment of a ``ratchet`` command configured as ``settings``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env.update(
        RATCHET_REDIS_URL=settings.redis_url.get_secret_value() if settings.redis_url else "",
        RATCHET_CHECKPOINT_KEY=CHECKPOINT_KEY_HEX,
        RATCHET_QUEUE=settings.queue,
        RATCHET_STATE_DIR=str(settings.state_dir),
        RATCHET_LEASE_TTL_MS="1500",
        RATCHET_RENEW_INTERVAL_MS="300",
        RATCHET_STALL_TIMEOUT_MS="20000",
        RATCHET_REAPER_INTERVAL_MS="200",
        RATCHET_JOB_TIMEOUT_S="600",
        RATCHET_VERIFIER_SANDBOX=settings.verifier_sandbox.value,
        RATCHET_WORKER_RESTART_BACKOFF_MS="50",
        RATCHET_WORKER_RESTART_BACKOFF_MAX_MS="200",
        RATCHET_LOG_LEVEL="INFO",
    )
    return env


@contextmanager
def running_pool(settings: Settings, tmp_path: Path) -> Iterator[Pool]:
    env = pool_env(settings)
    log_path = tmp_path / "pool.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [*RATCHET, "worker", "--concurrency", "1"],
            env=env,
            cwd=tmp_path,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    pool = Pool(proc, log_path)
    try:
        yield pool
    finally:
        if proc.poll() is None:
            for pid in worker_pids(proc.pid):
                os.kill(pid, signal.SIGKILL)
            proc.kill()
            proc.wait(timeout=30)


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
