"""Prometheus metrics of one worker process, and the HTTP endpoint that serves them.

Every worker process counts what it did itself (``prometheus-client``'s default registry,
so the process collectors come along); Prometheus scrapes each process and sums. Names
follow Prometheus conventions: ``ratchet_`` prefix, ``_total`` for counters, base units
(``_seconds``), and label values from small fixed sets only (never a run id, a worker id,
a key, or an exception message):

==============================================  ==========================================
metric                                          meaning
==============================================  ==========================================
``ratchet_jobs_total{outcome,phase}``           jobs ended, by outcome and the phase they
                                                left their run in
``ratchet_leases_acquired_total``               leases this process acquired
``ratchet_leases_taken_over_total``             ... of which the previous holder had
                                                neither finished nor released (it expired)
``ratchet_leases_renewed_total``                heartbeat renewals that landed
``ratchet_leases_lost_total{reason}``           leases given up as lost or in doubt
``ratchet_commits_total``                       fenced commits that landed
``ratchet_commit_duration_seconds``             latency of those commits (histogram)
``ratchet_stale_commits_refused_total{reason}`` commits Redis' fence refused
                                                (``lease_lost``, ``generation_mismatch``,
                                                ``stale_state``); commits the heartbeat
                                                guard withheld first count as lost leases
``ratchet_stale_adapter_writes_refused_total    writes (``execute``) or fence raises
{call}``                                        (``raise_fence``: the adapter has seen a
                                                newer lease, e.g. a rolled-back store)
                                                refused by the adapter's fence
``ratchet_receipt_conflicts_total{reason}``     review cases opened (intent conflict,
                                                receipt missing or drifted, unbound approval)
``ratchet_approvals_requested_total``           runs that started waiting for an approval
``ratchet_approvals_expired_total``             approvals found expired before execution
``ratchet_reaper_requeues_total{cause}``        runs re-enqueued by this process' reaper:
                                                ``lease_expired`` (a holder died or stalled)
                                                or ``released`` (yielded for reaping)
``ratchet_job_errors_total{error}``             jobs that failed with an exception other
                                                than a lost lease or fence (the run's
                                                ``job_error`` incident), by exception type:
                                                a ratchet error or builtin exception name,
                                                else its nearest such base class, else
                                                ``other``
``ratchet_run_duration_seconds{phase}``         created -> terminal, by the store's clock
                                                (histogram), observed by the worker whose
                                                job ended the run
==============================================  ==========================================

Every labelled counter has a series for each of its known label values from the start,
at zero, so that an alert on ``increase(...) > 0`` fires on the first event rather than
on the second (a series that appears with its first increment has no earlier sample).

Fleet-wide gauges (runs by phase, approvals waiting, queue depth, the oldest waiting
approval's age, workers by state) need a view of every run or of the queue; the read-only
console serves them on its own ``/metrics`` (``ratchet.console``).

Serving: ``RATCHET_METRICS_PORT`` unset means no endpoint. Set, worker process ``i`` of a
``ratchet worker --concurrency N`` serves on ``port + i`` at ``RATCHET_METRICS_ADDR``
(``127.0.0.1`` by default: metrics say which runs wait for whom, keep them off the network
unless a scraper needs them).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from time import perf_counter
from typing import Any

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from ratchet import errors
from ratchet.errors import (
    ConfigurationError,
    GenerationMismatchError,
    LeaseLostError,
    StaleStateError,
)
from ratchet.runtime import Phase, RunState
from ratchet.runtime.state import TERMINAL_PHASES, ReviewReason, TraceOutcome

__all__ = [
    "APPROVALS_EXPIRED",
    "APPROVALS_REQUESTED",
    "COMMITS",
    "COMMIT_SECONDS",
    "HOST_LAST_SEEN",
    "JOBS",
    "JOBS_ROUTED",
    "JOB_ERRORS",
    "JOB_ERROR_TYPES",
    "JOB_OUTCOMES",
    "LEASES_ACQUIRED",
    "LEASES_LOST",
    "LEASES_RENEWED",
    "LEASES_TAKEN_OVER",
    "REAPER_HELD",
    "REAPER_REQUEUES",
    "RECEIPT_CONFLICTS",
    "RUN_SECONDS",
    "STALE_ADAPTER_WRITES",
    "STALE_COMMITS",
    "MetricsEndpoint",
    "error_label",
    "job_error",
    "lease_acquired",
    "lease_lost",
    "metrics_port",
    "observe_commit",
    "observe_job",
    "observe_trace",
    "serve_metrics",
]

log = logging.getLogger("ratchet.fleet.metrics")

JOBS = Counter(
    "ratchet_jobs_total", "Jobs ended, by outcome and the phase of their run.", ["outcome", "phase"]
)
LEASES_ACQUIRED = Counter("ratchet_leases_acquired_total", "Leases acquired.")
LEASES_TAKEN_OVER = Counter(
    "ratchet_leases_taken_over_total",
    "Leases acquired whose previous holder let them expire without releasing them.",
)
LEASES_RENEWED = Counter("ratchet_leases_renewed_total", "Lease renewals that landed.")
LEASES_LOST = Counter(
    "ratchet_leases_lost_total", "Leases given up as lost or in doubt.", ["reason"]
)
COMMITS = Counter("ratchet_commits_total", "Fenced checkpoint commits that landed.")
COMMIT_SECONDS = Histogram(
    "ratchet_commit_duration_seconds",
    "Latency of fenced checkpoint commits that landed, one observation per round trip "
    "(commits sent together in one batch are one observation).",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
STALE_COMMITS = Counter(
    "ratchet_stale_commits_refused_total",
    "Commits refused by the store's fence (lease, generation, state).",
    ["reason"],
)
STALE_ADAPTER_WRITES = Counter(
    "ratchet_stale_adapter_writes_refused_total",
    "Adapter writes or fence raises from this process refused by the adapter's fence.",
    ["call"],
)
RECEIPT_CONFLICTS = Counter(
    "ratchet_receipt_conflicts_total",
    "Review cases opened because the world and the records disagree.",
    ["reason"],
)
APPROVALS_REQUESTED = Counter(
    "ratchet_approvals_requested_total", "Runs that started waiting for a signed approval."
)
APPROVALS_EXPIRED = Counter(
    "ratchet_approvals_expired_total", "Approvals found expired before their write executed."
)
CLOCK_SKEW = Gauge(
    "ratchet_clock_skew_seconds",
    "This worker's wall clock minus the Redis server's, measured at start.",
)
REAPER_BAD_ENTRIES = Counter(
    "ratchet_reaper_bad_entries_total", "Expiry index entries the reaper could not handle (parked)."
)
REAPER_REQUEUES = Counter(
    "ratchet_reaper_requeues_total", "Runs re-enqueued by this process' reaper.", ["cause"]
)

JOBS_ROUTED = Counter(
    "ratchet_jobs_routed_total",
    "Jobs this process took for another host's run (its signed document names that host) "
    "and handed on to that host's queue without opening the run.",
)

REAPER_HELD = Counter(
    "ratchet_reaper_held_total",
    "Runs the reaper did not hand on because their host is gone (no worker of it seen "
    "within RATCHET_HOST_TIMEOUT_MS): they wait for it, and are retried later.",
)

HOST_LAST_SEEN = Gauge(
    "ratchet_host_last_seen_seconds",
    "Seconds since a worker of each host known to the store last reported in (store "
    "time; read by this process's reaper).",
    ["host"],
)

JOB_ERRORS = Counter(
    "ratchet_job_errors_total",
    "Jobs that failed with an exception (not a lost lease or fence), by exception type.",
    ["error"],
)
RUN_SECONDS = Histogram(
    "ratchet_run_duration_seconds",
    "Runs from creation to a terminal phase, by the store's clock.",
    ["phase"],
    buckets=(
        1,
        5,
        15,
        30,
        60,
        120,
        300,
        600,
        1800,
        3600,
        4 * 3600,
        12 * 3600,
        24 * 3600,
        3 * 24 * 3600,
    ),
)

#: Every outcome a job reports (``ratchet.worker.jobprotocol.JobOutcome``, which a test holds
#: to this list); anything else is counted as ``other``.
JOB_OUTCOMES = (
    "held_elsewhere",
    "terminal",
    "waiting",
    "finished",
    "cancelled",
    "yielded",
    "lease_lost",
    "retry_later",
    "restore_refused",
    "environment_changed",
    "no_proposal",
    "job_error",
    "poisoned",
    "store_epoch_changed",
    "no_run",
    "store_refused",
    "routed",
    "other",
)
_BUILTIN_ERRORS = (
    TypeError,
    ValueError,
    KeyError,
    IndexError,
    AttributeError,
    RuntimeError,
    RecursionError,
    NotImplementedError,
    ZeroDivisionError,
    ArithmeticError,
    LookupError,
    UnicodeError,
    ImportError,
    OSError,
    TimeoutError,
    MemoryError,
    AssertionError,
    StopIteration,
)


def _ratchet_errors() -> list[type[BaseException]]:
    found: list[type[BaseException]] = [errors.RatchetError]
    for cls in found:
        found.extend(c for c in cls.__subclasses__() if c.__module__ == errors.__name__)
    return found


_KNOWN_ERRORS: dict[type[BaseException], str] = {
    cls: cls.__name__ for cls in (*_ratchet_errors(), *_BUILTIN_ERRORS)
}
#: The ``error`` label values of ``ratchet_job_errors_total``.
JOB_ERROR_TYPES = (*sorted(set(_KNOWN_ERRORS.values())), "other")

_LOST_REASONS = (
    ("renewal failed: LeaseLostError", "refused"),
    ("renewal failed", "unknown_outcome"),
    ("lease not renewed", "not_renewed_in_time"),
    ("executor stalled", "stalled"),
)
_REVIEW_REASONS = frozenset(
    {"intent_conflict", "receipt_missing", "receipt_drift", "approval_unbound"}
)
_PHASE_LABELS = (*(p.value for p in Phase), "unknown")


def _initialise() -> None:
    """Create every labelled series at zero (see the module docstring)."""
    for outcome in JOB_OUTCOMES:
        for phase in _PHASE_LABELS:
            JOBS.labels(outcome=outcome, phase=phase)
    for name in JOB_ERROR_TYPES:
        JOB_ERRORS.labels(error=name)
    for reason in sorted({name for _, name in _LOST_REASONS} | {"other"}):
        LEASES_LOST.labels(reason=reason)
    for reason in ("lease_lost", "generation_mismatch", "stale_state"):
        STALE_COMMITS.labels(reason=reason)
    for call in ("raise_fence", "execute"):
        STALE_ADAPTER_WRITES.labels(call=call)
    for reason in sorted({r.value for r in ReviewReason} | _REVIEW_REASONS | {"other"}):
        RECEIPT_CONFLICTS.labels(reason=reason)
    for cause in ("lease_expired", "released"):
        REAPER_REQUEUES.labels(cause=cause)
    for phase in sorted(p.value for p in TERMINAL_PHASES):
        RUN_SECONDS.labels(phase=phase)


_initialise()


def lease_lost(reason: str) -> None:
    """Count a lost lease; the heartbeat's free-text reason maps to a fixed label."""
    label = next((name for prefix, name in _LOST_REASONS if reason.startswith(prefix)), "other")
    LEASES_LOST.labels(reason=label).inc()


