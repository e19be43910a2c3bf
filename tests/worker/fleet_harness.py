"""Real worker processes for the fleet tests: start, kill, pause, stop, all bounded."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.process import BaseProcess
from pathlib import Path

from ratchet.chaos.hooks import from_env
from ratchet.demo.examples import greeting_document, make_greeting_workspace
from ratchet.fleet.context import Fleet
from ratchet.fleet.settings import Settings
from ratchet.ops import inspect_run, submit
from ratchet.runtime import Scenario
from ratchet.worker.pool import _settings_json, worker_main


def poll(predicate: Callable[[], bool], *, deadline_s: float, what: str) -> None:
    """Poll ``predicate`` until true or fail after ``deadline_s`` (never a fixed sleep)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for: {what}")


def process_state(pid: int) -> str:
    """The kernel's state letter for ``pid`` (R, S, T for stopped, Z...)."""
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


class Workers:
    def __init__(self, settings: Settings) -> None:
        self._payload = _settings_json(settings)
        self._ctx = mp.get_context("spawn")
        self.procs: list[BaseProcess] = []

    def start(self, n: int = 1, *, env: dict[str, str] | None = None) -> list[BaseProcess]:
        started = []
        saved = {k: os.environ.get(k) for k in (env or {})}
        os.environ.update(env or {})
        try:
            for _ in range(n):
                proc = self._ctx.Process(
                    target=worker_main,
                    args=(self._payload, len(self.procs), False),
                    # RATCHET_FAILPOINTS in ``env`` reaches the worker through the drill's
                    # hooks, as in a drill; a plain ``ratchet worker`` ignores it.
                    kwargs={"hooks_factory": from_env},
                    daemon=True,
                )
                proc.start()
                self.procs.append(proc)
                started.append(proc)
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        return started

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.is_alive() and proc.pid is not None:
                try:
                    os.kill(proc.pid, signal.SIGCONT)
                    os.kill(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            proc.join(timeout=10)


@contextmanager
def workers(settings: Settings) -> Iterator[Workers]:
    pool = Workers(settings)
    try:
        yield pool
    finally:
        pool.stop_all()


def submit_greetings(fleet: Fleet, base: Path, n: int, think_ms: int) -> dict[str, Path]:
    """``n`` greeting runs, each on a workspace of its own under ``base``: run id -> root."""
    runs = {}
    for i in range(n):
        root = make_greeting_workspace(base / f"ws-{i}")
        doc = greeting_document(root, agent_config={"think_ms": think_ms}, runner="python")
        runs[submit(fleet, doc, run_id=f"r{i}-{os.getpid()}-{base.name}")] = root
    return runs


def phase(fleet: Fleet, run_id: str) -> str:
    return inspect_run(fleet, run_id).state.phase.value


def holder_pid(fleet: Fleet, run_id: str) -> int | None:
    snap = fleet.store.read_run(run_id)
    if not snap.lease_live or snap.owner is None:
        return None
    tail = snap.owner.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else None


def job_outcomes(fleet: Fleet, run_id: str) -> list[str]:
    """Outcomes reported by finished RQ jobs for ``run_id``."""
    from rq.job import Job
    from rq.serializers import JSONSerializer

    out = []
    finished = [
        job_id
        for queue in fleet.served_queues()
        for job_id in queue.finished_job_registry.get_job_ids()
    ]
    for job_id in finished:
        job = Job.fetch(job_id, connection=fleet.rq_connection, serializer=JSONSerializer)
        result = job.return_value()
        if isinstance(result, dict) and result.get("run_id") == run_id:
            out.append(str(result.get("outcome")))
    return out


def tools_scenario(task_id: str, permissions: list[str], target: str) -> Scenario:
    """A scenario for a run of declared tools only (``environment.kind: tools``): the
    ``permissions``, ``run_verifier`` and ``finish``; ``target`` its one verifier target."""
    return Scenario.model_validate(
        {
            "schema_version": 1,
            "task_id": task_id,
            "task_version": "1",
            "policy_id": "default",
            "policy_version": "1",
            "permissions": [*permissions, "run_verifier", "finish"],
            "allowed_paths": [],
            "allowed_verifier_targets": [target],
            "approval_required": [],
            "budgets": {"proposals": 10, "steps": 10, "wall_clock_seconds": 3600, "cost_units": 0},
            "initial_files": {},
            "verifier": {"target": target},
        }
    )
