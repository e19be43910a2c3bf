"""The job protocol: one job's flow on a leased run, and how each failure ends it.

Two drivers run it: the RQ job (:mod:`ratchet.worker.job`, with the fleet's wiring: run
documents, agents, credentials, metrics, the heartbeat thread) and the simulator's
workers (:mod:`ratchet.chaos.sim.worker`, with a simulated adapter, clock and heartbeat
on a simulated Redis). Each supplies a :class:`JobHost`, the I/O and the wiring; the
order of the job and the classification of its failures live here once, so that what the
simulator proves about a job is proved about this code, not about a copy.

The flow (see :func:`take_lease` and :func:`drive`):

1. take the lease (compare-and-set on the store's clock). A live holder ends the job
   quietly (``held_elsewhere``); a run that does not exist ends it (``no_run``); a lease
   the replicas did not confirm is not used (``lease_lost``); a lease or state record
   that is not what the scripts wrote is recorded and refused (``store_refused``);
2. open the run under the lease: the checkpoint (and the document) verified, the window
   it signs read. A run already terminal at the store's generation is released untouched;
3. the host's routing and controls (another host's run goes there: ``routed``);
4. build the adapter and resume the engine (verify, fence, observe, high-water check);
   a run terminal after the restore is released (``terminal``);
5. the host's controls that act on a restored run (an operator's cancel); otherwise
   ``reconcile`` the pending write a previous owner may have left, then the steps: the
   agent proposes, the engine gates, commits and executes, until the run leaves
   ``running``, the agent has nothing to propose, the worker is asked to stop, an
   operator cancels, or the job's step budget is spent;
6. finish: a held commit travels with the release; a run that can go on is released for
   reaping (another worker continues at once), a waiting or ended one off the index.

How a failure ends the job (:func:`restore_verdict`, :func:`step_verdict`):

* the lease is lost or in doubt (``LeaseLostError``, a fence refused, a store error, a
  high-water mark that could not be *read*): no further commit or adapter call; the
  lease expires and the reaper hands the run on (``lease_lost``);
* a retryable adapter failure: stop renewing and let the lease expire, a natural
  back-off (``retry_later``);
* a restore that fails closed (tampered checkpoint, drifted environment, rolled-back
  store, a document or environment that cannot be built) or an environment that changed
  under the run: recorded for an operator, released off the index, nothing runs
  (``restore_refused``, ``environment_changed``). Unless the store says the lease is no
  longer this job's (a newer owner moved the run on): then it is a lost lease, with no
  incident. An incident that could not be recorded leaves the lease to expire, so the
  next job refuses the run again, with its record: a refusal is never silent;
* anything else (an agent that raised, an adapter refusing for good): the host's job
  error (the worker's backoff and poison budget; the simulator's judge).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import Enum, StrEnum
from typing import Any, Protocol, cast

from ratchet.agents import Agent, AgentStep, AgentView
from ratchet.errors import (
    AdapterError,
    CheckpointError,
    ConfigurationError,
    ContractError,
    EnvironmentMismatchError,
    FenceRejectedError,
    HighWaterUnavailableError,
    IntegrityError,
    LeaseLostError,
    RatchetError,
    ReplicationUnconfirmedError,
    ReviewDecisionError,
    RunNotFoundError,
    StoreError,
    StoreProtocolError,
    StoreUnavailableError,
)
from ratchet.leasing import LeasedRun, LeaseHolder, RunSnapshot
from ratchet.leasing.handle import LeaseStore
from ratchet.runtime import KeyRing, Phase, RunEngine
from ratchet.runtime.catalog import ToolCatalog
from ratchet.runtime.checkpoint import CheckpointPayload
from ratchet.runtime.ports import Release
from ratchet.runtime.restore import open_checkpoint
from ratchet.runtime.state import TERMINAL_PHASES, ExecutedKeys

__all__ = [
    "JobHost",
    "JobOutcome",
    "JobReport",
    "Opened",
    "Verdict",
    "agent_view",
    "drive",
    "finish",
    "lease_gone",
    "open_window",
    "recover",
    "refuse",
    "release_lease",
    "restore_verdict",
    "step_verdict",
    "take_lease",
]

log = logging.getLogger("ratchet.worker.job")


class JobOutcome(StrEnum):
    """How a job ended (a metric label, a log field and the RQ job's JSON result)."""

    HELD_ELSEWHERE = "held_elsewhere"  # a live worker holds the lease
    TERMINAL = "terminal"  # the run had already ended
    WAITING = "waiting"  # for an approval or a reviewer
    FINISHED = "finished"  # the run completed or failed in this job
    CANCELLED = "cancelled"  # an operator's cancel was carried out
    YIELDED = "yielded"  # steps remain: released for reaping, another job goes on
    LEASE_LOST = "lease_lost"  # lost or in doubt: no further effect, the lease expires
    RETRY_LATER = "retry_later"  # a retryable adapter failure: the lease expires
    RESTORE_REFUSED = "restore_refused"  # failed closed: recorded, off the index
    ENVIRONMENT_CHANGED = "environment_changed"  # changed under the run: recorded
    NO_PROPOSAL = "no_proposal"  # the agent is done proposing, the run is not
    JOB_ERROR = "job_error"  # an unexpected failure, retried after a backoff
    POISONED = "poisoned"  # job errors past the budget: frozen for an operator
    NO_RUN = "no_run"  # no run with this id
    STORE_REFUSED = "store_refused"  # the run's records are not what the scripts wrote
    STORE_EPOCH_CHANGED = "store_epoch_changed"  # not the store this worker started on
    ROUTED = "routed"  # another host's run, handed to its queue


@dataclass
class JobReport:
    """What one job did; the host fills in what only it knows (steps, windows)."""

    run_id: str
    outcome: JobOutcome
    phase: str | None = None
    lease_version: int | None = None
    generation: int | None = None
    steps: int = 0
    detail: str = ""
    windows: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["outcome"] = self.outcome.value
        return data


class Verdict(Enum):
    """What a failure means for the job."""

    LOST = "lost"  # the lease is lost or in doubt
    RETRY = "retry"  # retryable: the lease expires, the run is tried again
    REFUSE = "refuse"  # fails closed: recorded, released off the index
    ENVIRONMENT = "environment"  # the environment changed under the run: as REFUSE
    JOB_ERROR = "job_error"  # the host's job error


def restore_verdict(exc: BaseException) -> Verdict | None:
    """How a failure while opening and restoring the run ends the job, or None when it
    is not a restore's own (it is then judged as a step's, by :func:`step_verdict`)."""
    if isinstance(exc, IntegrityError):
        cause = exc.__context__
        if isinstance(cause, HighWaterUnavailableError) and isinstance(
            cause.__cause__, StoreUnavailableError
        ):
            return Verdict.LOST  # Redis could not be read mid-restore: no evidence; retry
        return Verdict.REFUSE
    if isinstance(exc, FenceRejectedError | ConfigurationError | ContractError):
        return Verdict.REFUSE  # nothing about the run can be trusted or built as it is
    if isinstance(exc, ReviewDecisionError):
        return Verdict.REFUSE
    if isinstance(exc, AdapterError):
        return Verdict.RETRY if exc.retryable else Verdict.REFUSE
    return None


def step_verdict(exc: BaseException) -> Verdict:
    """How a failure after the restore (or one the restore does not judge) ends the job."""
    if isinstance(exc, LeaseLostError | FenceRejectedError):
        return Verdict.LOST
    if isinstance(exc, EnvironmentMismatchError):
        return Verdict.ENVIRONMENT
    if isinstance(exc, AdapterError):
        return Verdict.RETRY if exc.retryable else Verdict.JOB_ERROR
    if isinstance(exc, StoreError):
        return Verdict.LOST
    return Verdict.JOB_ERROR


@dataclass(frozen=True)
class Opened:
    """A run opened under its lease: the snapshot read and the checkpoint it verified."""

    snapshot: RunSnapshot
    payload: CheckpointPayload


class Guard(Protocol):
    """The job's heartbeat, as the protocol uses it."""

    def check(self) -> None:
        """Raise LeaseLostError when the lease can no longer be proven."""

    def progress(self) -> None:
        """A step was committed."""

    def stop(self) -> None:
        """Stop renewing (before the lease is given up)."""


class JobHost(Protocol):
    """What a driver of the protocol supplies: the lease, the heartbeat, and the wiring
    of its world (the fleet's, or the simulation's)."""

    @property
    def lease(self) -> LeasedRun: ...

    @property
    def guard(self) -> Guard: ...

    @property
    def max_steps(self) -> int: ...

    def open(self) -> Opened:
        """Read the run under the lease and verify it (the checkpoint's window; the
        document, where the host has one)."""

    def route(self, opened: Opened, report: JobReport) -> bool:
        """Before anything is built: the host's routing and controls. True when the job
        ended here (``report`` says how; the lease is the host's to have released)."""

    def build(self, opened: Opened) -> RunEngine:
        """The adapter and the engine, resumed from the opened checkpoint."""

    def restore_failed(self) -> None:
        """The restore failed in a way :func:`restore_verdict` judges."""

    def restored(self, engine: RunEngine) -> None:
        """The engine is resumed and the run is not terminal."""

    def before_steps(self, engine: RunEngine, report: JobReport) -> bool:
        """Controls that act on the restored run (an operator's cancel). True when they
        took the job's turn: no reconcile, no steps, straight to the finish."""

    def reconciled(self, engine: RunEngine, window: str | None) -> None:
        """``reconcile`` ran (``window``: the crash window it recovered, if any)."""

    def agent(self) -> tuple[Agent, bool]:
        """The run's agent, and whether its receipt commits may be held (it plans
        ahead, so nothing is lost by sending them with the next proposal's)."""

    def stop_requested(self) -> bool:
        """The worker is asked to stop: finish the step, release for reaping."""

    def cancel_requested(self, engine: RunEngine, report: JobReport) -> bool:
        """An operator's cancel arrived mid-job and was carried out: stop stepping."""

    def next_step(self, agent: Agent, view: AgentView) -> AgentStep | None:
        """Ask the agent (the host may record what the agent's calls cost)."""

    def ended(self, engine: RunEngine) -> None:
        """The steps are over; the finish comes next."""

    def lease_gone(self) -> bool:
        """Whether the store (on its own clock) says this lease is no longer the live
        one; a store that cannot be read says it is gone."""

    def record_refusal(self, kind: JobOutcome, reason: str, exc: RatchetError) -> None:
        """Record why the run is refused, for an operator. Raises StoreError."""

    def job_error(self, exc: Exception, report: JobReport) -> None:
        """A failure no other rule judges: the host records it and sets ``report``."""


def take_lease(
    acquire: Callable[[], LeasedRun | LeaseHolder],
    record_incident: Callable[[dict[str, Any]], object],
    report: JobReport,
) -> LeasedRun | None:
    """Step 1: the lease, or None with ``report`` saying why the job ends. Store errors
    other than these propagate (the store could not be asked)."""
    try:
        got = acquire()
    except RunNotFoundError:
        # An index or queue entry only says "look at run X"; there is no such run.
        report.outcome, report.detail = JobOutcome.NO_RUN, "no run with this id"
        return None
    except ReplicationUnconfirmedError:
        # Taken on the primary, not confirmed by the replicas the fleet asks for: what it
        # would restore may not survive a failover. Not used; the lease expires and the
        # reaper hands the run on.
        report.outcome, report.detail = (
            JobOutcome.LEASE_LOST,
            "store: ReplicationUnconfirmedError",
        )
        return None
    except StoreProtocolError as exc:
        # The run's lease or state record is not what the scripts wrote (corrupted or
        # rewritten): nothing of it is used. Recorded for an operator where possible.
        log.error("run records unreadable", extra={"run_id": report.run_id, "reason": exc.message})
        with contextlib.suppress(RatchetError):
            record_incident(
                {
                    "kind": "store_record_unreadable",
                    "reason": "lease_or_state",
                    "message": exc.message,
                }
            )
        report.outcome, report.detail = JobOutcome.STORE_REFUSED, exc.message
        return None
    if isinstance(got, LeaseHolder):
        report.outcome, report.detail = JobOutcome.HELD_ELSEWHERE, f"held by {got.owner}"
        return None
    report.lease_version = got.lease_version
    return got


def drive(host: JobHost, report: JobReport) -> RunEngine | None:
    """Steps 2 to 6 on a taken lease; ``report`` says how the job ended. Returns the
    engine once one was resumed (the host's to observe), else None. Raises what the hosts
    raise, and ``Verdict.RETRY`` failures of the restore (the caller's to judge with
    :func:`step_verdict`, as every other failure that escapes)."""
    report.outcome = JobOutcome.LEASE_LOST
    engine: RunEngine | None = None
    try:
        try:
            opened = host.open()
            state = opened.payload.state
            if state.phase in TERMINAL_PHASES and opened.payload.generation == (
                opened.snapshot.generation
            ):
                release_lease(host)  # nothing more to do, nothing of it is built
                report.outcome, report.phase = JobOutcome.TERMINAL, state.phase.value
                report.generation = opened.payload.generation
                return None
            report.generation = opened.payload.generation
            if host.route(opened, report):
                return None
            engine = host.build(opened)
        except Exception as exc:
            verdict = restore_verdict(exc)
            if verdict is None or verdict is Verdict.RETRY:
                raise  # judged below, as a step's failure
            host.restore_failed()
            if verdict is Verdict.LOST:
                report.outcome, report.detail = (
                    JobOutcome.LEASE_LOST,
                    "store: high water unreadable",
                )
                return None
            refuse(host, report, cast(RatchetError, exc), JobOutcome.RESTORE_REFUSED)
            return None
        if engine.state.phase in TERMINAL_PHASES:
            release_lease(host)
            report.outcome, report.phase = JobOutcome.TERMINAL, engine.state.phase.value
            report.generation = engine.generation
            return engine
        host.restored(engine)
        outcome = JobOutcome.YIELDED
        if not host.before_steps(engine, report):
            host.reconciled(engine, recover(engine))
            outcome = _steps(host, engine, report)
        host.ended(engine)
        finish(host, engine, report, outcome)
        return engine
    except Exception as exc:
        _judge(host, report, exc)
        return engine


def recover(engine: RunEngine) -> str | None:
    """Reconcile the pending write a previous owner may have left (looked up, replayed
    from its receipt, or sent again only where that is safe) before anything new is
    proposed. Returns the crash window it recovered from, if any."""
    recovered = engine.reconcile()
    return recovered.window.value if recovered.window is not None else None


def _judge(host: JobHost, report: JobReport, exc: Exception) -> None:
    verdict = step_verdict(exc)
    if verdict is Verdict.LOST:
        # No further commit or adapter call: the lease expires, the reaper hands it on.
        name = type(exc).__name__
        if isinstance(exc, StoreError) and not isinstance(exc, LeaseLostError):
            name = f"store: {name}"
        report.outcome, report.detail = JobOutcome.LEASE_LOST, name
    elif verdict is Verdict.RETRY:
        report.outcome, report.detail = JobOutcome.RETRY_LATER, cast(AdapterError, exc).message
    elif verdict is Verdict.ENVIRONMENT:
        # The environment is not what the signed state says it should be (edited behind
        # the run, or a write's result that cannot be explained). Nothing more is sent; a
        # restore would refuse it the same way, so the run leaves the index with the
        # reason recorded, for an operator.
        refuse(host, report, cast(RatchetError, exc), JobOutcome.ENVIRONMENT_CHANGED)
    else:
        host.job_error(exc, report)


def _steps(host: JobHost, engine: RunEngine, report: JobReport) -> JobOutcome:
    """Step 5's loop. Returns the outcome the finish starts from."""
    agent, coalesce = host.agent()
    last_read: str | None = None
    for _ in range(host.max_steps):
        if engine.state.phase is not Phase.RUNNING:
            return JobOutcome.YIELDED  # the finish judges the phase
        if host.stop_requested():
            return JobOutcome.YIELDED
        host.guard.check()
        if host.cancel_requested(engine, report):  # an operator asked: a safe point
            return JobOutcome.YIELDED
        step = host.next_step(agent, agent_view(engine, last_read))
        if step is None:
            return JobOutcome.NO_PROPOSAL
        result = engine.propose(step.action, agent_state=step.agent_state)
        if not coalesce:
            engine.flush()  # durable before the agent thinks; see Agent.plans_ahead
        last_read = result.read.content if result.read is not None else None
        report.steps += 1
        host.guard.progress()
    return JobOutcome.YIELDED


def finish(host: JobHost, engine: RunEngine, report: JobReport, outcome: JobOutcome) -> None:
    """Step 6. The engine's state already includes any held commit: decide, then send
    that commit with the release (a held receipt commit goes out before the lease does)."""
    phase = engine.state.phase
    if phase in TERMINAL_PHASES:
        report.outcome = JobOutcome.CANCELLED if phase is Phase.CANCELLED else JobOutcome.FINISHED
        reap = False
    elif phase in (Phase.AWAITING_APPROVAL, Phase.NEEDS_REVIEW):
        report.outcome, reap = JobOutcome.WAITING, False  # approve / review re-enqueue it
    elif outcome is JobOutcome.NO_PROPOSAL:
        # The agent is done proposing but the run is not: an operator looks.
        report.outcome, reap = JobOutcome.NO_PROPOSAL, False
    else:
        report.outcome, reap = JobOutcome.YIELDED, True  # another worker continues at once
    report.phase = phase.value
    release_lease(host, reap=reap, flush=engine)
    report.generation = engine.generation


def release_lease(host: JobHost, *, reap: bool = False, flush: RunEngine | None = None) -> None:
    """Stop the heartbeat, then give the lease up; with ``flush``, the engine's held commit
    goes first and carries the release in the same round trip.

    A renewal still in flight when the lease is released would be refused and reported as
    a lost lease; stopping (and joining) the heartbeat first rules that out.
    """
    host.guard.stop()
    if flush is not None:
        flush.flush(release=Release(reap=reap))  # returns the outcome below, if it sent
    host.lease.release(reap=reap)


def refuse(host: JobHost, report: JobReport, exc: RatchetError, kind: JobOutcome) -> None:
    """A restore (or a step) failed closed: record why, take the run off the index, run
    nothing more.

    Unless the lease is no longer this job's: a job paused or stalled past its lease
    judges a run its new owner has moved on (a newer fence at the adapters, an
    environment one step ahead of the checkpoint it read). That is a lost lease, not a run
    to freeze: no incident. Nothing is lost by it: a run really broken refuses its next
    restore the same way, under a live lease, and is frozen then.

    The record comes before the release: a refusal the store did not record is not
    released off the index (the lease expires, the next job refuses again and records)."""
    if host.lease_gone():
        report.outcome, report.detail = JobOutcome.LEASE_LOST, type(exc).__name__
        return
    reason = str(exc.context.get("reason", "") or type(exc).__name__)
    try:
        host.record_refusal(kind, reason, exc)
    except StoreError as failure:
        report.outcome = JobOutcome.LEASE_LOST
        report.detail = f"store: {type(failure).__name__} (the refusal was not recorded)"
        return
    try:
        release_lease(host)
    except (LeaseLostError, StoreError) as failure:
        report.outcome, report.detail = JobOutcome.LEASE_LOST, type(failure).__name__
        return
    report.outcome, report.detail = kind, f"{reason}: {exc.message}"


def lease_gone(store: LeaseStore, lease: LeasedRun) -> bool:
    """Whether the store (on its own clock) says ``lease`` is no longer the live one:
    expired, or taken over. A store that cannot be read says nothing either way; the job
    then ends as if its lease were lost and the run is tried again. (Both hosts'
    :meth:`JobHost.lease_gone`.)"""
    try:
        snap = store.read_run(lease.run_id)
    except StoreError:
        return True
    return not snap.is_held_by(lease.owner, lease.lease_version)


def open_window(
    lease: LeasedRun, snap: RunSnapshot, keyring: KeyRing
) -> tuple[RunSnapshot, CheckpointPayload]:
    """Open the checkpoint of ``snap`` (read with ``archive_tail``) as the window it signs.
    When the segments read do not reach back to the window's start (a checkpoint made
    before windowed state, or a window longer than the tail), read the whole archive once
    under the same lease and open that: the snapshot returned is the one opened.

    Raises CheckpointError and what ``LeasedRun.read`` raises.
    """
    checkpoint = cast(bytes, snap.checkpoint)
    try:
        opened = open_checkpoint(
            checkpoint,
            keyring=keyring,
            archive=snap.archive,
            windowed=True,
            archive_from=snap.archive_from,
            keys=snap.keys,
        )
    except CheckpointError as exc:
        if exc.reason != "archive_short":
            raise
        snap = lease.read(with_checkpoint=True, with_scenario=snap.scenario is not None)
        opened = open_checkpoint(
            cast(bytes, snap.checkpoint), keyring=keyring, archive=snap.archive, windowed=True
        )
    return snap, opened


def _catalog(engine: RunEngine) -> ToolCatalog:
    return engine.tools if isinstance(engine.tools, ToolCatalog) else ToolCatalog()


def agent_view(engine: RunEngine, last_read: str | None = None) -> AgentView:
    """What a worker shows the agent before each proposal (the tools are the scenario's
    permitted ones, with the contracts the engine checks calls by)."""
    state = engine.state
    report = state.verification
    env = state.environment
    verified = bool(
        report is not None
        and report.passed
        and report.env_version == env.version
        and report.env_fingerprint == env.fingerprint
    )
    return AgentView(
        run_id=state.run_id,
        phase=state.phase,
        observation=env,
        plan_cursor=state.plan_cursor,
        usage=state.usage,
        last_outcome=state.trace[-1].outcome,
        quarantined_keys=state.quarantined_keys,
        agent_state=dict(state.agent_state),
        now=engine.clock.now(),
        executed_keys=ExecutedKeys(state),
        verified=verified,
        last_read=last_read,
        tools=tuple(_catalog(engine).permitted(engine.scenario)),
    )