@contextmanager
def observe_commit(count: int = 1) -> Iterator[None]:
    """Time one fenced commit (or a batch of ``count`` sent in one round trip) and count
    how it ended. Re-raises whatever the commit raised."""
    started = perf_counter()
    try:
        yield
    except LeaseLostError:
        STALE_COMMITS.labels(reason="lease_lost").inc()
        raise
    except GenerationMismatchError:
        STALE_COMMITS.labels(reason="generation_mismatch").inc()
        raise
    except StaleStateError:
        STALE_COMMITS.labels(reason="stale_state").inc()
        raise
    COMMITS.inc(count)
    COMMIT_SECONDS.observe(perf_counter() - started)


def observe_trace(state: RunState, *, since_seq: int) -> None:
    """Count approvals requested or expired and review cases opened after ``since_seq``,
    and observe the run's duration when it reached a terminal phase after it."""
    for event in state.trace:
        if event.seq <= since_seq:
            continue
        if state.phase in TERMINAL_PHASES and event is state.trace[-1]:
            # Both ends by the store's clock: ``started_at`` was stamped at creation, the
            # last event by this job's clock anchored at the acquire's Redis time.
            RUN_SECONDS.labels(phase=state.phase.value).observe(max(event.at - state.started_at, 0))
        if event.outcome is TraceOutcome.AWAITING_APPROVAL:
            APPROVALS_REQUESTED.inc()
        elif event.outcome is TraceOutcome.APPROVAL_EXPIRED:
            APPROVALS_EXPIRED.inc()
        elif event.outcome is TraceOutcome.REVIEW_OPENED:
            reason = str(event.detail.get("reason", ""))
            if reason not in _REVIEW_REASONS:
                reason = state.review.reason.value if state.review is not None else "other"
            RECEIPT_CONFLICTS.labels(reason=reason).inc()


