"""The drill's worker hooks: failpoints and the event log, attached through
:class:`ratchet.worker.hooks.WorkerHooks` (the only place a worker lets them in).

:func:`from_env` builds them from ``RATCHET_FAILPOINTS``, ``RATCHET_FAILPOINTS_LOG`` and
``RATCHET_DRILL_EVENTS`` (see :mod:`ratchet.chaos.failpoints`); the drill starts its
workers with it (``worker_main(..., hooks_factory=from_env)``), and so do the tests that
run real worker processes with failpoints. A plain ``ratchet worker`` never does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ratchet.chaos.failpoints import (
    EventLog,
    FailpointFired,
    Failpoints,
    TripwireHooks,
    Tripwires,
    events_from_env,
    probe_from_env,
)
from ratchet.errors import StoreUnavailableError
from ratchet.leasing import LeasedRun, RedisStore
from ratchet.runtime import CrashWindow
from ratchet.runtime.effects import Hooks
from ratchet.worker.executor import WindowProbe
from ratchet.worker.hooks import WorkerHooks

__all__ = ["DrillHooks", "from_env"]


class DrillHooks(WorkerHooks):
    """Failpoints (``points``), a drill event log (``events``) and, for tests, a plain
    crash-window probe (``probe``), attached to a worker process or one job."""

    def __init__(
        self,
        points: Failpoints | None = None,
        events: EventLog | None = None,
        *,
        probe: Callable[[CrashWindow], None] | None = None,
    ) -> None:
        self.points = points
        self.events = events
        self.probe = probe
        self._wires: Tripwires | None = None  # the current job's (one job at a time)

    def __repr__(self) -> str:
        return f"DrillHooks(points={self.points!r}, events={self.events!r})"

    def attach(self, store: RedisStore) -> None:
        if self.points is not None:
            # The store lets the failpoints drop or kill at a commit's reply.
            store.reply_hook = self.points.commit_reply

    def job(self, lease: LeasedRun, lease_gone: Callable[[], bool]) -> Hooks | None:
        points, events = self.points, self.events
        self._wires = None
        hooks: Hooks | None = None
        if points is not None or events is not None:
            if points is not None:
                points.enter(lease.run_id, lease.lease_version)
            wires = Tripwires(lease.run_id, lease.lease_version, points, events, lease_gone)
            wires.emit(
                "acquire",
                owner=lease.owner,
                took_over=lease.took_over,
                previous_owner=lease.previous[0],
                previous_lease_version=lease.previous[1],
            )
            self._wires = wires
            hooks = TripwireHooks(wires)
        probe = self.probe if self.probe is not None else points
        if probe is not None:
            hooks = WindowProbe(probe, hooks)
        return hooks

    def write_stage(self, stage: str) -> None:
        if self.points is not None and stage in ("after_intent", "after_replace"):
            self.points.fire(f"workspace_{stage}")
        elif self.points is not None and stage in ("before_push", "after_push"):
            self.points.fire(f"git_{stage}")
        elif self.points is not None and stage in ("before_call", "after_call"):
            self.points.fire(f"tool_{stage}")

    def renewal(self, renew: Callable[[], int]) -> int:
        points = self.points
        if points is None:
            return renew()
        try:
            drop = points.renewal()
        except FailpointFired:
            raise StoreUnavailableError("renewal failed (failpoint)") from None
        expiry = renew()
        if drop:
            # The renewal was sent and applied; its reply is thrown away, so the outcome
            # is unknown to the worker and the lease must count as lost.
            raise StoreUnavailableError("renewal reply lost (failpoint)")
        return expiry

    def event(self, kind: str, **fields: Any) -> None:
        if kind == "restore" and self._wires is not None:
            self._wires.emit(kind, **fields)  # names the job's run and lease
        elif self.events is not None:
            self.events.emit(kind, **fields)


def from_env() -> DrillHooks | None:
    """The drill hooks the environment asks for (None: no failpoints and no event log)."""
    points, events = probe_from_env(), events_from_env()
    if points is None and events is None:
        return None
    return DrillHooks(points, events)
