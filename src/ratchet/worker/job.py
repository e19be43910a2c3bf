"""The RQ job: take a run's lease, restore it against Redis, reconcile, and step it.

RQ hands out work; ratchet's lease decides who owns a run. The job carries only the run
id (JSON). One job advances a run through as many steps as it can (RQ costs milliseconds
per job): until the run ends, waits for a human, the agent has nothing to propose, the
worker is asked to stop, or the lease is in doubt.

Order of a job, and why:

1. acquire the lease (compare-and-set on Redis time). Held by a live worker: end quietly;
2. start the heartbeat (renew every TTL/3); from now on every commit and adapter write is
   guarded by it;
3. read the run document and the checkpoint; a terminal run is released untouched;
4. ``RunEngine.resume``: verify the checkpoint, raise the adapter's fence to this lease,
   re-observe the environment, check the generation against Redis;
5. ``reconcile`` the pending write the previous owner may have left;
6. loop: agent proposes -> engine gates, commits the intent, calls the adapter with the
   fence, commits receipt and state. For an agent that plans ahead (no thinking between
   steps) the receipt commit is held and sent in one round trip with the next
   proposal's commit (``coalesce_commits``); otherwise it is sent before the agent is
   asked again;
7. end: any held commit is sent; terminal or waiting -> release (off the reaper's
   index); asked to stop or out of steps -> release for reaping (another worker continues
   at once); lease in doubt -> stop with no further effect (the lease expires and the
   reaper hands the run on); a retryable adapter failure -> stop renewing and let the
   lease expire (a natural back-off).

A restore that fails closed (tampered checkpoint, drifted environment, rolled-back store,
a run document or environment that cannot be built) is recorded as the run's incident, the
lease is released off the index and nothing runs: an operator has to look
(``ratchet show``). The incident keeps the evidence: for an adapter that refused this
lease's fence (it has seen a newer lease version than Redis now hands out: a rolled-back
or failed-over store) the fence it was offered and the one it had seen, with the lease
version and the high-water mark Redis reported. The run is frozen, never continued on the
rewound state. A high-water mark that could not be *read* (Redis unreachable during the
restore) is not such evidence: the job ends as ``lease_lost`` and the run is retried.

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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

from ratchet.agents import AgentFactory, AgentView, build_agent, plans_ahead
from ratchet.errors import (
    AdapterError,
    CheckpointError,
    ConfigurationError,
    ContractError,
    EnvironmentMismatchError,
    EvidenceError,
    FenceRejectedError,
    HighWaterUnavailableError,
    IntegrityError,
    InvalidTransitionError,
    LeaseLostError,
    PeerAnswerTooLargeError,
    RatchetError,
    ReplicationUnconfirmedError,
    ReviewDecisionError,
    RunNotFoundError,
    StoreEpochError,
    StoreError,
    StoreProtocolError,
)
from ratchet.fleet import logs, metrics
from ratchet.fleet.clock import StoreClock
from ratchet.fleet.context import Fleet
from ratchet.fleet.control import CancelRequest, find_controls, find_rebaseline
from ratchet.fleet.identity import owner_id
from ratchet.fleet.mcp_servers import pin_live_contract
from ratchet.fleet.placement import home_of
from ratchet.fleet.runs import (
    RunDocument,
    build_adapter,
    check_credentials,
    check_document_binding,
    open_document,
    parse_evidence,
    run_toolbox,
)
from ratchet.leasing import LeasedRun, LeaseHolder, RunSnapshot
from ratchet.runtime import (
    ApprovalEvidence,
    KeyRing,
    Phase,
    RebaselineDecision,
    ReviewDecision,
    RunEngine,
    RunState,
)
from ratchet.runtime.catalog import ToolCatalog
from ratchet.runtime.checkpoint import CheckpointPayload, open_checkpoint
from ratchet.runtime.outcomes import decision_baseline
from ratchet.runtime.state import TERMINAL_PHASES, ExecutedKeys
from ratchet.runtime.window import restore_tail
from ratchet.worker.executor import Executor
from ratchet.worker.heartbeat import Heartbeat
from ratchet.worker.hooks import WorkerHooks
from ratchet.worker.observe import RunRecorder, job_ended

__all__ = ["STOP", "JobReport", "agent_view", "execute_run", "run_job"]

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


@dataclass
class JobReport:
    run_id: str
    outcome: str  # held_elsewhere | terminal | waiting | finished | cancelled | yielded |
    #               lease_lost | retry_later | restore_refused | no_proposal | job_error |
    #               poisoned | no_run | store_refused | store_epoch_changed | routed
    phase: str | None = None
    lease_version: int | None = None
    generation: int | None = None
    steps: int = 0
    detail: str = ""
    windows: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


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
        fleet.store.check_epoch(fleet.epoch)
    except StoreEpochError as exc:
        log.error(
            "store epoch check failed",
            extra={"run_id": run_id, "reason": str(exc.context["reason"])},
        )
        return JobReport(run_id, "store_epoch_changed", detail=exc.message)
    acquired_at = time.monotonic()
    try:
        got = fleet.store.try_acquire(run_id, owner=owner, ttl_ms=settings.lease_ttl_ms)
    except RunNotFoundError:
        # An index or queue entry only says "look at run X"; there is no such run.
        return JobReport(run_id, "no_run", detail="no run with this id")
    except ReplicationUnconfirmedError:
        # Taken on the primary, not confirmed by the replicas the fleet asks for: what
        # it would restore may not survive a failover. Not used; the lease expires and
        # the reaper hands the run on.
        return JobReport(run_id, "lease_lost", detail="store: ReplicationUnconfirmedError")
    except StoreProtocolError as exc:
        # The run's lease or state record is not what the scripts wrote (corrupted or
        # rewritten): nothing of it is used. Recorded for an operator where possible.
        log.error("run records unreadable", extra={"run_id": run_id, "reason": exc.message})
        with contextlib.suppress(RatchetError):
            fleet.store.record_incident(
                run_id,
                {
                    "kind": "store_record_unreadable",
                    "reason": "lease_or_state",
                    "message": exc.message,
                },
            )
        return JobReport(run_id, "store_refused", detail=exc.message)
    if isinstance(got, LeaseHolder):
        return JobReport(run_id, "held_elsewhere", detail=f"held by {got.owner}")
    lease: LeasedRun = got
    recorder = RunRecorder(fleet.store, run_id, lease.lease_version, settings)
    recorder.lease_acquired(took_over=lease.took_over, previous=lease.previous)
    report = JobReport(run_id, "lease_lost", lease_version=lease.lease_version)
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
    adapter = None
    log_context = logs.enter_run(
        run_id, lease_version=lease.lease_version, generation=lease.generation
    )
    try:
        # Under the lease: the restore's high-water check is answered by this same read.
        # Only the archive's last segments and the key digests: the restore reads the
        # window the checkpoint signs, not the run's whole history.
        snap = lease.read(with_checkpoint=True, with_scenario=True, archive_tail=restore_tail())
        try:
            if snap.checkpoint is None or snap.scenario is None:
                raise IntegrityError("the run has no checkpoint or document", run_id=run_id)
            # Verify before use: the document's MAC and run id, the checkpoint's MAC and
            # schema, and that the checkpoint binds this very document, all before the
            # document's agent, environment or verifier commands are touched.
            document = open_document(fleet.keyring, run_id, snap.scenario)
            snap, opened = open_window(lease, snap, fleet.keyring)
            check_document_binding(opened.state, document)
            if opened.state.phase in TERMINAL_PHASES and opened.generation == snap.generation:
                _release(lease, heartbeat)  # nothing more to do, nothing of it is built
                report.outcome, report.phase = "terminal", opened.state.phase.value
                report.generation = opened.generation
                return report
            # Where the run lives: its document's host, or the host a signed placement
            # moved it to (one that does not verify refuses the run, below).
            home, _ = home_of(fleet.keyring, fleet.store, run_id, document)
            if home is not None and home != settings.host:
                # Another host's run: its workspace is on that host's disk. Nothing of it
                # is built or observed here; it goes on to its host's queue. Not a fault:
                # a routing hint that was missing or wrong is all it says, and nothing
                # is recorded against the run (not even a takeover: its host's next
                # worker reads the run as this job found it).
                recorder.drop_acquire()
                _release(lease, heartbeat)
                fleet.store.set_run_host(run_id, home)
                fleet.enqueue(run_id, host=home)
                metrics.JOBS_ROUTED.inc()
                report.outcome, report.detail = "routed", f"to host {home}"
                report.generation = opened.generation
                return report
            recorder.acknowledge_acquire()
            # Operator controls come before the agent is loaded: a run whose agent cannot
            # be imported can still be cancelled (see ratchet.fleet.control).
            inbox = fleet.store.inbox(run_id)
            cancel, rebaseline = _controls(fleet, run_id, inbox, opened, document)
            if cancel is None:
                # Credentials are this worker's: every one the document names must be in
                # its own map, for the URL it would go to, before the agent is built or
                # a server contacted (a refusal freezes the run; nothing was sent).
                check_credentials(document, fleet.credentials)
            agent_factory = fleet.agent_policy.resolve(document.agent) if cancel is None else None
            # A run under review whose environment a person changed meanwhile restores
            # only to consume a decision a reviewer signed for the environment as it is
            # now: the decision's own check (its version against the one observed) then
            # decides; nothing else can run in review.
            deciding = opened.state.phase is Phase.NEEDS_REVIEW and _decision_waiting(
                inbox, opened.state
            )
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
                clock=clock,
                http_token=token,
                toolbox=toolbox,
                busy_timeout_s=settings.workspace_busy_timeout_ms / 1000,
                write_hook=hooks.write_stage if hooks is not None else None,
                recorded=opened.state.environment,
                store=fleet.store,
                run_id=run_id,
                state_dir=settings.state_dir,
                credentials=fleet.credentials,
            )
            executor = Executor(
                adapter,
                lease,
                hooks=job_hooks,
                guard=heartbeat,
                recorder=recorder,
                measure=True,
                run_id=run_id,
            )
            engine = RunEngine.resume(
                cast(bytes, snap.checkpoint),
                scenario=document.scenario,
                keyring=fleet.keyring,
                executor=executor,
                clock=clock,
                approvers=fleet.approvers,
                reviewers=fleet.reviewers,
                lease_version=lease.lease_version,
                archive=snap.archive,
                archive_from=snap.archive_from,
                keys=snap.keys,
                opened=opened,
                coalesce=settings.coalesce_commits,
                archive_trace=settings.archive_trace,
                store_epoch=fleet.epoch,
                tools=toolbox.catalog,
                accept_environment=(
                    decision_baseline(rebaseline) if rebaseline is not None else None
                ),
                tolerate_environment=cancel is not None or deciding,
            )
            if rebaseline is not None:
                # The restore accepted the environment only on this decision: it must
                # apply, or nothing runs on that environment.
                engine.apply_rebaseline(rebaseline)
        except IntegrityError as exc:
            recorder.acknowledge_acquire()
            if isinstance(exc.__context__, HighWaterUnavailableError) and (
                exc.__context__.context.get("cause") == "StoreUnavailableError"
            ):
                # Redis could not be read mid-restore: no evidence of anything; retry.
                report.outcome, report.detail = "lease_lost", "store: high water unreadable"
                return report
            _refuse(fleet, lease, heartbeat, report, exc)
            return report
        except (FenceRejectedError, ConfigurationError, ContractError, ReviewDecisionError) as exc:
            # Failing closed: nothing about this run can be trusted or built as it is.
            # Retrying would fail the same way, so it leaves the reaper's index.
            recorder.acknowledge_acquire()
            _refuse(fleet, lease, heartbeat, report, exc)
            return report
        except AdapterError as exc:
            recorder.acknowledge_acquire()
            if exc.context.get("retryable"):
                raise
            _refuse(fleet, lease, heartbeat, report, exc)
            return report
        if engine.state.phase in TERMINAL_PHASES:
            _release(lease, heartbeat)
            report.outcome, report.phase = "terminal", engine.state.phase.value
            report.generation = engine.generation
            return report
        restored_seq = engine.state.trace[-1].seq
        if hooks is not None:
            hooks.event("restore", generation=engine.generation, phase=engine.state.phase.value)
        if cancel is not None or agent_factory is None:
            _cancel(engine, cancel, report)
        else:
            recovered = engine.reconcile()
            if recovered.window is not None and engine.state.trace[-1].seq > 1:
                report.windows.append(recovered.window.value)
            heartbeat.progress()
            _consume_inbox(fleet, engine, inbox)
            _step(fleet, engine, document, agent_factory, heartbeat, report, recorder)
        report.phase, report.generation = engine.state.phase.value, engine.generation
        metrics.observe_trace(engine.state, since_seq=restored_seq)
        _finish(lease, heartbeat, engine, report)
    except (LeaseLostError, FenceRejectedError) as exc:
        # No further commit or adapter call: the lease expires, the reaper hands it on.
        report.outcome, report.detail = "lease_lost", type(exc).__name__
    except EnvironmentMismatchError as exc:
        # The environment is not what the signed state says it should be (edited behind
        # the run, or a write's result that cannot be explained). Nothing more is sent;
        # a restore would refuse it the same way, so the run leaves the index with the
        # reason recorded, for an operator.
        _refuse(fleet, lease, heartbeat, report, exc, kind="environment_changed")
    except AdapterError as exc:
        if exc.context.get("retryable"):
            report.outcome, report.detail = "retry_later", exc.message
        else:
            _job_error(fleet, lease, heartbeat, report, exc)
    except StoreError as exc:
        report.outcome, report.detail = "lease_lost", f"store: {type(exc).__name__}"
    except Exception as exc:
        _job_error(fleet, lease, heartbeat, report, exc)
    finally:
        recorder.acknowledge_acquire()  # a job that ended before it routed or opened
        heartbeat.stop()
        logs.leave_run(log_context)
        if adapter is not None:
            close = getattr(adapter, "close", None)
            if callable(close):
                close()
    return report


def _controls(
    fleet: Fleet, run_id: str, inbox: list[bytes], opened: CheckpointPayload, document: RunDocument
) -> tuple[CancelRequest | None, RebaselineDecision | None]:
    """The operator controls waiting in the inbox for the opened (not yet restored) run:
    a verified cancel request (not for a run under review: a reviewer decides it; the
    request stays and applies once the run leaves review), else a rebaseline decision
    that passed every check the adapter is not needed for. Entries that did not verify
    are recorded as incidents and never acted on."""
    controls = find_controls(fleet.keyring, run_id, inbox)
    refusals = [("control_refused", reason) for reason in controls.refused]
    cancel = controls.cancel if opened.state.phase is not Phase.NEEDS_REVIEW else None
    rebaseline = None
    if cancel is None:
        rebaseline, refused = find_rebaseline(
            inbox, opened.state, document.scenario, fleet.reviewers, generation=opened.generation
        )
        refusals += [("evidence_refused", reason) for reason in refused]
    for kind, reason in refusals:
        with contextlib.suppress(RatchetError):
            fleet.store.record_incident(run_id, {"kind": kind, "message": reason[:500]})
    return cancel, rebaseline


def _decision_waiting(inbox: list[bytes], state: RunState) -> bool:
    """Whether the inbox holds a reviewer decision on the open case not yet consumed."""
    case = state.review
    for raw in inbox:
        evidence = parse_evidence(raw)
        if (
            isinstance(evidence, ReviewDecision)
            and case is not None
            and evidence.claims.case_id == case.case_id
            and evidence.claims.nonce not in state.consumed_nonces
        ):
            return True
    return False


def _cancel(engine: RunEngine, request: CancelRequest | None, report: JobReport) -> None:
    """Carry out an operator's verified cancel request (see ratchet.fleet.control)."""
    if request is None:
        raise InvalidTransitionError("a cancel needs a request")
    engine.cancel(request.reason, by=request.by, request_id=request.request_id)
    report.outcome = "cancelled" if engine.state.phase is Phase.CANCELLED else "waiting"


