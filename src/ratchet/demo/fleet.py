"""The fleet demo: real worker processes on the embedded Redis, and one of them killed.

1. start a private embedded ``redis-server`` (AOF on, ``appendfsync always``) in a fresh
   state folder;
2. create ``runs`` copies of the example workspace and submit a run of the greeting task
   for each (the agent "thinks" a little before each step, as a model would);
3. start ``workers`` worker processes (RQ ``SimpleWorker`` + reaper thread each);
4. as soon as one worker holds a lease in the middle of a run (its intent or receipt is
   committed but the run is not finished), SIGKILL that worker;
5. the others' reapers see the lease expire, re-enqueue the run, and another worker
   takes it over, reconciles the pending write and finishes;
6. count, on the adapters' side, how many times each intent's write happened.

Every bound here is a deadline: nothing waits forever.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import tempfile
import time
from dataclasses import asdict, dataclass, field
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from ratchet.adapters.sandbox import for_own_verifiers
from ratchet.adapters.workspace import WorkspaceAdapter
from ratchet.demo.examples import RIGHT_GREETING, greeting_document, make_greeting_workspace
from ratchet.errors import ConfigurationError
from ratchet.fleet.context import Fleet, ensure_embedded_redis, stop_embedded_redis
from ratchet.fleet.settings import Settings
from ratchet.leasing import run_keys
from ratchet.ops import inspect_run, submit
from ratchet.runtime import Phase
from ratchet.runtime.state import TERMINAL_PHASES
from ratchet.worker.pool import _settings_json, worker_main

__all__ = [
    "FleetDemoReport",
    "demo_settings",
    "owners_in_history",
    "run_fleet_demo",
    "run_workers_and_kill_one",
    "worker_settings",
]


@dataclass
class FleetDemoReport:
    runs: int
    completed: int
    duplicate_effects: int
    stale_writes_rejected: int
    takeovers: int
    workers_killed: int
    elapsed_s: float
    workers: int
    lease_ttl_ms: int
    phases: dict[str, str] = field(default_factory=dict)
    effects: dict[str, int] = field(default_factory=dict)
    killed_holding: list[str] = field(default_factory=list)
    greeting_fixed: int = 0
    sandbox: str = ""  # how the verifier (the example's own test) was confined

    @property
    def ok(self) -> bool:
        return (
            self.completed == self.runs
            and self.duplicate_effects == 0
            and self.greeting_fixed == self.runs
        )

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        return data


def demo_settings(base: Path, *, name: str, lease_ttl_ms: int) -> Settings:
    """A demo fleet's settings: the embedded Redis in ``base / "state"``, a queue and
    worker name of its own, lease timings scaled from ``lease_ttl_ms``."""
    return Settings(
        redis_url=None,
        state_dir=base / "state",
        queue=f"ratchet-{name}",
        lease_ttl_ms=lease_ttl_ms,
        renew_interval_ms=max(lease_ttl_ms // 4, 50),
        stall_timeout_ms=max(lease_ttl_ms * 10, 30_000),
        reaper_interval_ms=max(lease_ttl_ms // 8, 50),
        job_timeout_s=600,
        worker_name=name,
        # The demo's verifier runs the example's own test, not agent-written code: on a
        # machine without bubblewrap it opts out of confinement, and says so.
        verifier_sandbox=for_own_verifiers(),
    )


def worker_settings(settings: Settings, url: str) -> Settings:
    """What the demo's worker processes get: the URL of the one embedded server and the
    key ring file, explicitly, so that they share both."""
    return settings.model_copy(
        update={
            "redis_url": SecretStr(url),
            "checkpoint_keys_file": settings.state_dir / "keys" / "checkpoint.json",
        }
    )


def owners_in_history(fleet: Fleet, run_id: str) -> set[str]:
    """The worker owners that held run ``run_id``'s lease, from its lease history."""
    entries = fleet.store.client.lrange(run_keys(run_id).history, 0, -1)
    owners = set()
    for raw in entries:
        parts = raw.decode("utf-8", "replace").split("|")
        if len(parts) >= 4 and parts[3]:
            owners.add(parts[3])
    return owners


def _mid_run_holder(
    fleet: Fleet, run_ids: list[str], pids: dict[int, BaseProcess]
) -> tuple[int, str] | None:
    """A worker pid holding a live lease on a run whose write is in flight or done."""
    for run_id in run_ids:
        snap = fleet.store.read_run(run_id)
        if not snap.lease_live or snap.owner is None or snap.generation < 3:
            continue
        pid = (
            int(snap.owner.rsplit("-", 1)[-1]) if snap.owner.rsplit("-", 1)[-1].isdigit() else None
        )
        if pid in pids:
            return pid, run_id
    return None


