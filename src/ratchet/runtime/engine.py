"""The engine: drives one run through the state machine, performing no effect itself.

The engine is the only place where the order of commits and adapter calls is decided
(its human controls, carried out by :mod:`ratchet.runtime.interventions`, commit through
it too). It performs none of them: each operation is a generator that yields effects
(:mod:`ratchet.runtime.effects`: observe, project, raise the fence, execute, look a key
up, read, verify, read the high-water mark, load, commit a batch) and takes their results
back. The executor it is given performs them (in a worker, with the lease guard, metrics
and hooks; in a unit test, against in-memory ports), so the same engine runs in-memory in
unit tests and on Redis with real adapters in a worker. Time is an argument too: the
clock it is given (the store's, in a worker).

One write, end to end: two fenced, signed commits::

    propose ──▶ commit pending intent (gen g+1) ──▶ adapter.execute(key, fence) ──▶
    observe ──▶ commit receipt + advanced state (gen g+2)

Each arrow is a place a worker can die; :class:`CrashWindow` names them and
:meth:`RunEngine.reconcile` is the recovery for each (timeline comments there). The
engine yields a ``Reached(window)`` effect at every window, so tests and drills can
inject a crash there through the executor's hooks.

Coalesced commits (``coalesce=True``): the receipt + state commit that ends a write is
sealed at once but *held*, then sent in the same round trip as the run's next commit
(usually the next write's pending intent) or at :meth:`RunEngine.flush`. Both stay
separate fenced, signed commits at consecutive generations; on Redis they travel in one
call of the commit script, so one AOF ``fsync`` covers both. Nothing reaches an adapter
while a commit is held (every adapter write follows a commit, which sends the held one
first), so a worker that dies with a held commit is in ``AFTER_ADAPTER_BEFORE_RECEIPT``,
and :meth:`RunEngine.reconcile` settles it by the adapter's receipt as usual. The durable
checkpoint lags one commit behind while a commit is held: a caller that is about to wait
(for a model, a human, a release of the lease) calls :meth:`RunEngine.flush` first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from ratchet.errors import (
    AdapterError,
    CommitOutcomeUnknownError,
    EnvironmentMismatchError,
    FenceRejectedError,
    HighWaterUnavailableError,
    IdempotencyConflictError,
    InvalidTransitionError,
    InvariantViolation,
    OutcomeUnknownError,
    ReplicationUnconfirmedError,
)
from ratchet.runtime import effects, interventions, machine, outcomes
from ratchet.runtime.actions import Action
from ratchet.runtime.archive import ArchiveRef, empty_archive, recall_executed, window_for
from ratchet.runtime.catalog import ToolSpec
from ratchet.runtime.checkpoint import (
    DEFAULT_MAX_CHECKPOINT_BYTES,
    CheckpointPayload,
    run_key,
    seal_checkpoint,
    seal_split,
)
from ratchet.runtime.effects import (
    Commit,
    CrashWindow,
    Execute,
    HighWater,
    Load,
    Lookup,
    Observe,
    Op,
    Performer,
    Project,
    RaiseFence,
    Reached,
    Read,
    Verify,
    drive,
)
from ratchet.runtime.evidence import (
    ApprovalEvidence,
    RebaselineDecision,
    ReviewDecision,
    TrustRoots,
)
from ratchet.runtime.machine import Disposition
from ratchet.runtime.ports import (
    Advance,
    Clock,
    Fence,
    Observation,
    ReadResult,
    Receipt,
    Release,
    RunKey,
    StoredCheckpoint,
    VerifierReport,
)
from ratchet.runtime.restore import (
    check_fresh,
    finish_restore,
    high_water_missing,
    open_for_restore,
)
from ratchet.runtime.scenario import Scenario
from ratchet.runtime.signing import KeyRing
from ratchet.runtime.state import (
    TERMINAL_PHASES,
    Phase,
    ReviewReason,
    RunState,
    TraceOutcome,
)
from ratchet.runtime.window import ArchiveWindow, NotInWindow, key_digests

__all__ = ["Probe", "RunEngine", "StepResult"]

_T = TypeVar("_T")

# A test's or drill's callback for the crash windows (see ratchet.worker.executor).
Probe = Callable[[CrashWindow], None]


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one engine call led to: the last trace outcome and the phase after it."""

    outcome: TraceOutcome
    phase: Phase
    generation: int
    window: CrashWindow | None = None
    read: ReadResult | None = None  # what a read-only action returned (not persisted)


