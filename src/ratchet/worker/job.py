"""The RQ job: a run id in, the job protocol driven with the fleet's wiring, a report out.

RQ hands out work; ratchet's lease decides who owns a run. The job carries only the run
id (JSON). One job advances a run through as many steps as it can (RQ costs milliseconds
per job): until the run ends, waits for a human, the agent has nothing to propose, the
worker is asked to stop, or the lease is in doubt.

The order of a job and how each failure ends it are the job protocol's
(:mod:`ratchet.worker.jobprotocol`), which the simulator drives too. What this module adds
is the fleet's side (:class:`_FleetJob`):

* before the lease: the store must still be the one the worker started on (its epoch);
* with the lease: the heartbeat thread (renew every TTL/3; from then on every commit and
  adapter write is guarded by it), the store clock every gating judgement reads, the
  run's metrics and log context;
* opening: the run document, verified with the checkpoint and bound to it;
* routing and controls: another host's run goes to that host's queue; a verified cancel
  request or rebaseline decision is found before the agent is loaded (a run whose agent
  cannot be imported can still be cancelled); the document's credentials must be in the
  worker's own map;
* building: the toolbox, the pinned contract of declared MCP servers, the adapter and
  the engine;
* stepping: approvals and review decisions waiting in the inbox are applied after the
  reconcile; a cancel request arriving mid-job is seen within a renewal interval; the
  first SIGTERM (:data:`STOP`) ends the job after its step;
* failures: a refusal's incident keeps its evidence (for an adapter that refused this
  lease's fence, the fence it was offered and the one it had seen, with the lease version
  and the high-water mark Redis reported); a job error counts against the run's budget
  (``max_job_errors``, an operator's retry starts it again) and is retried after a
  backoff, then the run is frozen with the reason visible.

Drills and tests attach to a job only through its hooks (:mod:`ratchet.worker.hooks`):
the executor hooks they return for the job see every effect, the heartbeat's renewals
pass through them, and they hear the job's milestones. In production there are none.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from ratchet.agents import Agent, AgentFactory, AgentStep, AgentView, build_agent, plans_ahead
from ratchet.errors import (
    IntegrityError,
    PeerAnswerTooLargeError,
    RatchetError,
    StoreEpochError,
)
from ratchet.fleet import logs, metrics
from ratchet.fleet.clock import StoreClock
from ratchet.fleet.context import Fleet
from ratchet.fleet.control import CancelRequest
from ratchet.fleet.identity import owner_id
from ratchet.fleet.mcp_servers import pin_live_contract
from ratchet.fleet.placement import home_of
from ratchet.fleet.runbuild import build_adapter, check_credentials, run_toolbox
from ratchet.fleet.runs import RunDocument, check_document_binding, open_document
from ratchet.leasing import LeasedRun
from ratchet.runtime import (
    Phase,
    RebaselineDecision,
    RunEngine,
)
from ratchet.runtime.decisions import decision_baseline
from ratchet.runtime.effects import Hooks as ExecutorHooks
from ratchet.runtime.window import restore_tail
from ratchet.worker.executor import Executor
from ratchet.worker.heartbeat import Heartbeat
from ratchet.worker.hooks import WorkerHooks
from ratchet.worker.inbox import (
    CancelWatch,
    cancel_run,
    consume_inbox,
    decision_waiting,
    find_job_controls,
)
from ratchet.worker.jobprotocol import (
    JobOutcome,
    JobReport,
    Opened,
    drive,
    lease_gone,
    open_window,
    release_lease,
    take_lease,
)
from ratchet.worker.observe import RunRecorder, job_ended

__all__ = ["STOP", "execute_run", "run_job"]

log = logging.getLogger("ratchet.worker.job")

#: Set when the worker is asked to stop (first SIGTERM): finish the current step, then
#: commit, release the lease for reaping and end the job.
STOP = threading.Event()


@dataclass
class _Process:
    """This worker process's fleet and hooks, set once by the pool."""

    fleet: Fleet | None = None
    hooks: WorkerHooks | None = None


_PROCESS = _Process()