def run_fleet_demo(
    *,
    runs: int = 6,
    workers: int = 2,
    lease_ttl_ms: int = 2000,
    think_ms: int = 250,
    deadline_s: float = 180.0,
    state_dir: Path | None = None,
) -> FleetDemoReport:
    """Run the demo and return its report. Raises ConfigurationError on a bad setup."""
    if runs < 1 or workers < 2:
        raise ConfigurationError("the demo needs at least one run and two workers")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ratchet-demo-") as tmp:
        base = Path(state_dir) if state_dir is not None else Path(tmp)
        settings = demo_settings(base, name="demo", lease_ttl_ms=lease_ttl_ms)
        url = ensure_embedded_redis(settings.state_dir)
        fleet = Fleet.connect(settings)
        child = worker_settings(settings, url)
        try:
            report = _run(
                fleet,
                child,
                base,
                runs=runs,
                workers=workers,
                think_ms=think_ms,
                deadline_s=deadline_s,
                started=started,
            )
            report.sandbox = fleet.sandbox.describe()
            return report
        finally:
            stop_embedded_redis(settings.state_dir)


def _run(
    fleet: Fleet,
    child: Settings,
    base: Path,
    *,
    runs: int,
    workers: int,
    think_ms: int,
    deadline_s: float,
    started: float,
) -> FleetDemoReport:
    roots: dict[str, Path] = {}
    for index in range(runs):
        root = make_greeting_workspace(base / "workspaces" / f"ws-{index}")
        run_id = submit(
            fleet,
            greeting_document(root, agent_config={"think_ms": think_ms}, runner="python"),
            run_id=f"demo-{index}-{os.getpid()}",
        )
        roots[run_id] = root
    run_ids = list(roots)
    phases, killed, started_workers = run_workers_and_kill_one(
        fleet, child, run_ids, workers=workers, deadline_s=deadline_s
    )
    effects, refused = {}, 0
    fixed = 0
    for run_id, root in roots.items():
        with WorkspaceAdapter(root, ["app.py"]) as adapter:
            effects[run_id] = adapter.effects
            refused += adapter.refused_stale
        fixed += (root / "app.py").read_text() == RIGHT_GREETING
    takeovers = sum(1 for r in run_ids if len(owners_in_history(fleet, r)) > 1)
    return FleetDemoReport(
        runs=len(run_ids),
        completed=sum(1 for p in phases.values() if p == Phase.COMPLETED.value),
        duplicate_effects=sum(max(0, n - 1) for n in effects.values()),
        stale_writes_rejected=refused,
        takeovers=takeovers,
        workers_killed=len(killed),
        elapsed_s=round(time.monotonic() - started, 2),
        workers=started_workers,
        lease_ttl_ms=child.lease_ttl_ms,
        phases=phases,
        effects=effects,
        killed_holding=killed,
        greeting_fixed=fixed,
    )


def run_workers_and_kill_one(
    fleet: Fleet, child: Settings, run_ids: list[str], *, workers: int, deadline_s: float
) -> tuple[dict[str, str], list[str], int]:
    """Start ``workers`` worker processes on ``child``'s settings, SIGKILL the first one
    seen holding a lease in the middle of a run, and wait (until ``deadline_s``) for every
    run to end; then stop the workers. Returns ``(phases, killed_holding, workers)``."""
    ctx = mp.get_context("spawn")
    payload = _settings_json(child)
    procs: dict[int, BaseProcess] = {}
    for index in range(workers):
        spawned = ctx.Process(target=worker_main, args=(payload, index, False), daemon=True)
        spawned.start()
        if spawned.pid is not None:
            procs[spawned.pid] = spawned
    killed: list[str] = []
    deadline = time.monotonic() + deadline_s
    try:
        while not killed and time.monotonic() < deadline:
            found = _mid_run_holder(fleet, run_ids, procs)
            if found is not None:
                pid, run_id = found
                os.kill(pid, signal.SIGKILL)
                procs[pid].join(timeout=10)
                killed.append(run_id)
                break
            if all(inspect_run(fleet, r).state.phase in TERMINAL_PHASES for r in run_ids):
                break  # everything finished before a kill could land
            time.sleep(0.02)
        phases = _wait_terminal(fleet, run_ids, deadline)
    finally:
        for worker in procs.values():
            if worker.is_alive() and worker.pid is not None:
                os.kill(worker.pid, signal.SIGTERM)
        for worker in procs.values():
            worker.join(timeout=15)
            if worker.is_alive():
                worker.kill()
    return phases, killed, len(procs)


def _wait_terminal(fleet: Fleet, run_ids: list[str], deadline: float) -> dict[str, str]:
    phases: dict[str, str] = {}
    while time.monotonic() < deadline:
        phases = {r: inspect_run(fleet, r).state.phase.value for r in run_ids}
        if all(Phase(p) in TERMINAL_PHASES for p in phases.values()):
            return phases
        time.sleep(0.05)
    return phases
