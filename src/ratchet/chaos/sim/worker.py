"""A simulated worker: one process's job on the run, as :mod:`ratchet.worker.job` runs it.

The job here is the real job's order, step for step, with the fleet's wiring left out (no
run document, agent loading, metrics or log context; the scenario and plan are the
simulation's): acquire the lease (compare-and-set on the store's clock; held by a live
worker: end quietly), read the checkpoint under the lease, end at once for a terminal run,
``RunEngine.resume`` (verify, high-water mark, fence, observe), ``reconcile``, then the
agent loop (``propose``, and ``flush`` unless the worker batches receipt commits) for up
to ``steps_per_job`` steps, and release: the held commit carries the release when there
is one, ``reap`` when work remains. Failures end the job as they do there: a lost lease or
a refused fence ends it with no further effect; a retryable adapter failure stops without
a release (the lease expires); a restore that fails closed, a changed environment or a job
error records an incident and releases.

What is real: the engine, the executor (its lease guard and its hooks), the store client
(:class:`ratchet.leasing.RedisStore` and :class:`ratchet.leasing.LeasedRun` on the
simulated Redis), the store clock (:class:`ratchet.fleet.clock.StoreClock`), the scripted
agent. What is simulated: the heartbeat (:class:`SimGuard`, which keeps the heartbeat's
rules on the worker's simulated monotonic clock, renewed by the simulation when due), the
adapter, and every fault.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ratchet.agents import ScriptedAgent
from ratchet.errors import (
    AdapterError,
    ConfigurationError,
    ContractError,
    EnvironmentMismatchError,
    FenceRejectedError,
    HighWaterUnavailableError,
    IntegrityError,
    LeaseLostError,
    RatchetError,
    ReviewDecisionError,
    StoreError,
)
from ratchet.fleet.clock import StoreClock
from ratchet.leasing import LeasedRun, LeaseHolder, RedisStore
from ratchet.runtime import Phase, RunEngine
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
from ratchet.runtime.ports import Advance, RunKey, StoredCheckpoint
from ratchet.runtime.state import TERMINAL_PHASES
from ratchet.runtime.window import restore_tail
from ratchet.worker.executor import Executor
from ratchet.worker.job import agent_view, open_window

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

    def commit_batch(self, key: RunKey, batch: Any) -> None:
        judge = self._worker.sim.judge
        commits: list[Advance] = list(batch)
        self._lease.commit_batch(key, commits)
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
    try:
        got = store.try_acquire(sim.run_id, owner=worker.owner, ttl_ms=sim.profile.ttl_ms)
    except StoreError:
        return "store_error"
    if isinstance(got, LeaseHolder):
        return "held_elsewhere"
    lease = got
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
    try:
        return _leased(worker, store, lease, guard, clock)
    finally:
        guard.stop()
        worker.guard = None
        worker.engine = None


def _leased(
    worker: SimWorker, store: RedisStore, lease: LeasedRun, guard: SimGuard, clock: StoreClock
) -> str:
    sim = worker.sim
    try:
        try:
            # As a worker's job reads it: the archive's last segments and the key digests.
            snap = lease.read(with_checkpoint=True, archive_tail=restore_tail())
            if snap.checkpoint is None:
                raise IntegrityError("the run has no checkpoint", run_id=lease.run_id)
            snap, opened = open_window(lease, snap, sim.keyring)
            if opened.state.phase in TERMINAL_PHASES and opened.generation == snap.generation:
                _release(lease, guard)
                return "terminal"
            executor = _Executor(
                worker,
                SimAdapter(sim.env, worker.owner),
                _TruthfulStore(worker, lease),
                hooks=_Hooks(worker, lease.lease_version),
                guard=guard,
                run_id=lease.run_id,
            )
            engine = RunEngine.resume(
                cast(bytes, snap.checkpoint),
                scenario=sim.scenario,
                keyring=sim.keyring,
                executor=executor,
                clock=clock,
                lease_version=lease.lease_version,
                archive=snap.archive,
                archive_from=snap.archive_from,
                keys=snap.keys,
                opened=opened,
                coalesce=worker.coalesce,
            )
        except IntegrityError as exc:
            if isinstance(exc.__context__, HighWaterUnavailableError):
                return "lease_lost"  # the store could not be read: no evidence; retry
            return _refuse(worker, store, lease, guard, exc, "restore_refused")
        except (FenceRejectedError, ConfigurationError, ContractError, ReviewDecisionError) as exc:
            return _refuse(worker, store, lease, guard, exc, "restore_refused")
        except AdapterError as exc:
            if exc.context.get("retryable"):
                raise
            return _refuse(worker, store, lease, guard, exc, "restore_refused")
        sim.judge.restored(lease.lease_version, engine.generation)
        worker.engine = engine
        if engine.state.phase in TERMINAL_PHASES:
            _release(lease, guard)
            return "terminal"
        engine.reconcile()
        outcome = _steps(worker, engine, guard)
        _finish(lease, guard, engine, outcome)
        return outcome if outcome != "steps" else "yielded"
    except (LeaseLostError, FenceRejectedError):
        return "lease_lost"
    except EnvironmentMismatchError as exc:
        return _refuse(worker, store, lease, guard, exc, "environment_changed")
    except AdapterError as exc:
        if exc.context.get("retryable"):
            return "retry_later"
        return _refuse(worker, store, lease, guard, exc, "job_error")
    except StoreError:
        return "lease_lost"
    except RatchetError as exc:
        return _refuse(worker, store, lease, guard, exc, "job_error")
    except Exception as exc:
        sim.judge.fail(
            "no_unexpected_error", f"{type(exc).__name__} at {_where(exc)}: {str(exc)[:200]}"
        )
        raise Halt from exc


def _steps(worker: SimWorker, engine: RunEngine, guard: SimGuard) -> str:
    agent = ScriptedAgent(PLAN)
    for _ in range(worker.sim.profile.steps_per_job):
        if engine.state.phase is not Phase.RUNNING:
            return "ended"
        guard.check()
        step = agent.next_step(agent_view(engine))
        if step is None:
            return "no_proposal"
        engine.propose(step.action, agent_state=step.agent_state)
        if not worker.coalesce:
            engine.flush()
    return "steps"


def _release(lease: LeasedRun, guard: SimGuard, *, reap: bool = False) -> None:
    guard.stop()
    lease.release(reap=reap)


def _finish(lease: LeasedRun, guard: SimGuard, engine: RunEngine, outcome: str) -> None:
    """As the job's ``_finish``: decide, then send any held commit with the release."""
    phase = engine.state.phase
    reap = phase not in TERMINAL_PHASES and phase is Phase.RUNNING and outcome == "steps"
    guard.stop()
    if engine.held_commits:
        lease.release_with_next_commit(reap=reap)
        engine.flush()
    lease.release(reap=reap)