def configure(fleet: Fleet, hooks: WorkerHooks | None = None) -> None:
    """Set this process's fleet and hooks (the pool calls it once per worker process;
    hooks only in drills and tests)."""
    _PROCESS.fleet = fleet
    _PROCESS.hooks = hooks


def run_job(run_id: str) -> dict[str, Any]:
    """The RQ entry point: ``{run_id}`` in, a JSON report out."""
    if _PROCESS.fleet is None:
        _PROCESS.fleet = Fleet.connect()
    return execute_run(_PROCESS.fleet, run_id, hooks=_PROCESS.hooks).as_dict()


def _owner(fleet: Fleet) -> str:
    return owner_id(fleet.settings.worker_name)


def execute_run(
    fleet: Fleet,
    run_id: str,
    *,
    owner: str | None = None,
    hooks: WorkerHooks | None = None,
) -> JobReport:
    """Run one job for ``run_id``. Never raises for outcomes a fleet expects.

    ``hooks`` (drills and tests only; see :mod:`ratchet.worker.hooks`) see the job's
    lease, every effect, every renewal and the job's milestones. Raises what they raise
    to end the job as if the worker had died, and unexpected errors.
    """
    report = _execute(fleet, run_id, owner=owner, hooks=hooks)
    job_ended(
        run_id,
        outcome=report.outcome,
        phase=report.phase,
        lease_version=report.lease_version,
        generation=report.generation,
        steps=report.steps,
    )
    if hooks is not None:
        hooks.event(
            "job_end",
            run_id=run_id,
            outcome=report.outcome,
            detail=report.detail,
            phase=report.phase,
            lease_version=report.lease_version,
            generation=report.generation,
        )
    return report


def _execute(
    fleet: Fleet, run_id: str, *, owner: str | None, hooks: WorkerHooks | None
) -> JobReport:
    settings = fleet.settings
    owner = owner or _owner(fleet)
    try:
        # The store must still be the one this worker started on: a wiped, restarted-
        # without-AOF or evicting Redis is never run on.
        fleet.store.identity.check_epoch(fleet.epoch)
    except StoreEpochError as exc:
        log.error(
            "store epoch check failed",
            extra={"run_id": run_id, "reason": str(exc.reason)},
        )
        return JobReport(run_id, JobOutcome.STORE_EPOCH_CHANGED, detail=exc.message)
    acquired_at = time.monotonic()
    report = JobReport(run_id, JobOutcome.LEASE_LOST)
    lease = take_lease(
        lambda: fleet.store.try_acquire(run_id, owner=owner, ttl_ms=settings.lease_ttl_ms),
        lambda record: fleet.store.records.record_incident(run_id, record),
        report,
    )
    if lease is None:
        return report
    recorder = RunRecorder(fleet.store, run_id, lease.lease_version, settings)
    recorder.lease_acquired(took_over=lease.took_over, previous=lease.previous)
    job_hooks = None
    if hooks is not None:
        held_by, version = lease.owner, lease.lease_version

        def lease_gone() -> bool:
            return not fleet.store.read_run(run_id).is_held_by(held_by, version)

        job_hooks = hooks.job(lease, lease_gone)

    # Gating judgements (approval expiry, budgets, deadlines) read the store's clock: an
    # upper bound anchored at the acquire's Redis time, tightened by every renewal.
    clock = StoreClock(lease.lease.now_ms, sent_at=acquired_at)

    def renew() -> int:
        sent_at = time.monotonic()
        renewed = lease.renew()
        clock.observe(renewed.now_ms, sent_at=sent_at)
        return renewed.expires_at_ms

    heartbeat = Heartbeat(
        renew,
        run_id=run_id,
        interval_ms=settings.renew_interval,
        stall_timeout_ms=settings.stall_timeout_ms,
        lease_ttl_ms=settings.lease_ttl_ms,
        acquired_at=acquired_at,
        hooks=hooks,
    ).start()
    host = _FleetJob(fleet, lease, heartbeat, recorder, clock, hooks, job_hooks, report)
    log_context = logs.enter_run(
        run_id, lease_version=lease.lease_version, generation=lease.generation
    )
    try:
        drive(host, report)
    finally:
        recorder.acknowledge_acquire()  # a job that ended before it routed or opened
        heartbeat.stop()
        logs.leave_run(log_context)
        host.close()
    return report


