"""The drill's worker processes: spawn with a failpoint spec, watch, pause, resume, recycle.

Each worker is a real ``ratchet worker`` process (``worker_main``: RQ ``SimpleWorker`` and a
reaper thread) started with ``spawn``, its stdout and stderr sent to a log file in the
drill folder, and its own ``RATCHET_FAILPOINTS`` spec. With a :class:`MetricsWatch`, each
worker also serves its metrics on a free port of the drill's block: ``worker_main`` serves
on ``RATCHET_METRICS_PORT`` + its index, so each process gets ``RATCHET_METRICS_PORT`` set
to its port minus its index. Every wait here is a deadline.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from pathlib import Path

from ratchet.chaos.drill.scrape import MetricsWatch
from ratchet.chaos.hooks import from_env
from ratchet.fleet.settings import Settings
from ratchet.worker.pool import _settings_json, worker_main

__all__ = ["DrillWorker", "WorkerPool", "process_state"]


def process_state(pid: int) -> str:
    """The kernel's state letter for ``pid`` (``T`` when stopped); ``?`` when unknown."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def _entry(payload: str, index: int, log_path: str) -> None:
    """A worker process: output to its log file, then the ordinary worker main loop."""
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    worker_main(payload, index, False, hooks_factory=from_env)


@dataclass
class DrillWorker:
    proc: BaseProcess
    pid: int
    spec: str
    started_at: float
    fired_at: float | None = None
    fired_action: str | None = None
    paused_at: float | None = None
    resumed_at: float | None = None
    terminating_at: float | None = None
    pause: dict[str, object] = field(default_factory=dict)  # run, lease version, generation
    metrics_port: int | None = None
    name: str | None = None  # a configured worker name of its own (owner-collision twins)
    link: object | None = None  # its own link to Redis (a fault proxy), when it has one

    @property
    def active(self) -> bool:
        """Counts towards the wanted number of workers (not stopped, not leaving, not one
        of the extra twins an owner-collision fault started)."""
        return self.paused_at is None and self.terminating_at is None and self.name is None


