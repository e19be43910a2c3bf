"""The thread-lease heartbeat of a claimed writer: a background thread that renews the
lease every TTL/3 until it is stopped, and stops for good the first time a renewal does not
succeed.

A renewal is the runs' own ``renew_lease`` script on the thread's meta hash: a
compare-and-set on owner and lease version, judged by Redis ``TIME``. The heartbeat treats
the lease as **lost** when

* a renewal is refused (taken over, deleted, released, already expired by the store's
  clock): :class:`~ratchet.errors.LeaseLostError` from the script, or
* a renewal's outcome is unknown (Redis unreachable, no reply, a malformed reply): never
  assume it worked (as the workers' heartbeat does, ``ratchet.worker.heartbeat``).

Either way it stops renewing and hands the error to ``on_lost``: the writer keeps it and
raises it (a stale-owner error) from its next write or ownership check, before it sends
anything. The lease in Redis then runs out on its own; a fence in the same Lua step as
every write refuses the writer anyway if a write races with the loss.

There is no stall detection here: a node that hangs keeps its lease renewed as long as its
process lives. The operator's way out is a takeover
(``claim_write_ownership(..., takeover=True, reason=...)``), which the next renewal
notices.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ratchet.errors import LeaseLostError

__all__ = ["LeaseHeartbeat"]

log = logging.getLogger("ratchet.langgraph.heartbeat")


class LeaseHeartbeat:
    """Calls ``renew`` every ``interval_s`` from a daemon thread until :meth:`stop` or the
    first renewal that raises. ``renew`` raises LeaseLostError when the lease is gone and
    anything else when its outcome is unknown; ``on_lost`` receives the LeaseLostError
    that stands for either (once)."""

    def __init__(
        self,
        renew: Callable[[], object],
        *,
        interval_s: float,
        on_lost: Callable[[LeaseLostError], None],
        lost_error: Callable[[str], LeaseLostError],
        name: str,
    ) -> None:
        """``lost_error(error_type)`` builds the LeaseLostError for a renewal whose outcome
        is unknown (it gets the exception's type name, never its text)."""
        self._renew = renew
        self._interval_s = interval_s
        self._on_lost = on_lost
        self._lost_error = lost_error
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._renewals = 0
        self._lost: LeaseLostError | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def __repr__(self) -> str:
        return (
            f"LeaseHeartbeat(interval_s={self._interval_s}, renewals={self.renewals}, "
            f"lost={self._lost is not None})"
        )

    @property
    def interval_s(self) -> float:
        """Seconds between renewals (TTL/3)."""
        return self._interval_s

    @property
    def renewals(self) -> int:
        """How many renewals succeeded."""
        with self._lock:
            return self._renewals

    @property
    def lost(self) -> LeaseLostError | None:
        """The error that stopped the heartbeat (refused or unknown renewal), or None."""
        with self._lock:
            return self._lost

    @property
    def running(self) -> bool:
        """True until the heartbeat stopped (asked to, or after a failed renewal)."""
        return not self._stopped.is_set()

    def start(self) -> LeaseHeartbeat:
        """Start renewing (the first renewal comes one interval from now)."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop renewing and wait for the thread to end (at most two intervals, at least a
        second); a renewal already on its way completes first."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=max(self._interval_s * 2, 1.0))

    def wait_stopped(self, timeout_s: float) -> bool:
        """Block until the heartbeat has stopped or ``timeout_s`` passed; True if stopped."""
        return self._stopped.wait(timeout_s)

    def _loop(self) -> None:
        try:
            while not self._stop.wait(self._interval_s):
                try:
                    self._renew()
                except LeaseLostError as exc:
                    self._fail(exc)
                    return
                except Exception as exc:
                    # Unknown outcome: the lease cannot be proven, so it counts as lost.
                    self._fail(self._lost_error(type(exc).__name__))
                    return
                with self._lock:
                    self._renewals += 1
        finally:
            self._stopped.set()

    def _fail(self, exc: LeaseLostError) -> None:
        with self._lock:
            self._lost = exc
        log.warning(
            "thread lease not renewed; the writer stops",
            extra={
                "thread_id": exc.context.get("thread_id"),
                "lease_version": exc.context.get("lease_version"),
                "reason": exc.reason,
            },
        )
        self._on_lost(exc)