class _FleetJob:
    """The job protocol's host in a worker process (:class:`ratchet.worker.jobprotocol.JobHost`):
    the run document, the operator controls, the worker's credentials and tools, the
    heartbeat thread, metrics and incidents."""

    def __init__(
        self,
        fleet: Fleet,
        lease: LeasedRun,
        heartbeat: Heartbeat,
        recorder: RunRecorder,
        clock: StoreClock,
        hooks: WorkerHooks | None,
        job_hooks: ExecutorHooks | None,
        report: JobReport,
    ) -> None:
        self._fleet = fleet
        self._lease = lease
        self._heartbeat = heartbeat
        self._recorder = recorder
        self._clock = clock
        self._hooks = hooks
        self._job_hooks = job_hooks
        self._report = report
        self._run_id = lease.run_id
        self._document: RunDocument | None = None
        self._cancel: CancelRequest | None = None
        self._rebaseline: RebaselineDecision | None = None
        self._inbox: list[bytes] = []
        self._agent_factory: AgentFactory | None = None
        self._adapter: object | None = None
        self._restored_seq = 0
        self._watch = CancelWatch(fleet, lease.run_id)

    @property
    def lease(self) -> LeasedRun:
        return self._lease

    @property
    def guard(self) -> Heartbeat:
        return self._heartbeat

    @property
    def max_steps(self) -> int:
        return self._fleet.settings.max_steps_per_job

    def open(self) -> Opened:
        fleet = self._fleet
        # Under the lease: the restore's high-water check is answered by this same read.
        # Only the archive's last segments and the key digests: the restore reads the
        # window the checkpoint signs, not the run's whole history.
        snap = self._lease.read(
            with_checkpoint=True, with_scenario=True, archive_tail=restore_tail()
        )
        if snap.checkpoint is None or snap.scenario is None:
            raise IntegrityError("the run has no checkpoint or document", run_id=self._run_id)
        # Verify before use: the document's MAC and run id, the checkpoint's MAC and
        # schema, and that the checkpoint binds this very document, all before the
        # document's agent, environment or verifier commands are touched.
        self._document = open_document(fleet.keyring, self._run_id, snap.scenario)
        snap, opened = open_window(self._lease, snap, fleet.keyring)
        check_document_binding(opened.state, self._document)
        return Opened(snap, opened)

    def route(self, opened: Opened, report: JobReport) -> bool:
        fleet, settings, run_id = self._fleet, self._fleet.settings, self._run_id
        document = cast(RunDocument, self._document)
        # Where the run lives: its document's host, or the host a signed placement moved
        # it to (one that does not verify refuses the run, below).
        home, _ = home_of(fleet.keyring, fleet.store, run_id, document)
        if home is not None and home != settings.host:
            # Another host's run: its workspace is on that host's disk. Nothing of it is
            # built or observed here; it goes on to its host's queue. Not a fault: a
            # routing hint that was missing or wrong is all it says, and nothing is
            # recorded against the run (not even a takeover: its host's next worker reads
            # the run as this job found it).
            self._recorder.drop_acquire()
            release_lease(self)
            fleet.store.hosts.set_run_host(run_id, home)
            fleet.enqueue(run_id, host=home)
            metrics.JOBS_ROUTED.inc()
            report.outcome, report.detail = JobOutcome.ROUTED, f"to host {home}"
            return True
        self._recorder.acknowledge_acquire()
        # Operator controls come before the agent is loaded: a run whose agent cannot be
        # imported can still be cancelled (see ratchet.fleet.control).
        self._inbox = fleet.store.records.inbox(run_id)
        self._cancel, self._rebaseline = find_job_controls(
            fleet, run_id, self._inbox, opened.payload, document
        )
        if self._cancel is None:
            # Credentials are this worker's: every one the document names must be in its
            # own map, for the URL it would go to, before the agent is built or a server
            # contacted (a refusal freezes the run; nothing was sent).
            check_credentials(document, fleet.credentials)
            self._agent_factory = fleet.agent_policy.resolve(document.agent)
        return False

    def build(self, opened: Opened) -> RunEngine:
        fleet, settings, run_id = self._fleet, self._fleet.settings, self._run_id
        document = cast(RunDocument, self._document)
        state = opened.payload.state
        # A run under review whose environment a person changed meanwhile restores only
        # to consume a decision a reviewer signed for the environment as it is now: the
        # decision's own check (its version against the one observed) then decides;
        # nothing else can run in review.
        deciding = state.phase is Phase.NEEDS_REVIEW and decision_waiting(self._inbox, state)
        token = settings.http_token.get_secret_value() if settings.http_token else None
        toolbox = run_toolbox(
            document,
            credentials=fleet.credentials,
            servers=settings.mcp_servers,
            sandbox=fleet.sandbox,
            state_dir=settings.state_dir,
        )
        # A declared stdio server's live tools must be the ones the run pinned when its
        # first job listed them (pinned now if none is); see ratchet.fleet.mcp_servers.
        pin_live_contract(
            fleet.store,
            run_id,
            fleet.keyring,
            [t for t in toolbox if getattr(t, "bound_contract", None) is not None],
        )
        adapter = build_adapter(
            document,
            sandbox=fleet.sandbox,
            clock=self._clock,
            http_token=token,
            toolbox=toolbox,
            busy_timeout_s=settings.workspace_busy_timeout_ms / 1000,
            write_hook=self._hooks.write_stage if self._hooks is not None else None,
            recorded=state.environment,
            store=fleet.store,
            run_id=run_id,
            state_dir=settings.state_dir,
            credentials=fleet.credentials,
        )
        self._adapter = adapter
        executor = Executor(
            adapter,
            self._lease,
            hooks=self._job_hooks,
            guard=self._heartbeat,
            recorder=self._recorder,
            measure=True,
            run_id=run_id,
        )
        snap = opened.snapshot
        rebaseline = self._rebaseline
        engine = RunEngine.resume(
            cast(bytes, snap.checkpoint),
            scenario=document.scenario,
            keyring=fleet.keyring,
            executor=executor,
            clock=self._clock,
            approvers=fleet.approvers,
            reviewers=fleet.reviewers,
            lease_version=self._lease.lease_version,
            archive=snap.archive,
            archive_from=snap.archive_from,
            keys=snap.keys,
            opened=opened.payload,
            coalesce=settings.coalesce_commits,
            archive_trace=settings.archive_trace,
            store_epoch=fleet.epoch,
            tools=toolbox.catalog,
            accept_environment=(decision_baseline(rebaseline) if rebaseline is not None else None),
            tolerate_environment=self._cancel is not None or deciding,
        )
        if rebaseline is not None:
            # The restore accepted the environment only on this decision: it must apply,
            # or nothing runs on that environment.
            engine.apply_rebaseline(rebaseline)
        return engine

    def restore_failed(self) -> None:
        self._recorder.acknowledge_acquire()

    def restored(self, engine: RunEngine) -> None:
        self._restored_seq = engine.state.trace[-1].seq
        if self._hooks is not None:
            self._hooks.event(
                "restore", generation=engine.generation, phase=engine.state.phase.value
            )

    def before_steps(self, engine: RunEngine, report: JobReport) -> bool:
        if self._cancel is None and self._agent_factory is not None:
            return False
        cancel_run(engine, self._cancel)
        return True

    def reconciled(self, engine: RunEngine, window: str | None) -> None:
        if window is not None and engine.state.trace[-1].seq > 1:
            self._report.windows.append(window)
        self._heartbeat.progress()
        consume_inbox(self._fleet, engine, self._inbox)

    def agent(self) -> tuple[Agent, bool]:
        document = cast(RunDocument, self._document)
        factory = cast(AgentFactory, self._agent_factory)
        agent = build_agent(document.agent, factory, dict(document.agent_config))
        return agent, plans_ahead(agent)

    def stop_requested(self) -> bool:
        return STOP.is_set()

    def cancel_requested(self, engine: RunEngine, report: JobReport) -> bool:
        request = self._watch.poll()
        if request is None:
            return False
        cancel_run(engine, request)
        return True

    def next_step(self, agent: Agent, view: AgentView) -> AgentStep | None:
        try:
            return agent.next_step(view)
        except PeerAnswerTooLargeError as refusal:
            # The agent's model answered past the byte cap: nothing of the step was
            # committed; the job fails with it (job_error) and this says why.
            self._recorder.peer_answer_too_large(refusal, call="model", outcome="refused")
            raise

    def ended(self, engine: RunEngine) -> None:
        metrics.observe_trace(engine.state, since_seq=self._restored_seq)

    def lease_gone(self) -> bool:
        return lease_gone(self._fleet.store, self._lease)

    def record_refusal(self, kind: JobOutcome, reason: str, exc: RatchetError) -> None:
        lease = self._lease
        log.error(kind.value.replace("_", " "), extra={"run_id": lease.run_id, "reason": reason})
        record: dict[str, Any] = {
            "kind": kind.value,
            "reason": reason,
            "message": exc.message,
            "lease_version": lease.lease_version,
            "high_water": lease.generation,
        }
        # The evidence an operator (and a drill's checker) needs: what the adapter had
        # seen against what it was offered, or what the environment check compared.
        evidence = {name: exc.context[name] for name in _EVIDENCE if name in exc.context}
        if evidence:
            record["evidence"] = evidence
        self._fleet.store.records.record_incident(lease.run_id, record)

    def job_error(self, exc: Exception, report: JobReport) -> None:
        _job_error(self._fleet, self._lease, self._heartbeat, report, exc)

    def close(self) -> None:
        close = getattr(self._adapter, "close", None)
        if callable(close):
            close()