def _consume_inbox(fleet: Fleet, engine: RunEngine, inbox: list[bytes]) -> None:
    """Apply signed evidence an operator left for a waiting run (approve / review).

    Each piece is verified by the engine (trust root, signature, bindings, nonce, expiry,
    fresh receipt and environment); refused evidence changes nothing and is recorded as
    an incident for the operator.
    """
    run_id = engine.state.run_id
    for raw in inbox:
        phase = engine.state.phase
        if phase not in (Phase.AWAITING_APPROVAL, Phase.NEEDS_REVIEW):
            return
        evidence = parse_evidence(raw)
        try:
            if isinstance(evidence, ApprovalEvidence) and phase is Phase.AWAITING_APPROVAL:
                if evidence.claims.nonce in engine.state.consumed_nonces:
                    continue
                engine.refresh_pending_approval(evidence)
            elif isinstance(evidence, ReviewDecision) and phase is Phase.NEEDS_REVIEW:
                if evidence.claims.nonce in engine.state.consumed_nonces:
                    continue
                engine.apply_review_decision(evidence)
        except (EvidenceError, ConfigurationError) as exc:
            fleet.store.record_incident(
                run_id,
                {
                    "kind": "evidence_refused",
                    "reason": str(getattr(exc, "reason", "")),
                    "message": exc.message,
                },
            )


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


