"""Takeover time: SIGKILL the worker holding a run's lease, time until another worker commits.

One run of this script starts its own ``redis-server`` (``appendonly yes``,
``appendfsync always``) on loopback and ``--workers`` real worker processes
(:func:`ratchet.worker.pool.worker_main`: an RQ ``SimpleWorker`` plus a reaper thread each,
started with ``multiprocessing`` spawn, as ``ratchet worker`` does). Then, ``--kills``
times:

1. submit a run of the example task (``greeting_document``: read ``app.py``, write the
   fix, run the verifier, finish; the agent "thinks" ``--think-ms`` before each proposal,
   as a model would), so that a worker holds it mid-run;
2. as soon as a worker process holds the run's live lease (``read_run(run).owner`` is
   ``<worker_name>-<pid>`` of one of ours) and has committed for it at least once, wait a
   random fraction of the renew interval (so kills land at every phase of the renewal
   cycle), SIGKILL that process, and read Redis' clock (``TIME``) at once: the kill time;
3. start a replacement worker, so the pool keeps its size;
4. poll the run's history list (``ratchet:{run}:history``, newest first,
   ``generation|state_version|lease_version|owner|commit_id|digest|at_ms``) until an entry
   from another owner appears: its ``at_ms`` (Redis time) minus the kill time is the
   **takeover time**. The same poll records when another owner first holds the lease.

A kill that lands after the holder released the lease (the run finished or is waiting in
the instant between the check and the signal) takes nothing over; it is discarded and
counted in ``kills_discarded``. The figures are p50 and p99 (nearest rank) of the takeover
times in milliseconds and as multiples of the lease TTL; the goal is p99 <= TTL + reaper
interval + 250 ms. The takeover time includes everything a real takeover includes: the
rest of the killed lease, the reaper's tick, the RQ dequeue, the new job's lease, restore
(checkpoint check, fence, observation), reconcile, and, when nothing was pending, the
agent's think time before its first commit.

At the end every run is given time to complete and every workspace's journal is read:
``runs_completed`` and ``duplicate_effects`` (writes beyond one per run) are reported.

    python benchmarks/takeover.py [--kills 20] [--lease-ttl-ms 1000] [--quick] [--json]
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import platform
import random
import secrets
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from harness import emit, parse_args, parser, print_measures, temp_redis

POLL_S = 0.003
WORKER_NAME = "tk"


def _worker(settings_json: str, index: int) -> None:
    """A worker process whose stdout is its stderr (stdout carries the one JSON object)."""
    os.dup2(2, 1)
    from ratchet.worker.pool import worker_main

    worker_main(settings_json, index, False)


@dataclass
class Pool:
    """The worker processes, by pid; every one is killed and joined at the end."""

    payload: str
    ctx: Any = field(default_factory=lambda: mp.get_context("spawn"))
    procs: dict[int, BaseProcess] = field(default_factory=dict)
    started: int = 0

    def start(self, n: int = 1) -> None:
        for _ in range(n):
            proc = self.ctx.Process(target=_worker, args=(self.payload, self.started), daemon=True)
            proc.start()
            self.started += 1
            if proc.pid is not None:
                self.procs[proc.pid] = proc

    def live(self) -> int:
        return sum(1 for p in self.procs.values() if p.is_alive())

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive() and proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
        for proc in self.procs.values():
            proc.join(timeout=10)


@dataclass
class Sample:
    run_id: str
    takeover_ms: int  # kill -> first commit by another owner (Redis time)
    lease_ms: int | None  # kill -> another owner seen holding the lease (polled)
    expiry_ms: int  # kill -> the killed lease's expiry (what was left of the TTL)
    generation_at_kill: int


def _owner_pid(owner: str | None) -> int | None:
    if not owner:
        return None
    tail = owner.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else None


def _history(fleet: Any, run_id: str) -> list[list[str]]:
    from ratchet.leasing import run_keys

    raw = fleet.store.client.lrange(run_keys(run_id).history, 0, -1)
    return [entry.decode("utf-8", "replace").split("|") for entry in raw]


def _find_holder(fleet: Any, run_id: str, pool: Pool, deadline: float) -> tuple[int, Any]:
    """Wait until one of our workers holds ``run_id`` and has committed for it."""
    while time.monotonic() < deadline:
        snap = fleet.store.read_run(run_id)
        pid = _owner_pid(snap.owner)
        if snap.lease_live and pid in pool.procs and snap.generation >= 2:
            return pid, snap
        time.sleep(POLL_S)
    raise TimeoutError(f"no worker took run {run_id} in time")


def _terminal(fleet: Any, run_id: str) -> bool:
    from ratchet.ops import inspect_run
    from ratchet.runtime.state import TERMINAL_PHASES

    return inspect_run(fleet, run_id).state.phase in TERMINAL_PHASES


def _one_kill(
    fleet: Any,
    pool: Pool,
    root: Path,
    run_id: str,
    *,
    think_ms: int,
    renew_ms: int,
    deadline_s: float,
) -> Sample | None:
    from ratchet.demo.examples import greeting_document, make_greeting_workspace
    from ratchet.ops import submit

    make_greeting_workspace(root)
    submit(
        fleet,
        greeting_document(root, agent_config={"think_ms": think_ms}, runner="python"),
        run_id=run_id,
    )
    deadline = time.monotonic() + deadline_s
    pid, held = _find_holder(fleet, run_id, pool, deadline)
    time.sleep(random.uniform(0, renew_ms / 1000))  # jitter, not security
    os.kill(pid, signal.SIGKILL)
    kill_ms = fleet.store.server_time_ms()
    pool.procs[pid].join(timeout=10)
    pool.start(1)  # the replacement starts while the others take the run over
    snap = fleet.store.read_run(run_id)
    killed_owner = held.owner  # <name>-<incarnation>-<pid>: the id its lease names
    if snap.owner != killed_owner:
        return None  # it released the lease (finished) just before the signal: no takeover
    lease_ms: int | None = None
    polls = 0
    while time.monotonic() < deadline:
        polls += 1
        if polls % 30 == 0 and _terminal(fleet, run_id):
            return None  # killed after its last commit, before the release: nothing left
        if lease_ms is None:
            now = fleet.store.read_run(run_id)
            if now.owner not in (None, "", killed_owner) and now.lease_live:
                lease_ms = now.now_ms - kill_ms
        entries = _history(fleet, run_id)
        takers = [
            e
            for e in entries
            if len(e) >= 7 and e[3] != killed_owner and int(e[0]) > snap.generation
        ]
        if takers:
            first = min(takers, key=lambda e: int(e[0]))
            return Sample(
                run_id,
                int(first[6]) - kill_ms,
                lease_ms if lease_ms is not None else int(first[6]) - kill_ms,
                snap.expires_at_ms - kill_ms,
                snap.generation,
            )
        time.sleep(POLL_S)
    raise TimeoutError(f"no other worker committed for run {run_id} in time")


def _nearest_rank(values: list[int], q: float) -> int:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _wait_and_count(fleet: Any, roots: dict[str, Path], deadline: float) -> tuple[int, int]:
    """Completed runs and duplicate effects, once every run ended or the deadline passed."""
    from ratchet.adapters.workspace import WorkspaceAdapter
    from ratchet.ops import inspect_run
    from ratchet.runtime import Phase

    phases: dict[str, Phase] = {}
    while time.monotonic() < deadline:
        phases = {r: inspect_run(fleet, r).state.phase for r in roots}
        if all(p is Phase.COMPLETED for p in phases.values()):
            break
        time.sleep(0.05)
    duplicates = 0
    for root in roots.values():
        with WorkspaceAdapter(root, ["app.py"]) as adapter:
            duplicates += max(0, adapter.effects - 1)
    completed = sum(1 for p in phases.values() if p is Phase.COMPLETED)
    return completed, duplicates


def hold_leases(fleet: Any, count: int) -> None:
    """``count`` other runs whose leases are live for the whole measurement: each run's
    records written as the create script leaves them, then its lease taken by the real
    acquire script (one hour, so no renewal is needed; the lease is on the expiry index
    as any worker's is)."""
    from ratchet.leasing import RUNS_INDEX, run_keys
    from ratchet.leasing.keyspace import phase_index

    store = fleet.store
    now = store.server_time_ms()
    pipe = store.client.pipeline(transaction=False)
    ids = [f"held-{i:06d}" for i in range(count)]
    for i, run_id in enumerate(ids):
        keys = run_keys(run_id)
        pipe.hset(
            keys.state,
            mapping={
                "task_id": "held",
                "env_instance_id": "e",
                "generation": 1,
                "state_version": 1,
                "created_at_ms": now + i,
                "updated_at_ms": now + i,
                "last_commit_id": f"c-{i}",
                "phase": "running",
                "phase_at_ms": now + i,
            },
        )
        pipe.zadd(RUNS_INDEX, {run_id: now + i})
        pipe.zadd(phase_index("running"), {run_id: now + i})
    pipe.execute()
    for run_id in ids:
        if store.acquire(run_id, owner="holder-elsewhere-1", ttl_ms=3_600_000) is None:
            raise RuntimeError(f"could not take the lease of {run_id}")


def run(
    *,
    kills: int,
    workers: int,
    ttl_ms: int,
    reaper_ms: int,
    think_ms: int,
    budget_s: float,
    live_leases: int = 0,
) -> dict[str, Any]:
    """One measurement; ``live_leases`` other runs hold live leases throughout
    (:func:`hold_leases`)."""
    from pydantic import SecretStr

    from ratchet.fleet.context import Fleet
    from ratchet.fleet.settings import Settings
    from ratchet.leasing import RedisStore
    from ratchet.worker.pool import _settings_json

    started = time.monotonic()
    renew_ms = max(ttl_ms // 4, 50)
    os.environ.setdefault("RATCHET_LOG_LEVEL", "WARNING")  # inherited by the workers
    samples: list[Sample] = []
    discarded = 0
    from ratchet.adapters.sandbox import for_own_verifiers

    roots: dict[str, Path] = {}
    with temp_redis(prefix="ratchet-takeover-") as (server, base):
        RedisStore(server.client()).identity.init_epoch()
        settings = Settings(
            redis_url=SecretStr(server.url),
            state_dir=base / "state",
            queue=f"takeover-{secrets.token_hex(3)}",
            lease_ttl_ms=ttl_ms,
            renew_interval_ms=renew_ms,
            reaper_interval_ms=reaper_ms,
            stall_timeout_ms=max(30_000, 10 * ttl_ms),
            job_timeout_s=600,
            checkpoint_key=SecretStr(secrets.token_hex(32)),
            worker_name=WORKER_NAME,
            verifier_sandbox=for_own_verifiers(),
        )
        fleet = Fleet.connect(settings)
        hold_leases(fleet, live_leases)
        pool = Pool(_settings_json(settings))
        end = started + budget_s
        try:
            pool.start(workers)
            index = 0
            while len(samples) < kills:
                remaining = end - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"only {len(samples)} of {kills} takeovers within {budget_s:.0f} s"
                    )
                run_id = f"tk-{index}-{secrets.token_hex(3)}"
                roots[run_id] = base / "workspaces" / f"ws-{index}"
                index += 1
                sample = _one_kill(
                    fleet,
                    pool,
                    roots[run_id],
                    run_id,
                    think_ms=think_ms,
                    renew_ms=renew_ms,
                    deadline_s=min(remaining, 30 + 10 * ttl_ms / 1000),
                )
                if sample is None:
                    discarded += 1
                    continue
                samples.append(sample)
            completed, duplicates = _wait_and_count(
                fleet, roots, time.monotonic() + max(10.0, 10 * ttl_ms / 1000)
            )
        finally:
            pool.stop_all()
        workers_started = pool.started
    takeovers = [s.takeover_ms for s in samples]
    leases = [s.lease_ms for s in samples if s.lease_ms is not None]
    after_expiry = [s.takeover_ms - s.expiry_ms for s in samples]
    p50, p99 = _nearest_rank(takeovers, 0.5), _nearest_rank(takeovers, 0.99)
    bound = ttl_ms + reaper_ms + 250
    return {
        "kills": len(samples),
        "kills_discarded": discarded,
        "live_leases": live_leases,
        "lease_ttl_ms": ttl_ms,
        "reaper_interval_ms": reaper_ms,
        "renew_interval_ms": renew_ms,
        "think_ms": think_ms,
        "p50_ms": p50,
        "p99_ms": p99,
        "max_ms": max(takeovers),
        "min_ms": min(takeovers),
        "mean_ms": round(statistics.fmean(takeovers), 1),
        "p50_ttl_multiple": round(p50 / ttl_ms, 3),
        "p99_ttl_multiple": round(p99 / ttl_ms, 3),
        "goal_bound_ms": bound,
        "goal_met": p99 <= bound,
        "lease_taken_p50_ms": _nearest_rank(leases, 0.5) if leases else None,
        "lease_taken_p99_ms": _nearest_rank(leases, 0.99) if leases else None,
        "lease_left_at_kill_p50_ms": _nearest_rank([s.expiry_ms for s in samples], 0.5),
        "after_expiry_p50_ms": _nearest_rank(after_expiry, 0.5),
        "after_expiry_p99_ms": _nearest_rank(after_expiry, 0.99),
        "samples_ms": takeovers,
        "percentile_method": "nearest rank",
        "clock": "Redis TIME for the kill, history at_ms for the commit",
        "workers": workers,
        "workers_started": workers_started,
        "runs": len(roots),
        "runs_completed": completed,
        "duplicate_effects": duplicates,
        "redis_appendfsync": "always",
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "elapsed_s": round(time.monotonic() - started, 1),
    }


def _print_table(report: dict[str, Any]) -> None:
    print_measures(
        report,
        f"Takeover after SIGKILL ({report['kills']} kills, lease TTL "
        f"{report['lease_ttl_ms']} ms, reaper {report['reaper_interval_ms']} ms)",
    )


def main(argv: list[str] | None = None) -> int:
    cli = parser(__doc__)
    cli.add_argument("--kills", type=int, default=20, help="takeovers to measure (>= 1)")
    cli.add_argument("--workers", type=int, default=3, help="worker processes kept alive")
    cli.add_argument("--lease-ttl-ms", type=int, default=1000)
    cli.add_argument("--reaper-interval-ms", type=int, default=100)
    cli.add_argument(
        "--think-ms", type=int, default=50, help="the example agent's delay before each proposal"
    )
    cli.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="give up after this long (default: 5 s + 4 s per kill)",
    )
    args = parse_args(cli, argv, quick="smoke run: 3 kills")
    if args.quick:
        args.kills = 3
    if not 1 <= args.kills <= 500:
        cli.error("--kills must be between 1 and 500")
    if not 2 <= args.workers <= 16:
        cli.error("--workers must be between 2 and 16")
    if not 200 <= args.lease_ttl_ms <= 60_000:
        cli.error("--lease-ttl-ms must be between 200 and 60000")
    if not 50 <= args.reaper_interval_ms <= args.lease_ttl_ms:
        cli.error("--reaper-interval-ms must be between 50 and the lease TTL")
    budget = args.budget_s or 5 + args.kills * (4 + 2 * args.lease_ttl_ms / 1000)
    report = run(
        kills=args.kills,
        workers=args.workers,
        ttl_ms=args.lease_ttl_ms,
        reaper_ms=args.reaper_interval_ms,
        think_ms=args.think_ms,
        budget_s=budget,
    )
    emit(report, as_json=args.json, table=_print_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