#: The fields of a refusal's error an incident keeps as its evidence.
_EVIDENCE = (
    "fence",
    "seen",
    "expected",
    "observed",
    "generation",
    "high_water",
    "expected_version",
    "observed_version",
    "fingerprint_changed",
)


def _where(exc: BaseException) -> str:
    frame = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    return f"{Path(frame[0].filename).name}:{frame[0].lineno} {frame[0].name}" if frame else ""


def _job_error(
    fleet: Fleet, lease: LeasedRun, heartbeat: Heartbeat, report: JobReport, exc: Exception
) -> None:
    """A failure that is not a lease or fence loss (an agent that raised, a factory that
    failed, an adapter refusing for good, a document too deep to parse): record it, give
    the lease up, and let the reaper hand the run on after a backoff, up to
    ``max_job_errors`` times; then the run is frozen with the reason visible.

    Poison runs stop: without this, the lease expired, the reaper re-enqueued and the job
    crashed again, forever."""
    settings = fleet.settings
    run_id = lease.run_id
    message = str(exc)[:500] or type(exc).__name__
    try:
        attempt = 1
        for incident in fleet.store.records.incidents(run_id):  # newest first
            if incident.get("kind") == "operator_retry":
                break  # an operator's retry starts the budget again
            attempt += incident.get("kind") == "job_error"
    except RatchetError:
        attempt = settings.max_job_errors
    frozen = attempt >= settings.max_job_errors
    record = {
        "kind": "job_error",
        "error": type(exc).__name__,
        "message": message,
        "where": _where(exc),
        "attempt": attempt,
        "lease_version": lease.lease_version,
        "next": "frozen: an operator acts" if frozen else "retried after a backoff",
    }
    log.error(
        "job failed",
        extra={"run_id": run_id, "error": type(exc).__name__, "outcome": record["next"]},
    )
    metrics.job_error(exc)
    with contextlib.suppress(RatchetError):
        fleet.store.records.record_incident(run_id, record)
    heartbeat.stop()
    with contextlib.suppress(RatchetError):
        lease.release()  # off the reaper's index
    if frozen:
        report.outcome, report.detail = JobOutcome.POISONED, f"{type(exc).__name__}: {message}"
        return
    backoff = settings.job_error_backoff_ms * 2 ** (attempt - 1)
    with contextlib.suppress(RatchetError):
        fleet.store.expiry.expect_pickup(run_id, within_ms=backoff)  # the reaper retries then
    report.outcome, report.detail = JobOutcome.JOB_ERROR, f"{type(exc).__name__}: {message}"
