"""Lease heartbeats, and the guards that stop a worker the moment its lease is in doubt.

A :class:`Heartbeat` thread renews the lease every ``renew_interval_ms`` by compare-and-set
(``LeasedRun.renew``). It treats the lease as **lost** when

* a renewal is refused (taken over, released, already expired), or
* a renewal's outcome is unknown (Redis unreachable, no reply): never assume it worked, or
* it could not renew before the lease's own expiry as last confirmed by Redis, or
* the executor made no progress for longer than ``stall_timeout_ms``: a wedged worker
  stops renewing so that its run is taken over instead of being held forever.

Once lost, it stays lost. The executor (:mod:`ratchet.worker.executor`) checks it before
every commit and every adapter write, so a worker that cannot prove its lease makes no
further commit or adapter call; the fences in Redis and in the adapters refuse it anyway
if a check races with the loss.

Drills and tests wrap each renewal through the worker's hooks
(:meth:`ratchet.worker.hooks.WorkerHooks.renewal`); a renewal whose reply they drop
raises like any renewal with an unknown outcome, so the lease is lost.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ratchet.errors import LeaseLostError, RatchetError
from ratchet.fleet import metrics
from ratchet.worker.hooks import WorkerHooks

__all__ = ["Heartbeat"]

log = logging.getLogger("ratchet.worker.heartbeat")


class Heartbeat:
    """Renews one lease from a background thread until stopped or lost."""

    def __init__(
        self,
        renew: Callable[[], int],
        *,
        run_id: str,
        interval_ms: int,
        stall_timeout_ms: int,
        lease_ttl_ms: int,
        acquired_at: float | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        hooks: WorkerHooks | None = None,
    ) -> None:
        """``acquired_at`` is the monotonic time just *before* the acquire call was sent:
        the lease cannot have started earlier, so counting the TTL from it is safe."""
        self._hooks = hooks
        self._renew = renew  # returns the new expiry (Redis ms); raises when not renewed
        self.run_id = run_id
        self._interval = interval_ms / 1000
        self._stall = stall_timeout_ms / 1000
        self._ttl = lease_ttl_ms / 1000
        self._monotonic = monotonic
        self._stop = threading.Event()
        self._lost = threading.Event()
        self._lock = threading.Lock()
        self._last_progress = monotonic()
        start = monotonic() if acquired_at is None else acquired_at
        self._valid_until = start + self._ttl  # conservative local bound
        self.renewals = 0
        self.reason: str | None = None
        self._thread = threading.Thread(target=self._loop, name=f"heartbeat-{run_id}", daemon=True)

    def __repr__(self) -> str:
        return f"Heartbeat(run_id={self.run_id!r}, renewals={self.renewals}, lost={self.lost})"

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=max(self._interval * 2, 1.0))

    def progress(self) -> None:
        """The executor finished a step: it is not wedged."""
        with self._lock:
            self._last_progress = self._monotonic()

    @property
    def lost(self) -> bool:
        if not self._lost.is_set() and self._monotonic() >= self._valid_until:
            # Not renewed in time (the thread was starved or Redis was slow): by the
            # local clock the lease may already have expired on Redis' clock.
            self._mark_lost("lease not renewed before its expiry")
        return self._lost.is_set()

    def check(self) -> None:
        """Raise LeaseLostError if the lease is lost or in doubt."""
        if self.lost:
            raise LeaseLostError(
                "lease lost or in doubt; stopping before any effect",
                run_id=self.run_id,
                reason=self.reason or "lost",
            )

    def _mark_lost(self, reason: str) -> None:
        if not self._lost.is_set():
            self.reason = reason
            self._lost.set()
            metrics.lease_lost(reason)
            log.warning("lease lost", extra={"run_id": self.run_id, "reason": reason})

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            with self._lock:
                stalled = self._monotonic() - self._last_progress > self._stall
            if stalled:
                self._mark_lost("executor stalled; renewal withheld")
                return
            started = self._monotonic()
            try:
                if self._hooks is None:
                    self._renew()
                else:
                    self._hooks.renewal(self._renew)
            except RatchetError as exc:
                # Refused or unknown outcome: either way the lease cannot be proven.
                self._mark_lost(f"renewal failed: {type(exc).__name__}")
                return
            except Exception as exc:
                self._mark_lost(f"renewal failed: {type(exc).__name__}")
                return
            self.renewals += 1
            metrics.LEASES_RENEWED.inc()
            # The renewal extended the lease by the TTL from a moment no earlier than
            # when we sent it; count from the send time to stay on the safe side.
            self._valid_until = started + self._ttl
