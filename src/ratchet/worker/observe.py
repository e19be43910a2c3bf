"""What a job records for operators: its end (a metric and a log line) and the run's
incident records. (Commits and adapter calls are measured where they are performed, in
:mod:`ratchet.worker.executor`.)

:class:`RunRecorder` leaves two kinds of record in the run's incident list, for ``ratchet
show`` and the console:

* ``lease_taken_over``: this job's acquire took the lease from a holder whose lease had
  expired (it died, stalled or lost Redis) rather than released it;
* ``verifier_failed``: a verification did not pass. The signed state keeps only the
  report's ``output_digest``; the record keeps the target, exit code, timeout and
  truncation flags, that digest, and the last 40 lines / 4 KiB of the output with secrets
  scrubbed (:mod:`ratchet.fleet.scrub`). That tail is not covered by any signature: it is
  for diagnosis only, and is shown as such;
* ``peer_answer_too_large``: a peer's answer (an MCP server's, a chat model's, an HTTP
  service's) went past the byte cap and reading stopped (:mod:`ratchet.limits`): the
  peer, the cap, the bytes read, which call it answered and what became of the call.

Recording is best effort: a record that cannot be written is skipped (logged), never a
reason for the job to fail.
"""

from __future__ import annotations

import logging
from typing import Any

from ratchet.errors import PeerAnswerTooLargeError, RatchetError
from ratchet.fleet import metrics
from ratchet.fleet.scrub import Scrubber, tail
from ratchet.fleet.settings import Settings
from ratchet.runtime import VerifierReport

__all__ = ["RunRecorder", "job_ended", "last_verifier_run", "too_large"]

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


class RunRecorder:
    """The operator-facing records one job leaves for its run (see the module docstring).

    ``store`` is the fleet's store (its ``records.record_incident``); ``settings`` name the secrets
    to scrub, read only when a verification failed.
    """

    def __init__(self, store: Any, run_id: str, lease_version: int, settings: Settings) -> None:
        self._store = store
        self._run_id = run_id
        self._lease_version = lease_version
        self._settings = settings
        self._acquire: tuple[bool, tuple[str, int]] | None = None

    def __repr__(self) -> str:
        return f"RunRecorder(run_id={self._run_id!r}, lease_version={self._lease_version})"

    def _record(self, record: dict[str, Any]) -> None:
        self.acknowledge_acquire()
        try:
            self._store.records.record_incident(self._run_id, record)
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
        """Count the acquire (and a takeover) now; hold the takeover's record until
        ``acknowledge_acquire`` (or the job's first record): a job that hands its run on to
        another host calls ``drop_acquire`` instead and leaves nothing against the run."""
        metrics.lease_acquired(took_over=took_over)
        self._acquire = (took_over, previous)

    def drop_acquire(self) -> None:
        """The job handed its run on unopened: its takeover is not recorded against the run
        (the run's own host takes the lease next; docs/hosts.md). The worker's counters
        keep it: the lease was taken."""
        self._acquire = None

    def acknowledge_acquire(self) -> None:
        """Record a takeover (the previous holder's lease expired), naming the lease it
        ended. Once per job; nothing after a drop."""
        if self._acquire is None:
            return
        took_over, previous = self._acquire
        self._acquire = None
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

    def peer_answer_too_large(
        self, refusal: PeerAnswerTooLargeError, *, call: str, outcome: str
    ) -> None:
        """Record an answer past the byte cap: ``call`` is what it answered (``read``,
        ``execute``, ``lookup``, ``observe``, ``model``...), ``outcome`` what the call
        became (``refused``: nothing happened; ``outcome_unknown``: a write that may have
        happened, the run waits for a reviewer)."""
        self._record(
            {
                "kind": "peer_answer_too_large",
                "lease_version": self._lease_version,
                "peer": refusal.peer,
                "limit_bytes": refusal.limit_bytes,
                "seen_bytes": refusal.seen_bytes,
                "encoding": refusal.encoding,
                "call": call,
                "outcome": outcome,
                "message": refusal.message[:500],
            }
        )


def too_large(exc: BaseException) -> PeerAnswerTooLargeError | None:
    """The answer past the byte cap behind ``exc``: ``exc`` itself, or what it was
    raised from (a write's ``OutcomeUnknownError``); None when the cap is not why."""
    for found in (exc, exc.__cause__):
        if isinstance(found, PeerAnswerTooLargeError):
            return found
    return None


def _verifier_message(run: Any) -> str:
    if getattr(run, "timed_out", False):
        return "the verifier timed out"
    if not getattr(run, "bound", True):
        return "the environment changed while the verifier ran"
    return f"the verifier exited with {getattr(run, 'exit_code', None)}"


def last_verifier_run(adapter: object) -> Any:
    """The workspace's last verifier run, directly or as a router's files part."""
    for part in (adapter, getattr(adapter, "files", None)):
        run = getattr(part, "last_verifier_run", None)
        if run is not None:
            return run
    return None
