"""Real processes for the worker tests: a ``ratchet worker`` pool started as a user would,
its worker processes, and the redis-servers a command may leave behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ratchet.fleet.settings import Settings
from tests.worker.conftest import CHECKPOINT_KEY_HEX
from tests.worker.fleet_harness import poll

RATCHET = [sys.executable, "-m", "ratchet.cli.entry"]


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


def redis_servers_under(folder: Path) -> list[int]:
    """Pids of live redis-server processes working in ``folder`` or below (redis-server
    changes into its data directory, and rewrites its command line)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            cwd = Path(os.readlink(entry / "cwd"))
        except OSError:
            continue
        if comm.startswith("redis-server") and state != "Z" and cwd.is_relative_to(folder):
            pids.append(int(entry.name))
    return pids
