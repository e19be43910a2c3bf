"""A simulated worker: one process's job on the run, driving the job protocol itself.

The job is :mod:`ratchet.worker.jobprotocol`, the code every worker runs: the order (take
the lease, open the run, resume, reconcile, step, finish) and the classification of every
failure are not copied here but driven, through a host that supplies the simulation's
side (:class:`_SimJob`): its scenario and plan, its adapter, no run document, routing,
controls or stop requests. So what the simulator finds about a job's policy, it finds
about the workers' (``tests/chaos/sim`` plants bugs in the protocol to show it).

What is real: the engine, the executor (its lease guard and its hooks), the store client
(:class:`ratchet.leasing.RedisStore` and :class:`ratchet.leasing.LeasedRun` on the
simulated Redis), the store clock (:class:`ratchet.fleet.clock.StoreClock`), the scripted
agent. What is simulated: the heartbeat (:class:`SimGuard`, which keeps the heartbeat's
rules on the worker's simulated monotonic clock, renewed by the simulation when due), the
adapter, and every fault.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ratchet.agents import Agent, AgentStep, AgentView, ScriptedAgent
from ratchet.errors import (
    AdapterError,
    IntegrityError,
    LeaseLostError,
    RatchetError,
    StoreError,
)
from ratchet.fleet.clock import StoreClock
from ratchet.leasing import LeasedRun, RedisStore
from ratchet.runtime import RunEngine
from ratchet.runtime.effects import (
    Commit,
    Effect,
    Execute,
    Hooks,
    Lookup,
    Observe,
    Project,
    RaiseFence,
    Reached,
    Read,
    Verify,
)
from ratchet.runtime.ports import Advance, Release, RunKey, StoredCheckpoint
from ratchet.runtime.window import restore_tail
from ratchet.worker.executor import Executor
from ratchet.worker.jobprotocol import (
    JobOutcome,
    JobReport,
    Opened,
    drive,
    lease_gone,
    open_window,
    refuse,
    take_lease,
)

from .schedule import Kind
from .world import PLAN, SimAdapter

if TYPE_CHECKING:
    from .sim import Simulation

__all__ = ["Crash", "Halt", "SimGuard", "SimWorker", "run_job"]

# Effects whose reply the simulation may lose (the adapter's calls; store calls lose
# theirs in the client, see ratchet.chaos.sim.keyspace).
_ADAPTER_EFFECTS = (Observe, Project, RaiseFence, Execute, Lookup, Read, Verify)


class Crash(BaseException):
    """The simulated worker process died here (nothing after it runs)."""


class Halt(BaseException):
    """The schedule is over (a violation was found, or the run ended): unwind."""


@dataclass
class SimGuard:
    """The heartbeat's rules (:class:`ratchet.worker.heartbeat.Heartbeat`) on the worker's
    simulated monotonic clock, in integer ms: the lease counts as lost once a renewal was
    refused or its outcome unknown, or once the local clock passed ``send time of the last
    acquire or renewal + TTL``. Renewals are made by the simulation when due."""

    worker: SimWorker
    lease: LeasedRun
    clock: StoreClock
    ttl_ms: int
    valid_until_ms: int
    next_renewal_ms: int
    lost: str | None = None
    stopped: bool = False

    def check(self) -> None:
        """Raise LeaseLostError when the lease can no longer be proven (Guard protocol)."""
        now = self.worker.mono_ms()
        if self.lost is None and now >= self.valid_until_ms:
            self.lost = "lease not renewed before its expiry"
        if self.lost is not None:
            raise LeaseLostError(
                "lease lost or in doubt; stopping before any effect",
                run_id=self.lease.run_id,
                reason=self.lost,
            )
        self.worker.cleared(self.lease.owner, self.lease.lease_version)

    def progress(self) -> None:
        """Guard protocol: a commit applied (the stall rule is not simulated)."""

    def stop(self) -> None:
        self.stopped = True

    def renew(self) -> None:
        """One heartbeat renewal (called by the simulation when it is due)."""
        sent = self.worker.mono_ms()
        self.next_renewal_ms = sent + max(self.ttl_ms // 3, 1)
        try:
            renewed = self.lease.renew()
        except RatchetError as exc:
            self.lost = f"renewal failed: {type(exc).__name__}"
            return
        self.clock.observe(renewed.now_ms, sent_at=sent / 1000)
        self.valid_until_ms = sent + self.ttl_ms


@dataclass
class SimWorker:
    """One simulated worker process (slot ``index``); a crash starts a new incarnation."""

    sim: Simulation
    index: int
    skew_ms: int
    coalesce: bool
    incarnation: int = 0
    jobs: int = 0
    guard: SimGuard | None = None
    engine: RunEngine | None = None
    paused_until: int = -1
    last_outcome: str = ""
    effect_id: int = 0
    clearance: tuple[int, bool] = (-1, False)  # (effect id, lease live when cleared)
    windows: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"w{self.index}"

    @property
    def owner(self) -> str:
        return f"w{self.index}-{self.incarnation}"

    def mono_ms(self) -> int:
        return self.sim.t + 10_000 * (self.index + 1)

    def mono(self) -> float:
        return self.mono_ms() / 1000

    def wall_ms(self) -> int:
        return self.sim.store_ms() + self.skew_ms

    def cleared(self, owner: str, version: int) -> None:
        live = self.sim.judge.lease.live_for(owner, version, self.sim.store_ms())
        if not live:
            self.sim.judge.fail(
                "leases_on_the_store_clock",
                f"{owner}'s guard passed for lease {version}, which is not live at store "
                f"time {self.sim.store_ms()}",
            )
        self.clearance = (self.effect_id, live)


class _Hooks(Hooks):
    """The simulation's decision points around each effect (after the guard)."""

    def __init__(self, worker: SimWorker, lease_version: int) -> None:
        self.worker = worker
        self.lease_version = lease_version

    def around(self, effect: Effect, proceed: Callable[[], Any]) -> Any:
        sim, worker = self.worker.sim, self.worker
        if isinstance(effect, Reached):
            worker.windows.append(effect.window.value)
            sim.point(worker, Kind.WINDOW, effect.window.value)
            return None
        if isinstance(effect, Commit | Execute | RaiseFence | Verify):
            sim.point(worker, Kind.GUARD, type(effect).__name__)
        result = proceed()
        code = sim.point(
            worker, Kind.POST, type(effect).__name__, lossy=isinstance(effect, _ADAPTER_EFFECTS)
        )
        if code == "l":
            raise AdapterError("simulated: the reply was lost", retryable=True, outcome="unknown")
        if isinstance(effect, Commit):
            for commit in effect.batch:
                sim.judge.acked(self.lease_version, commit.expected_generation + 1, commit.blob)
        return result