class WorkerPool:
    """Worker processes of one drill, by pid."""

    def __init__(
        self,
        settings: Settings,
        folder: Path,
        *,
        fired_log: Path,
        events_dir: Path,
        metrics: MetricsWatch | None = None,
    ) -> None:
        self._payload = _settings_json(settings)
        self._ctx = mp.get_context("spawn")
        self._folder = folder
        self._env = {
            "RATCHET_FAILPOINTS_LOG": os.fspath(fired_log),
            "RATCHET_DRILL_EVENTS": os.fspath(events_dir),
            "RATCHET_LOG_LEVEL": "WARNING",
        }
        self.workers: dict[int, DrillWorker] = {}
        self.everyone: dict[int, DrillWorker] = {}  # every worker ever started, by pid
        self.deaths: list[dict[str, object]] = []
        self.started = 0
        self.metrics = metrics
        #: Gives each new worker its own Redis URL and the link behind it (the network
        #: faults put a proxy between every worker and Redis); None: the drill's URL.
        self.redis_link: Callable[[], tuple[str, object]] | None = None

    def __repr__(self) -> str:
        return f"WorkerPool(live={len(self.workers)}, started={self.started})"

    def spawn(
        self, spec: str, *, name: str | None = None, env: dict[str, str] | None = None
    ) -> DrillWorker:
        """Start one worker with ``spec`` as its ``RATCHET_FAILPOINTS`` (and ``name`` as its
        configured worker name, instead of the drill's; ``env`` added to its environment:
        a skewed clock's ``PYTHONPATH``)."""
        payload = self._payload
        if name is not None:
            payload = json.dumps({**json.loads(payload), "worker_name": name})
        link: object | None = None
        if self.redis_link is not None:
            url, link = self.redis_link()
            payload = json.dumps({**json.loads(payload), "redis_url": url})
        env = dict(self._env, RATCHET_FAILPOINTS=spec, **(env or {}))
        port: int | None = None
        if self.metrics is not None:
            busy = {w.metrics_port for w in self.workers.values() if w.metrics_port}
            port = self.metrics.port_for(busy)
            env["RATCHET_METRICS_PORT"] = str(port - self.started)  # + index = port
            env["RATCHET_METRICS_ADDR"] = "127.0.0.1"
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # spawn copies the environment at start()
        try:
            log = self._folder / "logs" / f"worker-{self.started}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            proc = self._ctx.Process(
                target=_entry, args=(payload, self.started, os.fspath(log)), daemon=True
            )
            proc.start()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        self.started += 1
        if proc.pid is None:  # pragma: no cover - start() always sets it
            raise RuntimeError("worker process has no pid")
        worker = DrillWorker(
            proc, proc.pid, spec, time.time(), metrics_port=port, name=name, link=link
        )
        if self.metrics is not None and port is not None:
            self.metrics.add(proc.pid, port)
        self.workers[proc.pid] = worker
        self.everyone[worker.pid] = worker
        return worker

    @property
    def active(self) -> int:
        return sum(1 for w in self.workers.values() if w.active)

    def reap_dead(self) -> list[DrillWorker]:
        """Forget workers that exited; returns them (their exit is recorded)."""
        dead = [w for w in self.workers.values() if w.proc.exitcode is not None]
        for worker in dead:
            worker.proc.join(timeout=1)
            del self.workers[worker.pid]
            self.deaths.append(
                {
                    "pid": worker.pid,
                    "at": time.time(),
                    "spec": worker.spec,
                    "exitcode": worker.proc.exitcode,
                }
            )
        return dead

    def stopped(self) -> list[DrillWorker]:
        """Workers the kernel shows stopped (SIGSTOP) that are not yet known as paused."""
        return [
            w for w in self.workers.values() if w.paused_at is None and process_state(w.pid) == "T"
        ]

    def resume(self, worker: DrillWorker) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker.pid, signal.SIGCONT)
        worker.resumed_at = time.time()

    def terminate(self, worker: DrillWorker) -> None:
        """Warm shutdown: the job finishes its step, releases the lease for reaping."""
        if worker.terminating_at is None:
            worker.terminating_at = time.time()
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGCONT)
                os.kill(worker.pid, signal.SIGTERM)

    def enforce(self, grace_s: float) -> None:
        """SIGKILL workers that have not left ``grace_s`` after SIGTERM."""
        now = time.time()
        for worker in self.workers.values():
            if worker.terminating_at is not None and now - worker.terminating_at > grace_s:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.pid, signal.SIGKILL)

    def scrapable(self) -> list[int]:
        """Pids of live workers that can answer a scrape now (not stopped by SIGSTOP)."""
        return [
            w.pid
            for w in self.workers.values()
            if w.proc.exitcode is None
            and (w.paused_at is None or w.resumed_at is not None)
            and process_state(w.pid) not in ("T", "t", "Z", "X", "?")
        ]

    def stop_all(
        self, grace_s: float = 10.0, while_waiting: Callable[[], None] | None = None
    ) -> None:
        """Resume, SIGTERM, and after ``grace_s`` SIGKILL every worker; wait for all.

        ``while_waiting`` is called about every 50 ms while workers are still leaving
        (the drill scrapes their metrics until they exit)."""
        for worker in list(self.workers.values()):
            self.terminate(worker)
        deadline = time.monotonic() + grace_s
        if while_waiting is not None:
            while time.monotonic() < deadline and any(
                w.proc.exitcode is None for w in self.workers.values()
            ):
                while_waiting()
                time.sleep(0.05)
        for worker in list(self.workers.values()):
            worker.proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for worker in list(self.workers.values()):
            if worker.proc.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.pid, signal.SIGCONT)
                    os.kill(worker.pid, signal.SIGKILL)
                worker.proc.join(timeout=10)
        self.reap_dead()