def _step(
    fleet: Fleet,
    engine: RunEngine,
    document: RunDocument,
    agent_factory: AgentFactory,
    heartbeat: Heartbeat,
    report: JobReport,
    recorder: RunRecorder,
) -> None:
    agent = build_agent(document.agent, agent_factory, dict(document.agent_config))
    coalesce = plans_ahead(agent)
    last_read: str | None = None
    watch = _CancelWatch(fleet, engine.state.run_id)
    for _ in range(fleet.settings.max_steps_per_job):
        if engine.state.phase is not Phase.RUNNING:
            return
        if STOP.is_set():
            report.outcome = "yielded"
            return
        heartbeat.check()
        request = watch.poll()
        if request is not None:  # an operator asked: stop at this safe point
            _cancel(engine, request, report)
            return
        try:
            step = agent.next_step(agent_view(engine, last_read))
        except PeerAnswerTooLargeError as refusal:
            # The agent's model answered past the byte cap: nothing of the step was
            # committed; the job fails with it (job_error) and this says why.
            recorder.peer_answer_too_large(refusal, call="model", outcome="refused")
            raise
        if step is None:
            report.outcome = "no_proposal"
            return
        result = engine.propose(step.action, agent_state=step.agent_state)
        if not coalesce:
            engine.flush()  # durable before the agent thinks; see Agent.plans_ahead
        last_read = result.read.content if result.read is not None else None
        report.steps += 1
        heartbeat.progress()
    report.outcome = "yielded"