class RunEngine:
    """Drives one run. Construct with :meth:`start` or :meth:`resume`, never directly."""

    def __init__(
        self,
        *,
        scenario: Scenario,
        keyring: KeyRing,
        executor: Performer,
        clock: Clock,
        state: RunState,
        generation: int,
        blob: bytes,
        approvers: TrustRoots | None = None,
        reviewers: TrustRoots | None = None,
        lease_version: int = 1,
        max_checkpoint_bytes: int = DEFAULT_MAX_CHECKPOINT_BYTES,
        coalesce: bool = False,
        archive_trace: bool = False,
        archive: ArchiveRef | None = None,
        store_epoch: str | None = None,
        tools: Mapping[str, ToolSpec] | None = None,
    ) -> None:
        self.scenario = scenario
        # The declared tools' contracts (None: the built-in kinds only).
        self.tools = tools
        self.executor = executor
        self.clock = clock
        self.approvers = approvers
        self.reviewers = reviewers
        self.lease_version = lease_version
        self.store_epoch = store_epoch
        self._keyring = keyring
        self._max_bytes = max_checkpoint_bytes
        self._coalesce = coalesce
        self._held: list[Advance] = []  # sealed commits not sent yet (coalesce only)
        # What the run's archive holds (None: the checkpoint carries its whole trace).
        # A checkpoint that names an archive keeps one; archive_trace starts one.
        self._archive = (
            archive
            if archive is not None
            else (empty_archive(state.run_id) if archive_trace else None)
        )
        # The engine's memory of the state's window over the archive (its key set, the
        # points the window may move to), kept with the archive reference it belongs to.
        self._window: ArchiveWindow | None = None
        if self._archive is not None:
            self._window = window_for(state, self._archive)
            state = state.with_keys(self._window.keys)
        # The last commit the store acknowledged, with the archive the next commit extends.
        self._durable = (state, generation, blob, self._archive, self._window)
        self.state = state
        self.generation = generation
        self.checkpoint = blob
        self.observed_at_restore: Observation | None = None
        self.environment_refused: Exception | None = None

    def __repr__(self) -> str:
        return (
            f"RunEngine(run_id={self.state.run_id!r}, phase={self.state.phase.value!r}, "
            f"generation={self.generation})"
        )

    # -- construction ------------------------------------------------------------------

    @classmethod
    def start(
        cls,
        run_id: str,
        *,
        scenario: Scenario,
        keyring: KeyRing,
        executor: Performer,
        clock: Clock,
        **options: Any,
    ) -> RunEngine:
        """Observe the environment, build the first state and commit it as generation 1.

        ``document_digest`` (an option) binds the run's signed document into the state.
        """
        observed = drive(effects.observe(), executor)
        state = machine.new_run(
            run_id,
            scenario,
            observed,
            clock.now(),
            document_digest=options.pop("document_digest", None),
        )
        max_bytes = options.get("max_checkpoint_bytes", DEFAULT_MAX_CHECKPOINT_BYTES)
        archive: ArchiveRef | None = None
        if options.pop("archive_trace", False):
            sealed = seal_split(
                state,
                scenario,
                keyring,
                generation=1,
                archived=empty_archive(run_id),
                max_bytes=max_bytes,
            )
            blob, archive = sealed.blob, sealed.archive
            first = Advance(0, blob, segment=sealed.segment, keys=sealed.keys)
        else:
            blob = seal_checkpoint(state, scenario, keyring, generation=1, max_bytes=max_bytes)
            first = Advance(0, blob)
        drive(effects.commit(run_key(state), (first,)), executor)
        return cls(
            scenario=scenario,
            keyring=keyring,
            executor=executor,
            clock=clock,
            state=state,
            generation=1,
            blob=blob,
            archive=archive,
            **options,
        )

    @classmethod
    def resume(
        cls,
        blob: bytes,
        *,
        scenario: Scenario,
        keyring: KeyRing,
        executor: Performer,
        clock: Clock,
        approvers: TrustRoots | None = None,
        reviewers: TrustRoots | None = None,
        lease_version: int = 1,
        archive: Sequence[bytes] = (),
        opened: CheckpointPayload | None = None,
        accept_environment: Observation | None = None,
        tolerate_environment: bool = False,
        archive_from: int = 0,
        keys: bytes | None = None,
        **options: Any,
    ) -> RunEngine:
        """Restore a checkpoint (every check of :func:`restore_checkpoint`), then raise
        the adapter's fence to this lease and observe the environment.

        ``archive`` is the run's archive segments as the store returned them with ``blob``
        (``archive_from``: the index of the first one, when only the last ones were read),
        and ``keys`` the run's executed-key digests (None: made from the whole archive).
        The state restored is the window the checkpoint signs (see
        :func:`~ratchet.runtime.restore.open_checkpoint`). ``opened`` is
        ``open_checkpoint(blob, archive=archive, windowed=True, ...)`` when the caller made
        it already (to check the run document against it before building the adapter).

        The fence goes up before the observation that restore compares, so from then on a
        previous owner that is still running can no longer land a write we have not seen.
        Call :meth:`reconcile` next.

        ``accept_environment`` and ``tolerate_environment`` relax the environment check for
        a verified rebaseline decision and for an operator's cancel (see
        :func:`restore_checkpoint`); the refusal a tolerated check made is kept in
        :attr:`environment_refused`, and the observation in :attr:`observed_at_restore`.
        """
        payload = open_for_restore(
            blob,
            scenario=scenario,
            keyring=keyring,
            archive=archive,
            opened=opened,
            windowed=True,
            archive_from=archive_from,
            keys=keys,
        )
        state = payload.state

        def restore() -> Op[Observation]:
            # Authentic and bound to this scenario; now fresh (the high-water mark), then
            # the fence, then the environment as it is behind the fence.
            try:
                high_water = cast(int, (yield HighWater(run_key(state))))
            except HighWaterUnavailableError as exc:
                raise high_water_missing(exc) from None
            check_fresh(payload, high_water)
            yield RaiseFence(
                Fence(
                    run_id=state.run_id,
                    lease_version=lease_version,
                    state_version=payload.generation,
                    store_epoch=options.get("store_epoch"),
                )
            )
            return cast(Observation, (yield Observe()))

        observed = drive(restore(), executor)
        restored = finish_restore(
            payload,
            blob,
            observed,
            approvers=approvers,
            reviewers=reviewers,
            accept_environment=accept_environment,
            tolerate_environment=tolerate_environment,
        )
        engine = cls(
            scenario=scenario,
            keyring=keyring,
            executor=executor,
            clock=clock,
            state=restored.state,
            generation=restored.generation,
            blob=restored.blob,
            approvers=approvers,
            reviewers=reviewers,
            lease_version=lease_version,
            archive=restored.archive,
            **options,
        )
        engine.observed_at_restore = restored.observed
        engine.environment_refused = restored.environment_refused
        return engine

    def _drive(self, op: Op[_T]) -> _T:
        return drive(op, self.executor)

    # -- commits -------------------------------------------------------------------------

    @property
    def key(self) -> RunKey:
        return run_key(self.state)

    def _fence(self) -> Fence:
        return Fence(
            run_id=self.state.run_id,
            lease_version=self.lease_version,
            state_version=self.generation,
            store_epoch=self.store_epoch,
        )

    @property
    def held_commits(self) -> int:
        """How many sealed commits wait to be sent with the next commit or :meth:`flush`."""
        return len(self._held)

    @property
    def durable_generation(self) -> int:
        """The generation the store last acknowledged (``generation`` minus held ones)."""
        return self._durable[1]

    def flush(self, *, release: Release | None = None) -> bool:
        """Send every held commit now (one round trip). A no-op when nothing is held.

        ``release`` travels with the commits: the store gives the lease up in the same
        call, once every one applied (a worker's last commit of a job). Returns whether
        anything was sent (with nothing held, nothing is released either).

        Raises what the store's commit raises; the engine then stands at the last
        acknowledged commit (see :meth:`_send`).
        """
        if not self._held:
            return False
        self._drive(self._flush(release))
        return True

    def _flush(self, release: Release | None = None) -> Op[None]:
        if self._held:
            yield from self._send(
                list(self._held),
                self.state,
                self.generation,
                self.checkpoint,
                self._archive,
                self._window,
                release=release,
            )

    def _commit(self, new: RunState, *, hold: bool = False) -> Op[None]:
        """Validate, sign and commit ``new`` as the next generation, consuming new nonces.

        With ``hold`` (and ``coalesce``), the sealed commit is kept to travel with the next
        one instead of being sent now; otherwise it is sent together with any held ones.
        """
        known = set(self.state.consumed_nonces)
        nonces = tuple(n for n in new.consumed_nonces if n not in known)
        target = self.generation + 1
        archive, window = self._archive, self._window
        not_after = machine.approval_deadline_ms(new, self.scenario)
        if archive is None:
            blob = seal_checkpoint(
                new,
                self.scenario,
                self._keyring,
                generation=target,
                max_bytes=self._max_bytes,
                previous=self.state,
            )
            commit = Advance(
                self.generation, blob, nonces, not_after_ms=not_after, phase=new.phase.value
            )
        else:
            sealed = seal_split(
                new,
                self.scenario,
                self._keyring,
                generation=target,
                archived=archive,
                max_bytes=self._max_bytes,
                previous=self.state,
                window=window,
            )
            blob, archive, window = sealed.blob, sealed.archive, sealed.window
            new = cast(RunState, sealed.state)  # its window may have moved on
            commit = Advance(
                self.generation,
                blob,
                nonces,
                sealed.segment,
                not_after,
                new.phase.value,
                sealed.keys,
            )
        if hold and self._coalesce:
            self._held.append(commit)
            self.state, self.generation, self.checkpoint = new, target, blob
            self._archive, self._window = archive, window
            return
        yield from self._send([*self._held, commit], new, target, blob, archive, window)

    def _send(
        self,
        batch: list[Advance],
        new: RunState,
        target: int,
        blob: bytes,
        archive: ArchiveRef | None,
        window: ArchiveWindow | None,
        *,
        release: Release | None = None,
    ) -> Op[None]:
        """Send ``batch`` (held commits, then the one that ends in ``new``) and adopt it.

        Timeline of a lost reply (CrashWindow.COMMIT_REPLY_LOST): the store may or may not
        have applied the commits. Re-read it; only our exact last blob at our last
        generation counts as applied. Anything else propagates: never assume. On any
        failure the engine falls back to the last acknowledged commit, so it never claims
        a state the store may not hold.
        """
        self._held = []
        try:
            try:
                yield Commit(self.key, tuple(batch), release)
            except ReplicationUnconfirmedError:
                # Applied on the primary, not confirmed by the replicas the fleet asks
                # for: reading the primary back cannot settle that, so it is never adopted.
                raise
            except CommitOutcomeUnknownError:
                yield Reached(CrashWindow.COMMIT_REPLY_LOST)
                stored = cast(StoredCheckpoint, (yield Load(self.key)))
                if stored.generation != target or stored.blob != blob:
                    raise
        except BaseException:
            (self.state, self.generation, self.checkpoint, self._archive, self._window) = (
                self._durable
            )
            raise
        if window is not None and archive is not None:
            # The store holds these writes now: their keys join the run's key set (the
            # new ones are all in the window: it only moves past acknowledged writes).
            keys, base = window.keys, new.executed_base
            if keys.count < base:
                raise InvariantViolation("the window moved past unacknowledged writes")
            keys.extend(key_digests(new.executed[keys.count - base : archive.executed - base]))
        self.state, self.generation, self.checkpoint = new, target, blob
        self._archive, self._window = archive, window
        self._durable = (new, target, blob, archive, window)

    # -- proposals -----------------------------------------------------------------------

    def _result(
        self, window: CrashWindow | None = None, read: ReadResult | None = None
    ) -> StepResult:
        return StepResult(
            self.state.trace[-1].outcome, self.state.phase, self.generation, window, read
        )

    def propose(
        self,
        raw: Action | dict[str, Any],
        *,
        approval: ApprovalEvidence | None = None,
        agent_state: dict[str, Any] | None = None,
    ) -> StepResult:
        """Gate one proposal and carry it out: commit, call the adapter, commit again.

        ``agent_state`` is the agent's own JSON state; it is signed and committed with the
        proposal's first commit.

        Raises:
            InvalidTransitionError: the run is terminal.
            FenceRejectedError: the adapter has seen a newer owner; stop at once.
            AdapterError: a retryable adapter failure; the pending write stays committed
                and :meth:`reconcile` resolves it later.
        """
        return self._drive(self._propose(raw, approval, agent_state))

    def _propose(
        self,
        raw: Action | dict[str, Any],
        approval: ApprovalEvidence | None,
        agent_state: dict[str, Any] | None,
    ) -> Op[StepResult]:
        yield Reached(CrashWindow.BEFORE_PROPOSAL)

        def propose() -> machine.Proposal:
            return machine.propose(
                self.state,
                self.scenario,
                raw,
                now=self.clock.now(),
                generation=self.generation,
                approval=approval,
                approvers=self.approvers,
                agent_state=agent_state,
                tools=self.tools,
            )

        try:
            proposal = propose()
        except NotInWindow as older:
            # The key was executed before the window: recall its entry, then decide.
            yield from self._recall(older)
            proposal = propose()
        planned = machine.unprojected(proposal)
        if planned is not None:
            # A new write: ask the adapter what one commit of it leaves behind.
            after = cast("Observation | None", (yield Project(planned.action, planned.env_before)))
            proposal = machine.with_projection(proposal, after)
        disposition, action = proposal.disposition, proposal.action
        if disposition is Disposition.READ and action is not None:
            result = cast(ReadResult, (yield Read(action)))
            yield from self._commit(
                outcomes.apply_read(proposal.state, action, result, now=self.clock.now())
            )
            return self._result(read=result)
        elif disposition is Disposition.VERIFY and action is not None:
            report = cast(VerifierReport, (yield Verify(action.text("target"))))
            yield from self._commit(
                outcomes.apply_verification(proposal.state, action, report, now=self.clock.now())
            )
        elif disposition in (Disposition.EXECUTE_WRITE, Disposition.CHECK_REPLAY):
            yield from self._commit(proposal.state)
            yield Reached(CrashWindow.AFTER_PENDING_BEFORE_ADAPTER)
            yield from self._execute_pending()
        else:  # rejected, awaiting approval, finished: record it (budget was spent)
            yield from self._commit(proposal.state)
        return self._result()

    def _recall(self, older: NotInWindow) -> Op[None]:
        """Read the archive and keep the executed write ``older`` names, verified against
        the signed start of the window (see :func:`recall_executed`)."""
        yield from self._flush()  # the archive read must hold every sealed segment
        stored = cast(StoredCheckpoint, (yield Load(self.key)))
        if self._archive is None or self._window is None:
            raise InvalidTransitionError("a state without an archive has no older writes")
        entry = recall_executed(
            stored.archive, self._archive, self.state.run_id, older.key, older.ordinal
        )
        self._window.keys.remember(entry)

    def execute_pending(self) -> StepResult:
        """Send the committed pending write to the adapter, if it may go now.

        Raises:
            InvalidTransitionError: nothing is pending, or the run is frozen or terminal.
        """
        self._drive(self._execute_pending())
        return self._result()

    def _reviewed(self, decide: Callable[[Observation | None], RunState]) -> Op[RunState]:
        """Run a pure decision; when it opens a review case, run it again with the
        environment observed now, so the case records what the reviewer sees and signs
        (see :func:`outcomes.open_review`). Only the uncommon path pays the observation."""
        new = decide(None)
        if new.review is not None and self.state.review is None:
            new = decide(cast(Observation, (yield Observe())))
        return new

    def _execute_pending(self, observed: Observation | None = None) -> Op[None]:
        """Send the committed pending write to the adapter once, if it may go now.

        ``observed`` is an observation taken just now by the caller (reconcile), which
        spares the live precondition check its own.
        """
        state = self.state
        now = self.clock.now()
        frozen = machine.check_executable(state, self.scenario, now=now, approvers=self.approvers)
        if frozen is not None:
            yield from self._commit(frozen)
            return
        pending = state.pending
        if pending is None:  # for the type checker: check_executable refused already
            raise InvalidTransitionError("there is no pending write to execute")
        if pending.replay_of is not None:
            authoritative = yield from self._lookup(pending.action)
            yield from self._commit(
                (
                    yield from self._reviewed(
                        lambda seen: outcomes.record_replay(
                            state, authoritative, now=now, observed=seen
                        )
                    )
                )
            )
            return
        if not self.executor.enforces_preconditions:
            # Defence in depth: the adapter's own version check misses an edit that left
            # its version where it was. The write goes only onto exactly the state it was
            # planned against (instance, version and fingerprint).
            live = observed if observed is not None else (cast(Observation, (yield Observe())))
            if not live.same_state(pending.env_before):
                yield from self._stale_precondition(live)
                return
        approval = pending.approval.digest if pending.approval is not None else None
        try:
            receipt = cast(
                Receipt,
                (yield Execute(pending.action, pending.intent_digest, self._fence(), approval)),
            )
        except IdempotencyConflictError as exc:
            # The adapter contract: what a conflict carries is the key's Receipt.
            conflicting = cast(Receipt | None, exc.receipt)
            if conflicting is None:
                conflicting = yield from self._lookup(pending.action)
            seen = cast(Observation, (yield Observe()))
            if conflicting is None:
                yield from self._commit(
                    outcomes.open_review(
                        state,
                        ReviewReason.RECEIPT_MISSING,
                        None,
                        now=now,
                        observed=seen,
                        detail="adapter reported a conflict but shows no receipt",
                    )
                )
            else:
                yield from self._commit(
                    outcomes.record_receipt(state, conflicting, now=now, observed=seen)
                )
            return
        except OutcomeUnknownError as exc:
            yield from self._outcome_unknown(exc)
            return
        except FenceRejectedError:
            raise  # a newer owner exists: stop before anything else
        except AdapterError as exc:
            if exc.retryable:
                raise
            yield from self._commit(
                outcomes.record_execution_error(
                    state, exc.message, now=self.clock.now(), fatal=False
                )
            )
            return
        yield Reached(CrashWindow.AFTER_ADAPTER_BEFORE_RECEIPT)
        yield from self._record_and_complete(receipt, TraceOutcome.EXECUTED)

    def _lookup(self, action: Action) -> Op[Receipt | None]:
        """The adapter's authoritative receipt for ``action``'s key (routed by its kind).

        Raises:
            OutcomeUnknownError: the tool cannot say whether a cut-off call happened.
        """
        found = yield Lookup(action.idempotency_key or "", action)
        return cast("Receipt | None", found)

    def _outcome_unknown(self, exc: OutcomeUnknownError) -> Op[None]:
        """Freeze the run in ``needs_review``: the pending write may or may not have
        happened and nothing may call it again; the pending intent stays as evidence."""
        observed = cast(Observation, (yield Observe()))
        yield from self._commit(
            outcomes.open_review(
                self.state,
                ReviewReason.OUTCOME_UNKNOWN,
                None,
                now=self.clock.now(),
                observed=observed,
                detail=exc.message[:1024],
            )
        )

    def _stale_precondition(self, live: Observation) -> Op[None]:
        """The environment moved under a committed pending write before it was sent.

        Timeline: pending committed -> environment observed -> it is not the write's
        "before" state -> nothing sent. Something other than this run changed it. A
        successor that took the run over is the likeliest cause, so the adapter judges
        this owner's fence first (raising it writes nothing): a stale owner is refused for
        what it is. If the adapter holds a receipt for the key, that receipt explains the
        change and is the answer (a conflict opens a review case recording ``live``; the
        same intent is a write already made). Otherwise the write is refused, the pending
        write stays committed as evidence, and the run fails closed: restore will not
        accept the environment either, until an operator acts.

        Raises:
            FenceRejectedError: the adapter has seen a newer owner.
            EnvironmentMismatchError: ``reason="stale_observation"``, with the versions.
        """
        pending = self.state.pending
        if pending is None:
            raise InvalidTransitionError("there is no pending write to execute")
        yield RaiseFence(self._fence())
        authoritative = yield from self._lookup(pending.action)
        if authoritative is not None:
            yield from self._record_and_complete(
                authoritative, TraceOutcome.RECONCILED, observed=live
            )
            return
        raise EnvironmentMismatchError(
            "the environment changed since the pending write was planned; nothing was sent",
            reason="stale_observation",
            expected_version=pending.env_before.version,
            observed_version=live.version,
            fingerprint_changed=live.fingerprint != pending.env_before.fingerprint,
        )

    def _record_and_complete(
        self, receipt: Receipt, outcome: TraceOutcome, observed: Observation | None = None
    ) -> Op[None]:
        """Commit the adapter's receipt together with the state it implies: one commit.

        Timeline: adapter wrote -> environment observed -> receipt checked -> ONE commit of
        receipt + advanced state. A worker dying before that commit is in
        AFTER_ADAPTER_BEFORE_RECEIPT (recovery looks the key up at the adapter). Only when
        the environment cannot be observed, or is not the write's one-commit state, is the
        receipt committed alone as evidence; the state then advances on recovery
        (AFTER_RECEIPT_BEFORE_STATE), or the restore fails closed on the drift. A receipt
        that opens a review case is committed with the environment observed now; when it
        cannot be observed nothing is committed and recovery settles it by the key.
        """
        now = self.clock.now()
        if observed is None:
            try:
                observed = cast(Observation, (yield Observe()))
            except AdapterError:
                alone = outcomes.record_receipt(self.state, receipt, now=now)
                if alone.review is None:
                    yield from self._commit(alone)
                    yield Reached(CrashWindow.AFTER_RECEIPT_BEFORE_STATE)
                raise
        checked = outcomes.record_receipt(
            self.state, receipt, now=now, traced=False, observed=observed
        )
        if checked.pending is None or checked.pending.receipt is None:
            yield from self._commit(checked)  # a review case was opened instead
            return
        try:
            completed = outcomes.complete_write(checked, observed, now=now, outcome=outcome)
        except EnvironmentMismatchError:
            yield from self._commit(outcomes.record_receipt(self.state, receipt, now=now))
            yield Reached(CrashWindow.AFTER_RECEIPT_BEFORE_STATE)
            raise
        yield from self._commit(completed, hold=completed.phase is Phase.RUNNING)

    def _complete(self, outcome: TraceOutcome) -> Op[None]:
        observed = cast(Observation, (yield Observe()))
        yield from self._commit(
            outcomes.complete_write(self.state, observed, now=self.clock.now(), outcome=outcome)
        )

    # -- recovery --------------------------------------------------------------------------

    def reconcile(self) -> StepResult:
        """Resolve whatever the previous owner left pending. Call right after :meth:`resume`.

        Returns the crash window that was found (None when nothing was pending).
        """
        return self._drive(self._reconcile())

    def _reconcile(self) -> Op[StepResult]:
        state = self.state
        pending = state.pending
        if state.phase in TERMINAL_PHASES or pending is None:
            # Died before a proposal (or between steps): the checkpoint is whole.
            return self._result(CrashWindow.BEFORE_PROPOSAL)
        if state.phase is not Phase.RUNNING:
            # Frozen (awaiting approval, needs review): nothing may run until a human acts.
            return self._result(None)
        now = self.clock.now()
        if pending.receipt is not None:
            # Timeline: pending committed -> adapter wrote -> receipt committed -> [died]
            # -> state not advanced. The receipt is evidence of success: replay the
            # deterministic transition without a second effect, after checking that the
            # adapter's authoritative receipt still reads the same.
            authoritative = yield from self._lookup(pending.action)
            if authoritative is None or authoritative.fingerprint != pending.receipt.fingerprint:
                reason = (
                    ReviewReason.RECEIPT_MISSING
                    if authoritative is None
                    else ReviewReason.RECEIPT_DRIFT
                )
                observed = cast(Observation, (yield Observe()))
                yield from self._commit(
                    outcomes.open_review(state, reason, authoritative, now=now, observed=observed)
                )
            else:
                yield from self._complete(TraceOutcome.RECONCILED)
            return self._result(CrashWindow.AFTER_RECEIPT_BEFORE_STATE)
        if pending.replay_of is not None:
            yield from self._execute_pending()
            return self._result(CrashWindow.AFTER_PENDING_BEFORE_ADAPTER)
        try:
            authoritative = yield from self._lookup(pending.action)
        except OutcomeUnknownError as exc:
            # Timeline: pending committed -> tool called -> [died] -> no result recorded,
            # and the tool can neither look the key up nor be called again safely.
            yield from self._outcome_unknown(exc)
            return self._result(CrashWindow.AFTER_ADAPTER_BEFORE_RECEIPT)
        if authoritative is not None:
            # Timeline: pending committed -> adapter wrote -> [died] -> receipt never
            # committed. The outcome was unknown to us; the adapter's record by key
            # settles it. Never retry blindly: record that receipt (a different intent
            # opens a review) and advance.
            yield from self._record_and_complete(authoritative, TraceOutcome.RECONCILED)
            return self._result(CrashWindow.AFTER_ADAPTER_BEFORE_RECEIPT)
        # Timeline: pending committed -> [died] -> adapter never called (no receipt).
        # The environment must still be the write's "before" state; then execute once
        # with the same key. An effect without a receipt cannot be explained: review.
        observed = cast(Observation, (yield Observe()))
        if not observed.same_state(pending.env_before):
            yield from self._commit(
                outcomes.open_review(
                    state,
                    ReviewReason.RECEIPT_MISSING,
                    None,
                    now=now,
                    observed=observed,
                    detail="environment changed but the adapter has no receipt for the key",
                )
            )
        else:
            yield from self._execute_pending(observed)
        return self._result(CrashWindow.AFTER_PENDING_BEFORE_ADAPTER)

    # -- human evidence and control (carried out by ratchet.runtime.interventions) -------------

    def refresh_pending_approval(
        self, evidence: ApprovalEvidence, *, execute: bool = True
    ) -> StepResult:
        """Bind a fresh exact approval to the pending write, commit, and (by default)
        execute it. The superseded evidence is sealed in the trace.

        Raises:
            ApprovalError: the approval is refused; nothing changed.
            ConfigurationError: no approver trust root was configured.
        """
        return interventions.refresh_pending_approval(self, evidence, execute=execute)

    def apply_review_decision(self, decision: ReviewDecision) -> StepResult:
        """Consume a signed reviewer decision after re-reading the authoritative receipt.

        Raises:
            ReviewDecisionError: refused; the case stays frozen and nothing changed.
        """
        return interventions.apply_review_decision(self, decision)

    def cancel(self, reason: str, *, by: str = "", request_id: str = "") -> StepResult:
        """Cancel the run at a safe point, attributed to ``by`` (and its ``request_id``).

        A pending write the adapter may have received is settled first by its key (see
        :func:`decisions.cancel`): recorded as executed if the adapter holds its receipt,
        dropped if it holds none. An answer that does not settle it (another intent, a
        committed receipt the adapter lost or that drifted) opens a review case instead,
        recording the environment now: the result's phase is then ``needs_review``.

        Raises:
            InvalidTransitionError: the run is terminal or under review.
            FenceRejectedError: a newer owner exists.
        """
        return self._drive(interventions.cancel(self, reason, by, request_id))

    def apply_rebaseline(self, decision: RebaselineDecision) -> StepResult:
        """Consume a reviewer's signed rebaseline decision: the environment observed now
        becomes the run's baseline (see :func:`decisions.apply_rebaseline`).

        Raises:
            ReviewDecisionError: refused; nothing changed.
            ConfigurationError: no reviewer trust root was configured.
        """
        return interventions.apply_rebaseline(self, decision)
