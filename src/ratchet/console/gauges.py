"""Fleet gauges of the queue and the waiting humans, read when Prometheus scrapes the
console's ``/metrics``.

==============================================  ==========================================
metric                                          meaning
==============================================  ==========================================
``ratchet_queue_depth``                         jobs waiting in the fleet's RQ queue
``ratchet_workers{state}``                      workers RQ knows for the queue, by state
                                                (``busy``, ``idle``, ``started``,
                                                ``suspended``; every state present, at 0
                                                when none is in it)
``ratchet_oldest_approval_age_seconds``         how long the run waiting longest for a
                                                signed approval has waited, by the store's
                                                clock (0 when none waits)
==============================================  ==========================================

The queue and worker gauges need the console's ``list_workers``; without it they are not
served. A part that cannot be read (Redis unreachable) is left out of that scrape and
logged, so one unreadable part never hides the others.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

from ratchet.console.data import ConsoleData, RunQuery
from ratchet.errors import RatchetError
from ratchet.runtime import Phase

__all__ = ["WORKER_STATES", "QueueGauges", "waiting_since"]

log = logging.getLogger("ratchet.console")

WORKER_STATES = ("busy", "idle", "started", "suspended")


def waiting_since(run: dict[str, Any]) -> int | None:
    """When (seconds, the store's clock) the run last started waiting for an approval:
    its newest ``awaiting_approval`` or ``approval_expired`` trace event."""
    for event in reversed(run.get("trace") or []):
        if isinstance(event, dict) and event.get("outcome") in (
            "awaiting_approval",
            "approval_expired",
        ):
            at = event.get("at")
            return at if isinstance(at, int) else None
    return None


class QueueGauges:
    """A prometheus-client collector of the gauges in the module docstring."""

    def __init__(self, data: ConsoleData) -> None:
        self._data = data

    def collect(self) -> Iterator[Metric]:
        if self._data.list_workers is not None:
            try:
                info = self._data.list_workers()
            except RatchetError as exc:
                log.warning("queue gauges not read", extra={"error": type(exc).__name__})
            else:
                depth = GaugeMetricFamily(
                    "ratchet_queue_depth", "Jobs waiting in the fleet's queue."
                )
                depth.add_metric([], int(info.get("queue_depth") or 0))
                yield depth
                workers = GaugeMetricFamily(
                    "ratchet_workers",
                    "Workers registered for the queue, by state.",
                    labels=["state"],
                )
                counts = dict.fromkeys(WORKER_STATES, 0)
                for worker in info.get("workers") or []:
                    state = str(worker.get("state"))
                    if state in counts:
                        counts[state] += 1
                for state, count in counts.items():
                    workers.add_metric([state], count)
                yield workers
        yield self._approval_age()

    def _approval_age(self) -> Metric:
        gauge = GaugeMetricFamily(
            "ratchet_oldest_approval_age_seconds",
            "How long the run waiting longest for a signed approval has waited.",
        )
        oldest = 0
        try:
            if self._data.page_runs is not None:
                # The index lists runs by when they entered the phase: the oldest is the
                # first of one page, oldest first. One run is opened, at any fleet size.
                rows, _cursor, _scanned = self._data.page_runs(
                    RunQuery(phase=Phase.AWAITING_APPROVAL.value, oldest_first=True, limit=1)
                )
            else:
                rows = self._data.list_runs(self._data.limit)
        except RatchetError as exc:
            log.warning("approval age not read", extra={"error": type(exc).__name__})
            rows = []
        now = self._data.now()
        for row in rows:
            if row.get("phase") != Phase.AWAITING_APPROVAL.value:
                continue
            try:
                run = self._data.run_detail(str(row["run_id"]), now)
            except RatchetError:
                continue  # unverifiable: counted by ratchet_runs{phase="unverifiable"}
            since = waiting_since(run)
            status = run.get("status")
            store_now = status.get("store_now_ms") if isinstance(status, dict) else None
            at = store_now // 1000 if isinstance(store_now, int) else now
            if since is not None:
                oldest = max(oldest, at - since)
        gauge.add_metric([], oldest)
        return gauge