class _CancelWatch:
    """Re-reads the run's inbox for a cancel request at most once per renewal interval,
    so a run a worker is stepping stops within about one interval of the request, at a
    cost that does not grow with the step rate."""

    def __init__(self, fleet: Fleet, run_id: str) -> None:
        self._fleet = fleet
        self._run_id = run_id
        self._every = fleet.settings.renew_interval / 1000
        self._next = time.monotonic() + self._every

    def poll(self) -> CancelRequest | None:
        now = time.monotonic()
        if now < self._next:
            return None
        self._next = now + self._every
        inbox = self._fleet.store.inbox(self._run_id)
        return find_controls(self._fleet.keyring, self._run_id, inbox).cancel


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
        if exc.context.get("reason") != "archive_short":
            raise
        snap = lease.read(with_checkpoint=True, with_scenario=snap.scenario is not None)
        opened = open_checkpoint(
            cast(bytes, snap.checkpoint), keyring=keyring, archive=snap.archive, windowed=True
        )
    return snap, opened


def _release(
    lease: LeasedRun, heartbeat: Heartbeat, *, reap: bool = False, flush: RunEngine | None = None
) -> None:
    """Stop the heartbeat, then give the lease up; with ``flush``, the engine's held commit
    goes first and carries the release in the same round trip.

    A renewal still in flight when the lease is released would be refused and reported as
    a lost lease; stopping (and joining) the heartbeat first rules that out.
    """
    heartbeat.stop()
    if flush is not None and flush.held_commits:
        lease.release_with_next_commit(reap=reap)
        flush.flush()
    lease.release(reap=reap)