def lease_acquired(*, took_over: bool) -> None:
    """Count an acquired lease, and a takeover when its previous holder had expired."""
    LEASES_ACQUIRED.inc()
    if took_over:
        LEASES_TAKEN_OVER.inc()


def observe_job(outcome: str, phase: str | None) -> None:
    """Count one ended job. ``phase`` is None when the job never read its run."""
    JOBS.labels(
        outcome=outcome if outcome in JOB_OUTCOMES else "other",
        phase=phase if phase in _PHASE_LABELS else "unknown",
    ).inc()


def error_label(exc: BaseException) -> str:
    """The ``error`` label for ``exc``: its type's name when ratchet or Python defines it,
    else the nearest such base class (an agent's ``class PlanError(ValueError)`` counts as
    ``ValueError``), else ``other``. Never a free-text value."""
    for cls in type(exc).__mro__:
        name = _KNOWN_ERRORS.get(cls)
        if name is not None:
            return name
    return "other"


def job_error(exc: BaseException) -> None:
    """Count one job that failed with ``exc`` (see :func:`error_label`)."""
    JOB_ERRORS.labels(error=error_label(exc)).inc()


def metrics_port(index: int = 0) -> int | None:
    """The port worker process ``index`` serves on, from ``RATCHET_METRICS_PORT``.

    Raises ConfigurationError for a value that is not a port number.
    """
    raw = os.environ.get("RATCHET_METRICS_PORT", "").strip()
    if not raw:
        return None
    if not raw.isdigit() or not 0 < int(raw) + index < 65536:
        raise ConfigurationError(
            "RATCHET_METRICS_PORT must be a TCP port number", field="RATCHET_METRICS_PORT"
        )
    return int(raw) + index


class MetricsEndpoint:
    """A running metrics endpoint (``prometheus_client``'s threaded HTTP server)."""

    def __init__(self, server: Any, thread: Any, host: str, port: int) -> None:
        self._server = server
        self._thread = thread
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve_metrics(
    index: int = 0, *, port: int | None = None, host: str | None = None
) -> MetricsEndpoint | None:
    """Serve this process' metrics if a port is configured; None when it is not.

    ``port`` 0 picks a free port. A port that cannot be bound is logged and skipped: a
    worker without metrics still does its job. Raises ConfigurationError for a malformed
    ``RATCHET_METRICS_PORT``.
    """
    chosen = metrics_port(index) if port is None else port
    if chosen is None:
        return None
    addr = host or os.environ.get("RATCHET_METRICS_ADDR", "").strip() or "127.0.0.1"
    try:
        server, thread = start_http_server(chosen, addr=addr)
    except OSError as exc:
        log.warning(
            "metrics endpoint not started", extra={"port": chosen, "error": type(exc).__name__}
        )
        return None
    bound = int(server.server_address[1])
    log.info("metrics endpoint started", extra={"port": bound})
    return MetricsEndpoint(server, thread, addr, bound)
