"""Failpoints: named crash windows a drill can trigger in a worker process.

Set ``RATCHET_FAILPOINTS`` to a ``;``-separated list of ``window=action[@hit]``:

* ``window`` is a :class:`ratchet.runtime.CrashWindow` value (``before_proposal``,
  ``after_pending_before_adapter``, ``after_adapter_before_receipt``,
  ``after_receipt_before_state``, ``commit_reply_lost``);
* ``action`` is ``kill`` (SIGKILL self), ``pause`` (SIGSTOP self: a zombie until someone
  sends SIGCONT), ``delay:MS`` (sleep), or ``raise`` (an exception that ends the job);
* ``@hit`` fires on the N-th time the window is reached in this process (default 1);
  ``@*`` fires every time.

Every time a failpoint fires it is first recorded (one JSON line, flushed and fsynced) in
``RATCHET_FAILPOINTS_LOG`` when set, so a checker can tell a fault that fired from one
that never did. Unset, the engine's probe is a no-op: zero cost.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from dataclasses import dataclass

from ratchet.errors import ConfigurationError
from ratchet.runtime import CrashWindow
from ratchet.runtime.engine import Probe

__all__ = ["FailpointFired", "Failpoints", "parse_failpoints", "probe_from_env"]


class FailpointFired(Exception):  # noqa: N818 - it is an event, not an error
    """Raised by the ``raise`` action: the job ends as if the worker had died there."""


@dataclass(frozen=True, slots=True)
class Failpoint:
    window: CrashWindow
    action: str
    argument: int
    hit: int | None  # None: every time


def parse_failpoints(text: str) -> list[Failpoint]:
    """Parse ``RATCHET_FAILPOINTS``. Raises ConfigurationError naming the bad entry."""
    points: list[Failpoint] = []
    for entry in filter(None, (part.strip() for part in text.split(";"))):
        name, _, rest = entry.partition("=")
        action, _, hit_text = rest.partition("@")
        verb, _, arg = action.partition(":")
        try:
            window = CrashWindow(name.strip())
        except ValueError:
            raise ConfigurationError(f"unknown failpoint {name!r}", field="RATCHET_FAILPOINTS",
                                     entry=entry) from None
        if verb not in ("kill", "pause", "delay", "raise"):
            raise ConfigurationError(f"unknown failpoint action {verb!r}",
                                     field="RATCHET_FAILPOINTS", entry=entry)
        if verb == "delay" and not arg.isdigit():
            raise ConfigurationError("delay needs milliseconds: delay:MS",
                                     field="RATCHET_FAILPOINTS", entry=entry)
        if hit_text not in ("", "*") and not hit_text.isdigit():
            raise ConfigurationError("hit must be a number or *", field="RATCHET_FAILPOINTS",
                                     entry=entry)
        hit = None if hit_text == "*" else int(hit_text or "1")
        points.append(Failpoint(window, verb, int(arg or "0"), hit))
    return points


class Failpoints:
    """The probe a worker gives its engines."""

    def __init__(self, points: list[Failpoint], log_path: str | None = None) -> None:
        self._points = {p.window: p for p in points}
        self._hits: Counter[CrashWindow] = Counter()
        self._log_path = log_path

    def __call__(self, window: CrashWindow) -> None:
        point = self._points.get(window)
        if point is None:
            return
        self._hits[window] += 1
        if point.hit is not None and self._hits[window] != point.hit:
            return
        self._record(point)
        if point.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif point.action == "pause":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif point.action == "delay":
            time.sleep(point.argument / 1000)
        else:
            raise FailpointFired(window.value)

    def _record(self, point: Failpoint) -> None:
        if not self._log_path:
            return
        line = json.dumps({"pid": os.getpid(), "window": point.window.value,
                           "action": point.action, "hit": self._hits[point.window],
                           "at": time.time()}) + "\n"
        fd = os.open(self._log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)


def probe_from_env() -> Probe | None:
    """The probe for ``RATCHET_FAILPOINTS`` (None when unset or empty)."""
    text = os.environ.get("RATCHET_FAILPOINTS", "")
    points = parse_failpoints(text)
    if not points:
        return None
    return Failpoints(points, os.environ.get("RATCHET_FAILPOINTS_LOG"))