class _Executor(Executor):
    """The real executor, with a decision point before each effect (before its guard)."""

    def __init__(self, worker: SimWorker, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._worker = worker

    def perform(self, effect: Effect) -> Any:
        worker = self._worker
        if not isinstance(effect, Reached):
            worker.sim.point(worker, Kind.PRE, type(effect).__name__)
        worker.effect_id += 1
        return super().perform(effect)


class _TruthfulStore:
    """The lease as the executor's generation store; a batch it acknowledges is checked
    against what the store's history holds (each reply entry itself is checked against
    the truth of its commit id by the judge, at the script)."""

    def __init__(self, worker: SimWorker, lease: LeasedRun) -> None:
        self._worker = worker
        self._lease = lease

    def high_water(self, key: RunKey) -> int:
        return self._lease.high_water(key)

    def load(self, key: RunKey) -> StoredCheckpoint:
        return self._lease.load(key)

    def commit_batch(self, key: RunKey, batch: Any, *, release: Release | None = None) -> None:
        judge = self._worker.sim.judge
        commits: list[Advance] = list(batch)
        self._lease.commit_batch(key, commits, release=release)
        missing = [c for c in commits if not judge.applied(c.expected_generation + 1, c.blob)]
        if missing:
            judge.fail(
                "commit_replies_truthful",
                f"generation {missing[0].expected_generation + 1} acknowledged, not applied",
            )


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    return f"{Path(frames[0].filename).name}:{frames[0].lineno}" if frames else ""


def run_job(worker: SimWorker) -> str:
    """One job of ``worker`` on the simulation's run; returns its outcome."""
    sim = worker.sim
    store = sim.store_for(worker)
    worker.jobs += 1
    acquired_at = worker.mono_ms()
    report = JobReport(sim.run_id, JobOutcome.LEASE_LOST)
    try:
        lease = take_lease(
            lambda: store.try_acquire(sim.run_id, owner=worker.owner, ttl_ms=sim.profile.ttl_ms),
            lambda record: store.records.record_incident(sim.run_id, record),
            report,
        )
    except StoreError:
        return "store_error"
    if lease is None:
        return report.outcome.value
    clock = StoreClock(lease.lease.now_ms, sent_at=acquired_at / 1000, monotonic=worker.mono)
    guard = SimGuard(
        worker,
        lease,
        clock,
        sim.profile.ttl_ms,
        valid_until_ms=acquired_at + sim.profile.ttl_ms,
        next_renewal_ms=acquired_at + max(sim.profile.ttl_ms // 3, 1),
    )
    worker.guard = guard
    host = _SimJob(worker, store, lease, guard, clock)
    try:
        drive(host, report)
        if host.gone_before_refusal and report.outcome is JobOutcome.LEASE_LOST:
            return "lease_lost_before_refusal"  # a zombie whose successor moved on
        return report.outcome.value
    finally:
        guard.stop()
        worker.guard = None
        worker.engine = None


class _SimJob:
    """The job protocol's host in the simulation (:class:`ratchet.worker.jobprotocol.JobHost`):
    the simulation's scenario, plan and adapter; no document, routing, controls, inbox or
    stop request (the simulated fleet has none); the judge hears the restore, every
    refusal and every unexpected error."""

    def __init__(
        self,
        worker: SimWorker,
        store: RedisStore,
        lease: LeasedRun,
        guard: SimGuard,
        clock: StoreClock,
    ) -> None:
        self._worker = worker
        self._store = store
        self._lease = lease
        self._guard = guard
        self._clock = clock
        self.gone_before_refusal = False

    @property
    def lease(self) -> LeasedRun:
        return self._lease

    @property
    def guard(self) -> SimGuard:
        return self._guard

    @property
    def max_steps(self) -> int:
        return self._worker.sim.profile.steps_per_job

    def open(self) -> Opened:
        lease = self._lease
        # As a worker's job reads it: the archive's last segments and the key digests.
        snap = lease.read(with_checkpoint=True, archive_tail=restore_tail())
        if snap.checkpoint is None:
            raise IntegrityError("the run has no checkpoint", run_id=lease.run_id)
        snap, opened = open_window(lease, snap, self._worker.sim.keyring)
        return Opened(snap, opened)

    def route(self, opened: Opened, report: JobReport) -> bool:
        return False

    def build(self, opened: Opened) -> RunEngine:
        worker, lease = self._worker, self._lease
        sim = worker.sim
        executor = _Executor(
            worker,
            SimAdapter(sim.env, worker.owner),
            _TruthfulStore(worker, lease),
            hooks=_Hooks(worker, lease.lease_version),
            guard=self._guard,
            run_id=lease.run_id,
        )
        snap = opened.snapshot
        engine = RunEngine.resume(
            cast(bytes, snap.checkpoint),
            scenario=sim.scenario,
            keyring=sim.keyring,
            executor=executor,
            clock=self._clock,
            lease_version=lease.lease_version,
            archive=snap.archive,
            archive_from=snap.archive_from,
            keys=snap.keys,
            opened=opened.payload,
            coalesce=worker.coalesce,
        )
        sim.judge.restored(lease.lease_version, engine.generation)
        worker.engine = engine
        return engine

    def restore_failed(self) -> None:
        pass

    def restored(self, engine: RunEngine) -> None:
        pass

    def before_steps(self, engine: RunEngine, report: JobReport) -> bool:
        return False

    def reconciled(self, engine: RunEngine, window: str | None) -> None:
        pass  # the windows are heard as they are reached (_Hooks)

    def agent(self) -> tuple[Agent, bool]:
        return ScriptedAgent(PLAN), self._worker.coalesce

    def stop_requested(self) -> bool:
        return False

    def cancel_requested(self, engine: RunEngine, report: JobReport) -> bool:
        return False

    def next_step(self, agent: Agent, view: AgentView) -> AgentStep | None:
        return agent.next_step(view)

    def ended(self, engine: RunEngine) -> None:
        pass

    def lease_gone(self) -> bool:
        self.gone_before_refusal = lease_gone(self._store, self._lease)
        return self.gone_before_refusal

    def record_refusal(self, kind: JobOutcome, reason: str, exc: RatchetError) -> None:
        """A refusal under a lease that is live by the store's clock is one the
        simulation cannot explain (nothing in it tampers with a run): a violation."""
        worker, lease = self._worker, self._lease
        sim = worker.sim
        if sim.judge.lease.live_for(lease.owner, lease.lease_version, sim.store_ms()):
            sim.judge.fail(
                "no_unexplained_refusal",
                f"{worker.owner} ({kind.value}): {type(exc).__name__} {reason}: "
                f"{exc.message[:160]}",
            )
        self._store.records.record_incident(lease.run_id, {"kind": kind.value, "reason": reason})

    def job_error(self, exc: Exception, report: JobReport) -> None:
        if isinstance(exc, RatchetError):
            refuse(self, report, exc, JobOutcome.JOB_ERROR)
            return
        self._worker.sim.judge.fail(
            "no_unexpected_error", f"{type(exc).__name__} at {_where(exc)}: {str(exc)[:200]}"
        )
        raise Halt from exc
