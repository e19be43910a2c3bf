"""The executor: the one place where an effect the engine yields is performed.

:class:`ratchet.runtime.engine.RunEngine` decides what happens and in which order; it
yields effects (:mod:`ratchet.runtime.effects`) and this module performs them against the
run's adapter and generation store. For every effect, in this order:

1. **Lease guard** (a worker's :class:`~ratchet.worker.heartbeat.Heartbeat`): before a
   commit, an adapter write, a fence raise or a verification, refuse at once with
   ``LeaseLostError`` when the lease can no longer be proven. A commit counts as progress
   for the stall detector.
2. **Hooks** (:class:`~ratchet.runtime.effects.Hooks`): drills and tests attach here, and
   only here, to pause, kill, delay, fail or drop the reply of an effect, or to crash at a
   named window (``Reached``). Production code knows nothing else about faults.
3. **Metrics and the log context** (``measure=True``, a worker): commits are timed and
   counted, the log context's generation follows every commit, fence refusals and
   failed verifications are counted and recorded for the operator, and so is an answer
   an adapter's peer sent past the byte cap (``peer_answer_too_large``).
4. The call on the port itself.

The same executor performs the engine's effects in unit tests (in-memory ports, no
guard, no metrics), so there is one way an effect happens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from ratchet.errors import (
    FenceRejectedError,
    InvalidTransitionError,
    OutcomeUnknownError,
    PeerAnswerTooLargeError,
)
from ratchet.fleet import logs, metrics
from ratchet.runtime.effects import (
    Commit,
    CrashWindow,
    Effect,
    Execute,
    HighWater,
    Hooks,
    Load,
    Lookup,
    Observe,
    Project,
    RaiseFence,
    Reached,
    Read,
    Verify,
)
from ratchet.runtime.ports import (
    Adapter,
    GenerationStore,
    Observation,
    ReadResult,
    Receipt,
    StoredCheckpoint,
    VerifierReport,
)
from ratchet.worker.observe import RunRecorder, last_verifier_run, too_large

__all__ = ["Executor", "Guard", "WindowProbe"]

log = logging.getLogger(__name__)

# Effects that need a live lease: a store write, or an adapter call that can change or
# judge the environment under this owner's name.
_GUARDED = (Commit, Execute, RaiseFence, Verify)


class Guard(Protocol):
    """What the executor asks about the lease (a worker's heartbeat is one)."""

    def check(self) -> None:
        """Raise ``LeaseLostError`` when the lease can no longer be proven."""

    def progress(self) -> None:
        """The run made progress (a commit applied)."""


class WindowProbe(Hooks):
    """Hooks that call ``probe(window)`` at every crash window the engine reaches, and
    then whatever ``inner`` does (a test's or drill's way to crash at a window)."""

    def __init__(self, probe: Callable[[CrashWindow], None], inner: Hooks | None = None) -> None:
        self._probe = probe
        self._inner = inner

    def around(self, effect: Effect, proceed: Callable[[], Any]) -> Any:
        if isinstance(effect, Reached):
            self._probe(effect.window)
        if self._inner is not None:
            return self._inner.around(effect, proceed)
        return proceed()


class Executor:
    """Performs the engine's effects on ``adapter`` and ``store`` (see the module
    docstring). ``adapter``, ``store`` and ``hooks`` are plain attributes: a test may
    swap one between two operations. Without a ``store`` (a read-only observation by an
    operator's command), a store effect is refused."""

    def __init__(
        self,
        adapter: Adapter,
        store: GenerationStore | None = None,
        *,
        hooks: Hooks | None = None,
        guard: Guard | None = None,
        recorder: RunRecorder | None = None,
        measure: bool = False,
        run_id: str = "",
    ) -> None:
        self.adapter = adapter
        self.store = store
        self.hooks = hooks
        self._guard = guard
        self._recorder = recorder
        self._measure = measure
        self._run_id = run_id

    def __repr__(self) -> str:
        return f"Executor(run_id={self._run_id!r}, guarded={self._guard is not None})"

    @property
    def enforces_preconditions(self) -> bool:
        """What the adapter declares (see docs/adapters.md)."""
        return getattr(self.adapter, "enforces_preconditions", False) is True

    def perform(self, effect: Effect) -> Any:
        """Perform ``effect`` (guard, hooks, metrics, the port) and return its result.

        Raises what the guard, the hooks or the port raised; InvalidTransitionError for
        something that is not an effect.
        """
        hooks = self.hooks
        kind = type(effect)
        if kind is Reached and hooks is None:
            return None  # a crash window, and nothing attached that acts on it
        handler = _HANDLERS.get(kind)
        if handler is None:
            raise InvalidTransitionError(f"not an effect: {kind.__name__}")
        guard = self._guard
        if guard is not None and isinstance(effect, _GUARDED):
            guard.check()
        try:
            if hooks is None:
                result = handler(self, effect)
            else:
                result = hooks.around(effect, lambda: handler(self, effect))
        except (PeerAnswerTooLargeError, OutcomeUnknownError) as exc:
            self._answer_refused(effect, exc)
            raise
        if guard is not None and isinstance(effect, Commit):
            guard.progress()
        return result

    # -- the ports (one method per effect; see _HANDLERS) ----------------------------------

    def _commit(self, effect: Commit) -> None:
        batch = effect.batch
        if not batch:
            return
        store = self._store_for(effect)
        if not self._measure:
            store.commit_batch(effect.key, batch, release=effect.release)
            return
        # One timing for the batch (one round trip); every commit in it is counted.
        with metrics.observe_commit(len(batch)):
            store.commit_batch(effect.key, batch, release=effect.release)
        logs.set_generation(self._run_id, batch[-1].expected_generation + 1)
        log.debug("committed", extra={"run_id": self._run_id, "commits": len(batch)})

    def _high_water(self, effect: HighWater) -> int:
        return self._store_for(effect).high_water(effect.key)

    def _load(self, effect: Load) -> StoredCheckpoint:
        return self._store_for(effect).load(effect.key)

    def _store_for(self, effect: Effect) -> GenerationStore:
        if self.store is None:
            raise InvalidTransitionError(
                f"{type(effect).__name__} needs a generation store; this executor has none"
            )
        return self.store

    def _observe(self, effect: Observe) -> Observation:
        return self.adapter.observe()

    def _project(self, effect: Project) -> Observation | None:
        return self.adapter.project(effect.action, effect.before)

    def _lookup(self, effect: Lookup) -> Receipt | None:
        # An adapter over several tools (ratchet.tools) routes the lookup by kind.
        routed = getattr(self.adapter, "lookup_for", None) if effect.action else None
        if routed is not None:
            found: Receipt | None = routed(effect.action)
            return found
        return self.adapter.lookup(effect.idempotency_key)

    def _read(self, effect: Read) -> ReadResult:
        return self.adapter.read(effect.action)

    def _execute(self, effect: Execute) -> Receipt:
        try:
            return self.adapter.execute(
                effect.action, effect.intent_digest, effect.fence, effect.approval_digest
            )
        except FenceRejectedError:
            self._count_refusal("execute")
            raise

    def _raise_fence(self, effect: RaiseFence) -> None:
        try:
            self.adapter.raise_fence(effect.fence)
        except FenceRejectedError:
            self._count_refusal("raise_fence")
            raise

    def _verify(self, effect: Verify) -> VerifierReport:
        report = self.adapter.verify(effect.target)
        if not report.passed and self._recorder is not None:
            self._recorder.verifier_failed(report, last_verifier_run(self.adapter))
        return report

    def _reached(self, effect: Reached) -> None:
        return None  # a crash window: only hooks act on it

    def _answer_refused(self, effect: Effect, exc: Exception) -> None:
        """An adapter call failed on an answer past the byte cap: record it for the
        operator (a write's becomes an outcome unknown, anything else is refused)."""
        refusal = too_large(exc)
        if refusal is None or self._recorder is None:
            return
        outcome = "outcome_unknown" if isinstance(exc, OutcomeUnknownError) else "refused"
        self._recorder.peer_answer_too_large(
            refusal, call=type(effect).__name__.lower(), outcome=outcome
        )

    def _count_refusal(self, call: str) -> None:
        if self._measure:
            metrics.STALE_ADAPTER_WRITES.labels(call=call).inc()


# Each effect's port call: one dictionary lookup from perform() to the port.
_HANDLERS: dict[type, Callable[[Executor, Any], Any]] = {
    Commit: Executor._commit,
    HighWater: Executor._high_water,
    Load: Executor._load,
    Observe: Executor._observe,
    Project: Executor._project,
    Lookup: Executor._lookup,
    Read: Executor._read,
    Execute: Executor._execute,
    RaiseFence: Executor._raise_fence,
    Verify: Executor._verify,
    Reached: Executor._reached,
}
