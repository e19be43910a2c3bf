"""Measuring wrappers a job puts around its store and adapter: metrics, log context and
the records operators read.

:class:`ObservedStore` sits under the heartbeat's guard and times each fenced commit that
reaches Redis, counts the ones Redis' fence refused, and moves the log context's
generation after each commit. :class:`ObservedAdapter` counts the writes and fence raises
an adapter's fence refused (this process was stale), and hands a failed verification to
the job's :class:`RunRecorder`. Both pass every call and every exception through
unchanged: observing never changes what a job does.

:class:`RunRecorder` leaves two kinds of record in the run's incident list, for ``ratchet
show`` and the console:

* ``lease_taken_over``: this job's acquire took the lease from a holder whose lease had
  expired (it died, stalled or lost Redis) rather than released it;
* ``verifier_failed``: a verification did not pass. The signed state keeps only the
  report's ``output_digest``; the record keeps the target, exit code, timeout and
  truncation flags, that digest, and the last 40 lines / 4 KiB of the output with secrets
  scrubbed (:mod:`ratchet.worker.scrub`). That tail is not covered by any signature: it is
  for diagnosis only, and is shown as such.

Recording is best effort: a record that cannot be written is skipped (logged), never a
reason for the job to fail.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ratchet.errors import FenceRejectedError, RatchetError
from ratchet.runtime import (
    Action,
    Adapter,
    AdapterProxy,
    Advance,
    Fence,
    GenerationStore,
    Receipt,
    RunKey,
    StoreProxy,
    VerifierReport,
)
from ratchet.worker import logs, metrics
from ratchet.worker.scrub import Scrubber, tail
from ratchet.worker.settings import Settings

__all__ = ["ObservedAdapter", "ObservedStore", "RunRecorder", "job_ended"]

#: Bounds of the verifier output kept with a ``verifier_failed`` record.
TAIL_BYTES = 4096
TAIL_LINES = 40

log = logging.getLogger("ratchet.worker.job")


def job_ended(
    run_id: str,
    *,
    outcome: str,
    phase: str | None,
    lease_version: int | None,
    generation: int | None,
    steps: int,
) -> None:
    """Count an ended job and log one line about it (none for a run held elsewhere: this
    process did nothing with it)."""
    metrics.observe_job(outcome, phase)
    if lease_version is None:
        return
    log.info(
        "job ended",
        extra={
            "run_id": run_id,
            "lease_version": lease_version,
            "generation": generation,
            "outcome": outcome,
            "phase": phase,
            "steps": steps,
        },
    )


class ObservedStore(StoreProxy):
    """A ``GenerationStore`` that measures its commits (see the module docstring)."""

    def __init__(self, inner: GenerationStore, run_id: str) -> None:
        super().__init__(inner)
        self._run_id = run_id

    def advance(
        self,
        key: RunKey,
        *,
        expected_generation: int,
        blob: bytes,
        nonces: Sequence[str] = (),
        segment: bytes = b"",
    ) -> None:
        """Raises what the inner store raises."""
        with metrics.observe_commit():
            self._inner.advance(
                key,
                expected_generation=expected_generation,
                blob=blob,
                nonces=nonces,
                segment=segment,
            )
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


class RunRecorder:
    """The operator-facing records one job leaves for its run (see the module docstring).

    ``store`` is the fleet's store (its ``record_incident``); ``settings`` name the secrets
    to scrub, read only when a verification failed.
    """

    def __init__(self, store: Any, run_id: str, lease_version: int, settings: Settings) -> None:
        self._store = store
        self._run_id = run_id
        self._lease_version = lease_version
        self._settings = settings

    def __repr__(self) -> str:
        return f"RunRecorder(run_id={self._run_id!r}, lease_version={self._lease_version})"

    def _record(self, record: dict[str, Any]) -> None:
        try:
            self._store.record_incident(self._run_id, record)
        except RatchetError as exc:
            log.warning(
                "run record not written",
                extra={
                    "run_id": self._run_id,
                    "reason": record.get("kind"),
                    "error": type(exc).__name__,
                },
            )

    def lease_acquired(self, *, took_over: bool, previous: tuple[str, int] = ("", 0)) -> None:
        """Count the acquire; record a takeover (the previous holder's lease expired),
        naming the lease it ended (``previous``: its owner and version)."""
        metrics.lease_acquired(took_over=took_over)
        if took_over:
            self._record(
                {
                    "kind": "lease_taken_over",
                    "lease_version": self._lease_version,
                    "previous_owner": previous[0],
                    "previous_lease_version": previous[1],
                    "message": "the previous holder's lease expired",
                }
            )

    def verifier_failed(self, report: VerifierReport, run: Any) -> None:
        """Record a verification that did not pass, with a scrubbed tail of its output
        when the adapter kept it (``run``: a ``VerifierRun`` or None)."""
        record: dict[str, Any] = {
            "kind": "verifier_failed",
            "target": report.target,
            "lease_version": self._lease_version,
            "output_digest": report.output_digest,
            "env_version": report.env_version,
            "signed": False,
        }
        output = getattr(run, "output", None)
        if isinstance(output, str) and getattr(run, "target", None) == report.target:
            scrubber = Scrubber.from_settings(self._settings)
            text, cut = tail(scrubber.scrub(output), max_bytes=TAIL_BYTES, max_lines=TAIL_LINES)
            exit_code = getattr(run, "exit_code", None)
            record.update(
                exit_code=exit_code if isinstance(exit_code, int) else None,
                timed_out=bool(getattr(run, "timed_out", False)),
                truncated=bool(getattr(run, "truncated", False)),
                bound=bool(getattr(run, "bound", False)),
                tail=text,
                tail_cut=cut,
                message=_verifier_message(run),
            )
        else:
            record["message"] = "the verification did not pass (no output kept)"
        self._record(record)


def _verifier_message(run: Any) -> str:
    if getattr(run, "timed_out", False):
        return "the verifier timed out"
    if not getattr(run, "bound", True):
        return "the environment changed while the verifier ran"
    return f"the verifier exited with {getattr(run, 'exit_code', None)}"


class ObservedAdapter(AdapterProxy):
    """An ``Adapter`` that counts fence refusals and reports failed verifications to
    ``recorder`` (see the module docstring)."""

    def __init__(self, inner: Adapter, recorder: RunRecorder | None = None) -> None:
        super().__init__(inner)
        self._recorder = recorder

    def verify(self, target: str) -> VerifierReport:
        """Raises what the inner adapter raises."""
        report = self._inner.verify(target)
        if not report.passed and self._recorder is not None:
            self._recorder.verifier_failed(report, _last_verifier_run(self._inner))
        return report

    def raise_fence(self, fence: Fence) -> None:
        """Raises what the inner adapter raises."""
        try:
            self._inner.raise_fence(fence)
        except FenceRejectedError:
            metrics.STALE_ADAPTER_WRITES.labels(call="raise_fence").inc()
            raise

    def execute(
        self, action: Action, intent_digest: str, fence: Fence, approval_digest: str | None
    ) -> Receipt:
        """Raises what the inner adapter raises."""
        try:
            return self._inner.execute(action, intent_digest, fence, approval_digest)
        except FenceRejectedError:
            metrics.STALE_ADAPTER_WRITES.labels(call="execute").inc()
            raise


def _last_verifier_run(adapter: object) -> Any:
    """The workspace's last verifier run, directly or as a router's files part."""
    for part in (adapter, getattr(adapter, "files", None)):
        run = getattr(part, "last_verifier_run", None)
        if run is not None:
            return run
    return None
