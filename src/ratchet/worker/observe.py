"""Measuring wrappers a job puts around its store and adapter: metrics and log context.

:class:`ObservedStore` sits under the heartbeat's guard and times each fenced commit that
reaches Redis, counts the ones Redis' fence refused, and moves the log context's
generation after each commit. :class:`ObservedAdapter` counts the writes and fence raises
an adapter's fence refused (this process was stale). Both pass every call and every
exception through unchanged: observing never changes what a job does.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ratchet.errors import FenceRejectedError
from ratchet.runtime import (
    Action,
    AdapterProxy,
    Advance,
    Fence,
    GenerationStore,
    Receipt,
    RunKey,
    StoreProxy,
)
from ratchet.worker import logs, metrics

__all__ = ["ObservedAdapter", "ObservedStore", "job_ended"]

log = logging.getLogger("ratchet.worker.job")


def job_ended(run_id: str, *, outcome: str, phase: str | None, lease_version: int | None,
              generation: int | None, steps: int) -> None:
    """Count an ended job and log one line about it (none for a run held elsewhere: this
    process did nothing with it)."""
    metrics.observe_job(outcome, phase)
    if lease_version is None:
        return
    log.info("job ended", extra={"run_id": run_id, "lease_version": lease_version,
                                 "generation": generation, "outcome": outcome,
                                 "phase": phase, "steps": steps})


class ObservedStore(StoreProxy):
    """A ``GenerationStore`` that measures its commits (see the module docstring)."""

    def __init__(self, inner: GenerationStore, run_id: str) -> None:
        super().__init__(inner)
        self._run_id = run_id

    def advance(self, key: RunKey, *, expected_generation: int, blob: bytes,
                nonces: Sequence[str] = (), segment: bytes = b"") -> None:
        """Raises what the inner store raises."""
        with metrics.observe_commit():
            self._inner.advance(key, expected_generation=expected_generation, blob=blob,
                                nonces=nonces, segment=segment)
        logs.set_generation(self._run_id, expected_generation + 1)
        log.debug("committed", extra={"run_id": self._run_id})

    def advance_many(self, key: RunKey, commits: Sequence[Advance]) -> None:
        """Raises what the inner store raises. One timing for the batch (one round
        trip); every commit in it is counted."""
        if not commits:
            return
        with metrics.observe_commit(len(commits)):
            self._inner.advance_many(key, commits)
        logs.set_generation(self._run_id, commits[-1].expected_generation + 1)
        log.debug("committed", extra={"run_id": self._run_id, "commits": len(commits)})


class ObservedAdapter(AdapterProxy):
    """An ``Adapter`` that counts fence refusals (see the module docstring)."""

    def raise_fence(self, fence: Fence) -> None:
        """Raises what the inner adapter raises."""
        try:
            self._inner.raise_fence(fence)
        except FenceRejectedError:
            metrics.STALE_ADAPTER_WRITES.labels(call="raise_fence").inc()
            raise

    def execute(self, action: Action, intent_digest: str, fence: Fence,
                approval_digest: str | None) -> Receipt:
        """Raises what the inner adapter raises."""
        try:
            return self._inner.execute(action, intent_digest, fence, approval_digest)
        except FenceRejectedError:
            metrics.STALE_ADAPTER_WRITES.labels(call="execute").inc()
            raise
