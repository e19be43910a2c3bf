"""Time that gates an effect is the store's time.

Approval expiry, a run's wall-clock budget and an action's deadline decide whether an
effect may happen, and worker clocks may disagree (a laptop that slept, a VM whose clock
jumped, a host hours off). So the engine's clock in a worker is :class:`StoreClock`: an
**upper bound** of the Redis server's clock, never earlier than the real store time. It is
anchored at a Redis ``TIME`` reading (the one every lease acquire and renewal returns) and
moves with the local monotonic clock from the moment *before* that request was sent, plus
a margin for the two clocks' rates (``drift_ppm``) and a fixed slack (``margin_ms``).
Erring late is the safe side: an approval or a budget then expires a little early, never
late.

At start a worker compares its wall clock with Redis' (:func:`check_clock_skew`) and
refuses to start beyond a bound (``RATCHET_MAX_CLOCK_SKEW_MS``, default 2 s): lease
expiry never depends on it, but a clock that far off is a broken host, and the skew is
reported in the logs and the ``ratchet_clock_skew_seconds`` gauge either way.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

from ratchet.errors import ConfigurationError

__all__ = ["StoreClock", "check_clock_skew"]


class StoreClock:
    """An upper bound of the store's clock (see the module docstring)."""

    def __init__(
        self,
        store_ms: int,
        *,
        sent_at: float | None = None,
        margin_ms: int = 1000,
        drift_ppm: int = 1000,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._monotonic = monotonic
        self._margin_ms = margin_ms
        self._drift = drift_ppm / 1_000_000
        self._lock = threading.Lock()
        self._anchor = (store_ms, monotonic() if sent_at is None else sent_at)

    def observe(self, store_ms: int, *, sent_at: float) -> None:
        """A newer store reading: ``store_ms`` was read by a request sent at monotonic
        ``sent_at``. It becomes the anchor (a fresher one: less drift to allow for) only
        when the store's clock moved forward since the anchor; a reading that went
        backwards (a store clock jump) is ignored, so the bound never moves earlier."""
        with self._lock:
            if store_ms >= self._anchor[0]:
                self._anchor = (store_ms, sent_at)

    def _bound_ms(self, store_ms: int, sent_at: float) -> float:
        elapsed_ms = max(self._monotonic() - sent_at, 0.0) * 1000
        return store_ms + elapsed_ms * (1 + self._drift) + self._margin_ms

    def now_ms(self) -> int:
        with self._lock:
            return math.ceil(self._bound_ms(*self._anchor))

    def now(self) -> int:
        """Seconds since the epoch on the store's clock, rounded up."""
        return math.ceil(self.now_ms() / 1000)


def check_clock_skew(
    store_ms: int, *, sent_at_wall: float, received_at_wall: float, max_skew_ms: int
) -> float:
    """The worker's wall clock minus Redis' (seconds; the round trip's midpoint against
    the store's reading).

    Raises:
        ConfigurationError: the skew exceeds ``max_skew_ms``.
    """
    local_ms = (sent_at_wall + received_at_wall) / 2 * 1000
    skew_ms = local_ms - store_ms
    if abs(skew_ms) > max_skew_ms:
        raise ConfigurationError(
            f"this host's clock is {skew_ms / 1000:+.1f} s from the Redis server's (bound "
            f"{max_skew_ms / 1000:.1f} s, RATCHET_MAX_CLOCK_SKEW_MS): fix its time sync "
            "before it runs work",
            field="max_clock_skew_ms",
        )
    return skew_ms / 1000
