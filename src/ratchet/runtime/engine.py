"""The engine: drives one run through the state machine using the ports it is given.

The engine is the only place where the order of commits and adapter calls is decided.
It imports no I/O: the adapter, the generation store and the clock are passed in, so the
same engine runs in-memory in unit tests and on Redis with real adapters in a worker.

One write, end to end: two fenced, signed commits::

    propose ──▶ commit pending intent (gen g+1) ──▶ adapter.execute(key, fence) ──▶
    observe ──▶ commit receipt + advanced state (gen g+2)

Each arrow is a place a worker can die; :class:`CrashWindow` names them and
:meth:`RunEngine.reconcile` is the recovery for each (timeline comments there). A
``probe`` callback is invoked at every window so tests and drills can inject a crash.

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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from ratchet.errors import (
    AdapterError,
    CommitOutcomeUnknownError,
    ConfigurationError,
    EnvironmentMismatchError,
    FenceRejectedError,
    IdempotencyConflictError,
    InvalidTransitionError,
)
from ratchet.runtime import machine
from ratchet.runtime.actions import Action
from ratchet.runtime.checkpoint import (
    DEFAULT_MAX_CHECKPOINT_BYTES,
    ArchiveRef,
    CheckpointPayload,
    empty_archive,
    restore_checkpoint,
    run_key,
    seal_checkpoint,
    seal_split,
)
from ratchet.runtime.evidence import (
    ApprovalEvidence,
    RebaselineDecision,
    ReviewDecision,
    TrustRoots,
)
from ratchet.runtime.machine import Disposition
from ratchet.runtime.ports import (
    Adapter,
    Advance,
    Clock,
    Fence,
    GenerationStore,
    Observation,
    ReadResult,
    Receipt,
    RunKey,
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

__all__ = ["CrashWindow", "Probe", "RunEngine", "StepResult"]


class CrashWindow(StrEnum):
    """Where a worker can die between a side effect and the checkpoint that records it."""

    BEFORE_PROPOSAL = "before_proposal"
    AFTER_PENDING_BEFORE_ADAPTER = "after_pending_before_adapter"
    AFTER_ADAPTER_BEFORE_RECEIPT = "after_adapter_before_receipt"
    AFTER_RECEIPT_BEFORE_STATE = "after_receipt_before_state"
    COMMIT_REPLY_LOST = "commit_reply_lost"


Probe = Callable[[CrashWindow], None]


def _no_probe(window: CrashWindow) -> None:
    return None


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
        adapter: Adapter,
        store: GenerationStore,
        clock: Clock,
        state: RunState,
        generation: int,
        blob: bytes,
        approvers: TrustRoots | None = None,
        reviewers: TrustRoots | None = None,
        lease_version: int = 1,
        probe: Probe | None = None,
        max_checkpoint_bytes: int = DEFAULT_MAX_CHECKPOINT_BYTES,
        coalesce: bool = False,
        archive_trace: bool = False,
        archive: ArchiveRef | None = None,
        store_epoch: str | None = None,
    ) -> None:
        self.scenario = scenario
        self.adapter = adapter
        self.store = store
        self.clock = clock
        self.approvers = approvers
        self.reviewers = reviewers
        self.lease_version = lease_version
        self.store_epoch = store_epoch
        self._keyring = keyring
        self._probe = probe or _no_probe
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
        # The last commit the store acknowledged, with the archive the next commit extends.
        self._durable = (state, generation, blob, self._archive)
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
        adapter: Adapter,
        store: GenerationStore,
        clock: Clock,
        **options: Any,
    ) -> RunEngine:
        """Observe the environment, build the first state and commit it as generation 1.

        ``document_digest`` (an option) binds the run's signed document into the state.
        """
        observed = adapter.observe()
        state = machine.new_run(
            run_id,
            scenario,
            observed,
            clock.now(),
            document_digest=options.pop("document_digest", None),
        )
        max_bytes = options.get("max_checkpoint_bytes", DEFAULT_MAX_CHECKPOINT_BYTES)
        if options.pop("archive_trace", False):
            sealed = seal_split(
                state,
                scenario,
                keyring,
                generation=1,
                archived=empty_archive(run_id),
                max_bytes=max_bytes,
            )
            store.advance(
                run_key(state), expected_generation=0, blob=sealed.blob, segment=sealed.segment
            )
            return cls(
                scenario=scenario,
                keyring=keyring,
                adapter=adapter,
                store=store,
                clock=clock,
                state=state,
                generation=1,
                blob=sealed.blob,
                archive=sealed.archive,
                **options,
            )
        blob = seal_checkpoint(state, scenario, keyring, generation=1, max_bytes=max_bytes)
        store.advance(run_key(state), expected_generation=0, blob=blob)
        return cls(
            scenario=scenario,
            keyring=keyring,
            adapter=adapter,
            store=store,
            clock=clock,
            state=state,
            generation=1,
            blob=blob,
            **options,
        )

    @classmethod
    def resume(
        cls,
        blob: bytes,
        *,
        scenario: Scenario,
        keyring: KeyRing,
        adapter: Adapter,
        store: GenerationStore,
        clock: Clock,
        approvers: TrustRoots | None = None,
        reviewers: TrustRoots | None = None,
        lease_version: int = 1,
        archive: Sequence[bytes] = (),
        opened: CheckpointPayload | None = None,
        accept_environment: Observation | None = None,
        tolerate_environment: bool = False,
        **options: Any,
    ) -> RunEngine:
        """Restore a checkpoint (all checks of :func:`restore_checkpoint`), then raise the
        adapter's fence to this lease and observe the environment.

        ``archive`` is the run's archive segments as the store returned them with ``blob``.
        ``opened`` is ``open_checkpoint(blob, archive=archive)`` when the caller made it
        already (to check the run document against it before building the adapter).

        The fence goes up before the observation that restore compares, so from then on a
        previous owner that is still running can no longer land a write we have not seen.
        Call :meth:`reconcile` next.

        ``accept_environment`` and ``tolerate_environment`` relax the environment check for
        a verified rebaseline decision and for an operator's cancel (see
        :func:`restore_checkpoint`); the refusal a tolerated check made is kept in
        :attr:`environment_refused`, and the observation in :attr:`observed_at_restore`.
        """

        def fence_then_observe(state: RunState, generation: int) -> Observation:
            adapter.raise_fence(
                Fence(
                    run_id=state.run_id,
                    lease_version=lease_version,
                    state_version=generation,
                    store_epoch=options.get("store_epoch"),
                )
            )
            return adapter.observe()

        restored = restore_checkpoint(
            blob,
            scenario=scenario,
            keyring=keyring,
            store=store,
            observe=fence_then_observe,
            approvers=approvers,
            reviewers=reviewers,
            archive=archive,
            opened=opened,
            accept_environment=accept_environment,
            tolerate_environment=tolerate_environment,
        )
        engine = cls(
            scenario=scenario,
            keyring=keyring,
            adapter=adapter,
            store=store,
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

    def flush(self) -> None:
        """Send every held commit now (one round trip). A no-op when nothing is held.

        Raises what the store's commit raises; the engine then stands at the last
        acknowledged commit (see :meth:`_send`).
        """
        if self._held:
            self._send(
                list(self._held), self.state, self.generation, self.checkpoint, self._archive
            )

    def _commit(self, new: RunState, *, hold: bool = False) -> None:
        """Validate, sign and commit ``new`` as the next generation, consuming new nonces.

        With ``hold`` (and ``coalesce``), the sealed commit is kept to travel with the next
        one instead of being sent now; otherwise it is sent together with any held ones.
        """
        known = set(self.state.consumed_nonces)
        nonces = tuple(n for n in new.consumed_nonces if n not in known)
        target = self.generation + 1
        archive = self._archive
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
            )
            blob, archive = sealed.blob, sealed.archive
            commit = Advance(
                self.generation, blob, nonces, sealed.segment, not_after, new.phase.value
            )
        if hold and self._coalesce:
            self._held.append(commit)
            self.state, self.generation, self.checkpoint = new, target, blob
            self._archive = archive
            return
        self._send([*self._held, commit], new, target, blob, archive)

    def _send(
        self,
        batch: list[Advance],
        new: RunState,
        target: int,
        blob: bytes,
        archive: ArchiveRef | None,
    ) -> None:
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
                # advance() carries neither a deadline nor the phase: only a commit
                # with neither may take it.
                if len(batch) == 1 and not batch[0].not_after_ms and not batch[0].phase:
                    one = batch[0]
                    self.store.advance(
                        self.key,
                        expected_generation=one.expected_generation,
                        blob=one.blob,
                        nonces=one.nonces,
                        segment=one.segment,
                    )
                else:
                    self.store.advance_many(self.key, batch)
            except CommitOutcomeUnknownError:
                self._probe(CrashWindow.COMMIT_REPLY_LOST)
                stored = self.store.load(self.key)
                if stored.generation != target or stored.blob != blob:
                    raise
        except BaseException:
            self.state, self.generation, self.checkpoint, self._archive = self._durable
            raise
        self.state, self.generation, self.checkpoint, self._archive = new, target, blob, archive
        self._durable = (new, target, blob, archive)

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
        self._probe(CrashWindow.BEFORE_PROPOSAL)
        proposal = machine.propose(
            self.state,
            self.scenario,
            raw,
            now=self.clock.now(),
            generation=self.generation,
            project=self.adapter.project,
            approval=approval,
            approvers=self.approvers,
            agent_state=agent_state,
        )
        disposition, action = proposal.disposition, proposal.action
        if disposition is Disposition.READ and action is not None:
            result = self.adapter.read(action)
            self._commit(machine.apply_read(proposal.state, action, result, now=self.clock.now()))
            return self._result(read=result)
        elif disposition is Disposition.VERIFY and action is not None:
            report = self.adapter.verify(action.args["target"])
            self._commit(
                machine.apply_verification(proposal.state, action, report, now=self.clock.now())
            )
        elif disposition in (Disposition.EXECUTE_WRITE, Disposition.CHECK_REPLAY):
            self._commit(proposal.state)
            self._probe(CrashWindow.AFTER_PENDING_BEFORE_ADAPTER)
            self._execute_pending()
        else:  # rejected, awaiting approval, finished: record it (budget was spent)
            self._commit(proposal.state)
        return self._result()

    def execute_pending(self) -> StepResult:
        """Send the committed pending write to the adapter, if it may go now.

        Raises:
            InvalidTransitionError: nothing is pending, or the run is frozen or terminal.
        """
        self._execute_pending()
        return self._result()

    def _reviewed(self, decide: Callable[[Observation | None], RunState]) -> RunState:
        """Run a pure decision; when it opens a review case, run it again with the
        environment observed now, so the case records what the reviewer sees and signs
        (see :func:`machine.open_review`). Only the uncommon path pays the observation."""
        new = decide(None)
        if new.review is not None and self.state.review is None:
            new = decide(self.adapter.observe())
        return new

    def _execute_pending(self, observed: Observation | None = None) -> None:
        """Send the committed pending write to the adapter once, if it may go now.

        ``observed`` is an observation taken just now by the caller (reconcile), which
        spares the live precondition check its own.
        """
        state = self.state
        now = self.clock.now()
        frozen = machine.check_executable(state, self.scenario, now=now, approvers=self.approvers)
        if frozen is not None:
            self._commit(frozen)
            return
        pending = state.pending
        if pending is None:  # for the type checker: check_executable refused already
            raise InvalidTransitionError("there is no pending write to execute")
        key = pending.action.idempotency_key or ""
        if pending.replay_of is not None:
            authoritative = self.adapter.lookup(key)
            self._commit(
                self._reviewed(
                    lambda seen: machine.record_replay(state, authoritative, now=now, observed=seen)
                )
            )
            return
        if not self._adapter_checks_preconditions:
            # Defence in depth: the adapter's own version check misses an edit that left
            # its version where it was. The write goes only onto exactly the state it was
            # planned against (instance, version and fingerprint).
            live = observed if observed is not None else self.adapter.observe()
            if not live.same_state(pending.env_before):
                self._stale_precondition(live)
                return
        approval = pending.approval.digest if pending.approval is not None else None
        try:
            receipt = self.adapter.execute(
                pending.action, pending.intent_digest, self._fence(), approval
            )
        except IdempotencyConflictError as exc:
            conflicting = exc.context.get("receipt")
            if conflicting is None:
                conflicting = self.adapter.lookup(key)
            seen = self.adapter.observe()
            if conflicting is None:
                self._commit(
                    machine.open_review(
                        state,
                        ReviewReason.RECEIPT_MISSING,
                        None,
                        now=now,
                        observed=seen,
                        detail="adapter reported a conflict but shows no receipt",
                    )
                )
            else:
                self._commit(machine.record_receipt(state, conflicting, now=now, observed=seen))
            return
        except FenceRejectedError:
            raise  # a newer owner exists: stop before anything else
        except AdapterError as exc:
            if exc.context.get("retryable"):
                raise
            self._commit(
                machine.record_execution_error(
                    state, exc.message, now=self.clock.now(), fatal=False
                )
            )
            return
        self._probe(CrashWindow.AFTER_ADAPTER_BEFORE_RECEIPT)
        self._record_and_complete(receipt, TraceOutcome.EXECUTED)

    @property
    def _adapter_checks_preconditions(self) -> bool:
        """Whether the adapter declares that its own ``execute`` refuses a write unless
        the environment is exactly the planned one (see docs/adapters.md)."""
        return getattr(self.adapter, "enforces_preconditions", False) is True

    def _stale_precondition(self, live: Observation) -> None:
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
        self.adapter.raise_fence(self._fence())
        authoritative = self.adapter.lookup(pending.action.idempotency_key or "")
        if authoritative is not None:
            self._record_and_complete(authoritative, TraceOutcome.RECONCILED, observed=live)
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
    ) -> None:
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
                observed = self.adapter.observe()
            except AdapterError:
                alone = machine.record_receipt(self.state, receipt, now=now)
                if alone.review is None:
                    self._commit(alone)
                    self._probe(CrashWindow.AFTER_RECEIPT_BEFORE_STATE)
                raise
        checked = machine.record_receipt(
            self.state, receipt, now=now, traced=False, observed=observed
        )
        if checked.pending is None or checked.pending.receipt is None:
            self._commit(checked)  # a review case was opened instead
            return
        try:
            completed = machine.complete_write(checked, observed, now=now, outcome=outcome)
        except EnvironmentMismatchError:
            self._commit(machine.record_receipt(self.state, receipt, now=now))
            self._probe(CrashWindow.AFTER_RECEIPT_BEFORE_STATE)
            raise
        self._commit(completed, hold=completed.phase is Phase.RUNNING)

    def _complete(self, outcome: TraceOutcome) -> None:
        observed = self.adapter.observe()
        self._commit(
            machine.complete_write(self.state, observed, now=self.clock.now(), outcome=outcome)
        )

    # -- recovery --------------------------------------------------------------------------

    def reconcile(self) -> StepResult:
        """Resolve whatever the previous owner left pending. Call right after :meth:`resume`.

        Returns the crash window that was found (None when nothing was pending).
        """
        state = self.state
        pending = state.pending
        if state.phase in TERMINAL_PHASES or pending is None:
            # Died before a proposal (or between steps): the checkpoint is whole.
            return self._result(CrashWindow.BEFORE_PROPOSAL)
        if state.phase is not Phase.RUNNING:
            # Frozen (awaiting approval, needs review): nothing may run until a human acts.
            return self._result(None)
        key = pending.action.idempotency_key or ""
        now = self.clock.now()
        if pending.receipt is not None:
            # Timeline: pending committed -> adapter wrote -> receipt committed -> [died]
            # -> state not advanced. The receipt is evidence of success: replay the
            # deterministic transition without a second effect, after checking that the
            # adapter's authoritative receipt still reads the same.
            authoritative = self.adapter.lookup(key)
            if authoritative is None or authoritative.fingerprint != pending.receipt.fingerprint:
                reason = (
                    ReviewReason.RECEIPT_MISSING
                    if authoritative is None
                    else ReviewReason.RECEIPT_DRIFT
                )
                self._commit(
                    machine.open_review(
                        state, reason, authoritative, now=now, observed=self.adapter.observe()
                    )
                )
            else:
                self._complete(TraceOutcome.RECONCILED)
            return self._result(CrashWindow.AFTER_RECEIPT_BEFORE_STATE)
        if pending.replay_of is not None:
            self._execute_pending()
            return self._result(CrashWindow.AFTER_PENDING_BEFORE_ADAPTER)
        authoritative = self.adapter.lookup(key)
        if authoritative is not None:
            # Timeline: pending committed -> adapter wrote -> [died] -> receipt never
            # committed. The outcome was unknown to us; the adapter's record by key
            # settles it. Never retry blindly: record that receipt (a different intent
            # opens a review) and advance.
            self._record_and_complete(authoritative, TraceOutcome.RECONCILED)
            return self._result(CrashWindow.AFTER_ADAPTER_BEFORE_RECEIPT)
        # Timeline: pending committed -> [died] -> adapter never called (no receipt).
        # The environment must still be the write's "before" state; then execute once
        # with the same key. An effect without a receipt cannot be explained: review.
        observed = self.adapter.observe()
        if not observed.same_state(pending.env_before):
            self._commit(
                machine.open_review(
                    state,
                    ReviewReason.RECEIPT_MISSING,
                    None,
                    now=now,
                    observed=observed,
                    detail="environment changed but the adapter has no receipt for the key",
                )
            )
        else:
            self._execute_pending(observed)
        return self._result(CrashWindow.AFTER_PENDING_BEFORE_ADAPTER)

    # -- human evidence and control ------------------------------------------------------------

    def refresh_pending_approval(
        self, evidence: ApprovalEvidence, *, execute: bool = True
    ) -> StepResult:
        """Bind a fresh exact approval to the pending write, commit, and (by default)
        execute it. The superseded evidence is sealed in the trace.

        Raises:
            ApprovalError: the approval is refused; nothing changed.
            ConfigurationError: no approver trust root was configured.
        """
        if self.approvers is None:
            raise ConfigurationError("no approver trust root configured")
        new = machine.attach_approval(
            self.state,
            self.scenario,
            evidence,
            self.approvers,
            generation=self.generation,
            now=self.clock.now(),
        )
        self._commit(new)
        if execute:
            self._execute_pending()
        return self._result()

    def apply_review_decision(self, decision: ReviewDecision) -> StepResult:
        """Consume a signed reviewer decision after re-reading the authoritative receipt.

        Raises:
            ReviewDecisionError: refused; the case stays frozen and nothing changed.
        """
        if self.reviewers is None:
            raise ConfigurationError("no reviewer trust root configured")
        case = self.state.review
        key = case.pending.action.idempotency_key if case is not None else None
        authoritative = self.adapter.lookup(key) if key else None
        observed = self.adapter.observe()
        new = machine.apply_review_decision(
            self.state,
            self.scenario,
            decision,
            self.reviewers,
            authoritative=authoritative,
            observed=observed,
            now=self.clock.now(),
        )
        self._commit(new)
        return self._result()

    def _settle_pending(self) -> machine.Settled | None:
        """Look the pending write's key up at the adapter, behind this lease's fence, for
        a control that ends or rebases the run (None: nothing is pending, or only a write
        waiting for approval, which was never sent).

        Timeline: fence raised (resume did; again here for a caller that did not) -> key
        looked up. From the fence on, no older owner can land the write, so "no receipt"
        means it never happened and never will.
        """
        pending = self.state.pending
        if pending is None or self.state.phase is not Phase.RUNNING:
            return None
        self.adapter.raise_fence(self._fence())
        return machine.Settled(self.adapter.lookup(pending.action.idempotency_key or ""))

    def cancel(self, reason: str, *, by: str = "", request_id: str = "") -> StepResult:
        """Cancel the run at a safe point, attributed to ``by`` (and its ``request_id``).

        A pending write the adapter may have received is settled first by its key (see
        :func:`machine.cancel`): recorded as executed if the adapter holds its receipt,
        dropped if it holds none. An answer that does not settle it (another intent, a
        committed receipt the adapter lost or that drifted) opens a review case instead,
        recording the environment now: the result's phase is then ``needs_review``.

        Raises:
            InvalidTransitionError: the run is terminal or under review.
            FenceRejectedError: a newer owner exists.
        """
        settled = self._settle_pending()
        observed = self.observed_at_restore if settled is None else self.adapter.observe()
        now = self.clock.now()
        try:
            new = machine.cancel(
                self.state,
                reason,
                now=now,
                by=by,
                request_id=request_id,
                settled=settled,
                observed=observed,
            )
        except InvalidTransitionError:
            pending = self.state.pending
            if settled is None or pending is None:
                raise
            receipt = settled.receipt
            reason_code = (
                ReviewReason.RECEIPT_MISSING
                if receipt is None
                else ReviewReason.INTENT_CONFLICT
                if receipt.intent_digest != pending.intent_digest
                else ReviewReason.RECEIPT_DRIFT
            )
            new = machine.open_review(
                self.state,
                reason_code,
                receipt,
                now=now,
                observed=observed,
                detail="found while settling a cancelled run's write",
            )
        self._commit(new)
        return self._result()

    def apply_rebaseline(self, decision: RebaselineDecision) -> StepResult:
        """Consume a reviewer's signed rebaseline decision: the environment observed now
        becomes the run's baseline (see :func:`machine.apply_rebaseline`).

        Raises:
            ReviewDecisionError: refused; nothing changed.
            ConfigurationError: no reviewer trust root was configured.
        """
        if self.reviewers is None:
            raise ConfigurationError("no reviewer trust root configured")
        machine.check_rebaseline(
            self.state, self.scenario, decision, self.reviewers, generation=self.generation
        )
        settled = self._settle_pending()
        new = machine.apply_rebaseline(
            self.state,
            self.scenario,
            decision,
            self.reviewers,
            generation=self.generation,
            observed=self.adapter.observe(),
            settled=settled,
            now=self.clock.now(),
        )
        self._commit(new)
        return self._result()