def _finish(lease: LeasedRun, heartbeat: Heartbeat, engine: RunEngine, report: JobReport) -> None:
    # The engine's state already includes any held commit: decide, then send that commit
    # with the release (a held receipt commit goes out before the lease does).
    phase = engine.state.phase
    if phase in TERMINAL_PHASES:
        report.outcome = "cancelled" if phase is Phase.CANCELLED else "finished"
        reap = False
    elif phase in (Phase.AWAITING_APPROVAL, Phase.NEEDS_REVIEW):
        report.outcome, reap = "waiting", False  # approve / review re-enqueue it
    elif report.outcome == "no_proposal":
        reap = False  # the agent is done proposing but the run is not: an operator looks
    else:
        report.outcome, reap = "yielded", True  # another worker continues at once
    _release(lease, heartbeat, reap=reap, flush=engine)
    report.generation = engine.generation


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
        for incident in fleet.store.incidents(run_id):  # newest first
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
        fleet.store.record_incident(run_id, record)
    with contextlib.suppress(RatchetError):
        _release(lease, heartbeat)  # off the reaper's index
    if frozen:
        report.outcome, report.detail = "poisoned", f"{type(exc).__name__}: {message}"
        return
    backoff = settings.job_error_backoff_ms * 2 ** (attempt - 1)
    with contextlib.suppress(RatchetError):
        fleet.store.expect_pickup(run_id, within_ms=backoff)  # the reaper retries then
    report.outcome, report.detail = "job_error", f"{type(exc).__name__}: {message}"