def _lease_gone(store: RedisStore, lease: LeasedRun) -> bool:
    """The job's check (``worker.job._lease_gone``): the store says this lease is no longer
    the live one, or the store cannot be read."""
    try:
        return not store.read_run(lease.run_id).is_held_by(lease.owner, lease.lease_version)
    except StoreError:
        return True


def _refuse(
    worker: SimWorker,
    store: RedisStore,
    lease: LeasedRun,
    guard: SimGuard,
    exc: RatchetError,
    kind: str,
) -> str:
    """A restore or step failed closed: as the job (``worker.job._refuse``), a lease the
    store no longer holds for this worker makes it a lost lease with no incident (a newer
    owner moved the run on); otherwise the incident is recorded (for the judge, and as the
    real job records it), then release, end."""
    sim = worker.sim
    if _lease_gone(store, lease):
        return "lease_lost_before_refusal"
    reason = str(exc.context.get("reason", "") or type(exc).__name__)
    if sim.judge.lease.live_for(lease.owner, lease.lease_version, sim.store_ms()):
        sim.judge.fail(
            "no_unexplained_refusal",
            f"{worker.owner} ({kind}): {type(exc).__name__} {reason}: {exc.message[:160]}",
        )
    with contextlib.suppress(RatchetError):
        store.record_incident(lease.run_id, {"kind": kind, "reason": reason})
    try:
        _release(lease, guard)
    except (LeaseLostError, StoreError):
        return f"{kind}_then_lease_lost"
    return kind