def _lease_gone(fleet: Fleet, lease: LeasedRun) -> bool:
    """Whether the store (on its own clock) says this job's lease is no longer the live
    one: expired, or taken over. A store that cannot be read says nothing either way;
    the job then ends as if its lease were lost and the run is tried again."""
    try:
        snap = fleet.store.read_run(lease.run_id)
    except StoreError:
        return True
    return not snap.is_held_by(lease.owner, lease.lease_version)


def _refuse(
    fleet: Fleet,
    lease: LeasedRun,
    heartbeat: Heartbeat,
    report: JobReport,
    exc: RatchetError,
    *,
    kind: str = "restore_refused",
) -> None:
    """A restore (or a step) failed closed: record why, take the run off the index, run
    nothing more.

    Unless the lease is no longer this job's: a job paused or stalled past its lease
    judges a run its new owner has moved on (a newer fence at the adapters, an
    environment one step ahead of the checkpoint it read). That is a lost lease, not a
    run to freeze: no incident. Nothing is lost by it: a run really broken refuses its
    next restore the same way, under a live lease, and is frozen then."""
    if _lease_gone(fleet, lease):
        report.outcome, report.detail = "lease_lost", type(exc).__name__
        return
    reason = str(getattr(exc, "reason", "") or type(exc).__name__)
    report.outcome, report.detail = kind, f"{reason}: {exc.message}"
    log.error(kind.replace("_", " "), extra={"run_id": lease.run_id, "reason": reason})
    record: dict[str, Any] = {
        "kind": kind,
        "reason": reason,
        "message": exc.message,
        "lease_version": lease.lease_version,
        "high_water": lease.generation,
    }
    # The evidence an operator (and a drill's checker) needs: what the adapter had seen
    # against what it was offered, or what the environment check compared.
    evidence = {
        name: exc.context[name]
        for name in (
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
        if name in exc.context
    }
    if evidence:
        record["evidence"] = evidence
    try:
        fleet.store.record_incident(lease.run_id, record)
    finally:
        _release(lease, heartbeat)
