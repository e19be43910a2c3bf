"""Failpoints: named crash windows and protocol steps a drill can trigger in a worker.

Set ``RATCHET_FAILPOINTS`` to a ``;``-separated list of ``point=action[@hit]``:

* ``point`` is a :class:`ratchet.runtime.CrashWindow` value, fired when the engine
  reaches that window (the executor's hooks see its ``Reached`` effect):
  ``before_proposal``, ``after_pending_before_adapter``, ``after_adapter_before_receipt``,
  ``after_receipt_before_state``, ``commit_reply_lost``; or a :class:`WorkerPoint`, fired
  by the worker itself:

  - ``during_renewal``: the heartbeat is about to send a lease renewal;
  - ``after_commit_before_reply``: a commit script ran in Redis, its reply is not read yet
    (the store's ``reply_hook``);
  - ``after_guard_before_adapter``: the heartbeat guard passed, the adapter write is not
    sent yet. A ``pause`` here, resumed after the lease expired and another worker took
    over, sends a genuinely stale write to the adapter: its fence must refuse it;
  - ``after_guard_before_commit``: the same between the guard and the fenced commit, so a
    resumed zombie sends a stale commit that Redis must refuse;
  - ``tool_before_call``, ``tool_after_call``: inside a declared tool's call (an MCP
    server's tool included): the ledger admitted it, the tool is not called yet / the tool
    returned, nothing recorded it yet (the ambiguous window). Apart from :data:`POINTS`,
    like the git workspace's (:data:`TOOL_POINTS`): they fire only for runs with tools;
  - ``observe_after_write``: the observation right after an adapter write. ``raise`` here
    makes that observation fail (a retryable ``AdapterError``), so the engine commits the
    receipt alone and reaches ``after_receipt_before_state`` (otherwise receipt and state
    are one commit and that window does not occur).

* ``action`` is ``kill`` (SIGKILL self), ``pause`` (SIGSTOP self: a zombie until someone
  sends SIGCONT), ``delay:MS`` (sleep), ``raise`` (an exception that ends the job), or
  ``drop-reply`` (only at ``during_renewal`` and ``after_commit_before_reply``: the call is
  made, its reply is thrown away, so the worker must treat the outcome as unknown);
* ``@hit`` fires on the N-th time the point is reached in this process (default 1);
  ``@*`` fires every time.

Every time a failpoint fires it is first recorded (one JSON line, flushed and fsynced) in
``RATCHET_FAILPOINTS_LOG`` when set, with the run and lease version the worker held, so a
checker can tell a fault that fired from one that never did.

``RATCHET_DRILL_EVENTS`` (a folder) turns on a per-process event log
(``events-<pid>.jsonl``): leases acquired, restores accepted, commits acknowledged,
stale commits and stale adapter writes attempted after a pause and how they ended. A drill's
checker reads it afterwards; see :mod:`ratchet.chaos.drill`.

Both reach a job through the executor's hooks (:class:`TripwireHooks`, with the
failpoints as its window probe). Unset, nothing here runs: the executor has no hooks and
takes its plain path (one ``is None`` test per effect).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

from ratchet.errors import (
    AdapterError,
    CommitOutcomeUnknownError,
    ConfigurationError,
    FenceRejectedError,
    RatchetError,
)
from ratchet.runtime import CrashWindow
from ratchet.runtime.effects import Commit, Effect, Execute, Hooks, Observe

__all__ = [
    "ACTIONS",
    "GIT_POINTS",
    "POINTS",
    "TOOL_POINTS",
    "EventLog",
    "FailpointFired",
    "Failpoints",
    "GitPoint",
    "ToolPoint",
    "TripwireHooks",
    "Tripwires",
    "WorkerPoint",
    "events_from_env",
    "parse_failpoints",
    "probe_from_env",
]

_T = TypeVar("_T")


class WorkerPoint(StrEnum):
    """Protocol steps the worker (not the engine) exposes as failpoints."""

    DURING_RENEWAL = "during_renewal"
    AFTER_COMMIT_BEFORE_REPLY = "after_commit_before_reply"
    AFTER_GUARD_BEFORE_ADAPTER = "after_guard_before_adapter"
    AFTER_GUARD_BEFORE_COMMIT = "after_guard_before_commit"
    OBSERVE_AFTER_WRITE = "observe_after_write"
    # Inside the workspace adapter's write: the journal holds the intent, the file is not
    # replaced yet / the file is replaced, its receipt not written yet.
    WORKSPACE_AFTER_INTENT = "workspace_after_intent"
    WORKSPACE_AFTER_REPLACE = "workspace_after_replace"


class GitPoint(StrEnum):
    """Inside a git workspace's write: the commit is made, not pushed yet / the push
    landed, nothing recorded it yet. Apart from :data:`POINTS` (what a drill of folder
    workspaces covers): they fire only for runs on a git remote."""

    GIT_BEFORE_PUSH = "git_before_push"
    GIT_AFTER_PUSH = "git_after_push"


class ToolPoint(StrEnum):
    """Inside a declared tool's call: the ledger admitted it, the tool is not called yet /
    the tool returned, nothing recorded it yet. Apart from :data:`POINTS`: they fire only
    for runs that call declared tools."""

    TOOL_BEFORE_CALL = "tool_before_call"
    TOOL_AFTER_CALL = "tool_after_call"


#: Every failpoint name, engine windows first.
POINTS: tuple[str, ...] = (*(w.value for w in CrashWindow), *(p.value for p in WorkerPoint))
#: The git workspace's failpoint names.
GIT_POINTS: tuple[str, ...] = tuple(p.value for p in GitPoint)
#: The declared tools' failpoint names.
TOOL_POINTS: tuple[str, ...] = tuple(p.value for p in ToolPoint)
ACTIONS = ("kill", "pause", "delay", "raise", "drop-reply")
_DROPPABLE = (WorkerPoint.DURING_RENEWAL.value, WorkerPoint.AFTER_COMMIT_BEFORE_REPLY.value)


class FailpointFired(BaseException):
    """Raised by the ``raise`` action: the job ends as if the worker had died there.

    A ``BaseException``, like ``KeyboardInterrupt``: no handler of the job's meant for
    real failures (``except Exception``) records it or gives the lease up, so the job
    ends exactly as a dead worker's would, lease still held."""


@dataclass(frozen=True, slots=True)
class Failpoint:
    point: str
    action: str
    argument: int
    hit: int | None  # None: every time

    @property
    def window(self) -> str:  # the older name of ``point``
        return self.point


def parse_failpoints(text: str) -> list[Failpoint]:
    """Parse ``RATCHET_FAILPOINTS``. Raises ConfigurationError naming the bad entry."""
    points: list[Failpoint] = []
    for entry in filter(None, (part.strip() for part in text.split(";"))):
        name, _, rest = entry.partition("=")
        name = name.strip()
        action, _, hit_text = rest.partition("@")
        verb, _, arg = action.partition(":")
        if name not in POINTS and name not in GIT_POINTS and name not in TOOL_POINTS:
            raise ConfigurationError(
                f"unknown failpoint {name!r}", field="RATCHET_FAILPOINTS", entry=entry
            )
        if verb not in ACTIONS:
            raise ConfigurationError(
                f"unknown failpoint action {verb!r}", field="RATCHET_FAILPOINTS", entry=entry
            )
        if verb == "drop-reply" and name not in _DROPPABLE:
            raise ConfigurationError(
                f"drop-reply works at {', '.join(_DROPPABLE)} only",
                field="RATCHET_FAILPOINTS",
                entry=entry,
            )
        if verb == "delay" and not arg.isdigit():
            raise ConfigurationError(
                "delay needs milliseconds: delay:MS", field="RATCHET_FAILPOINTS", entry=entry
            )
        if hit_text not in ("", "*") and not hit_text.isdigit():
            raise ConfigurationError(
                "hit must be a number or *", field="RATCHET_FAILPOINTS", entry=entry
            )
        hit = None if hit_text == "*" else int(hit_text or "1")
        points.append(Failpoint(name, verb, int(arg or "0"), hit))
    return points


def _append_line(path: str | os.PathLike[str], record: dict[str, Any], *, sync: bool) -> None:
    # One write(2) per line on an O_APPEND descriptor: lines from concurrent writers never
    # interleave, and a line written before a SIGKILL survives it (the kernel has it).
    line = (json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


class Failpoints:
    """The probe a worker gives its engines, and the worker's own failpoints.

    ``run_id`` / ``lease_version`` name what the worker holds (set by the job) and go into
    every record. ``woke`` is set when a ``pause`` returned (someone sent SIGCONT): the
    next guarded call is the zombie's, and :class:`Tripwires` checks whether it is stale.
    """

    def __init__(self, points: list[Failpoint], log_path: str | None = None) -> None:
        self._points = {p.point: p for p in points}
        self._hits: Counter[str] = Counter()
        self._log_path = log_path
        self._dropping: str | None = None  # the commit id whose replies are being dropped
        self.run_id: str | None = None
        self.lease_version: int | None = None
        self.woke = False

    def __repr__(self) -> str:
        return f"Failpoints(points={sorted(self._points)!r})"

    def enter(self, run_id: str, lease_version: int) -> None:
        """The job took a lease: later records name it."""
        self.run_id, self.lease_version, self.woke = run_id, lease_version, False

    def __call__(self, window: CrashWindow) -> None:
        self.fire(window.value)

    def fire(self, point: str) -> str | None:
        """Reach ``point``: perform its action if it is due. Returns the action performed
        (the caller acts on ``drop-reply``), or None.

        Raises FailpointFired for ``raise``.
        """
        spec = self._points.get(point)
        if spec is None:
            return None
        self._hits[point] += 1
        if spec.hit is not None and self._hits[point] != spec.hit:
            return None
        self._record(spec)
        if spec.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif spec.action == "pause":
            os.kill(os.getpid(), signal.SIGSTOP)
            self.woke = True  # only reached after SIGCONT
        elif spec.action == "delay":
            time.sleep(spec.argument / 1000)
        elif spec.action == "raise":
            raise FailpointFired(point)
        return spec.action

    def renewal(self) -> bool:
        """The heartbeat is about to renew; True: drop the reply (treat as not renewed)."""
        return self.fire(WorkerPoint.DURING_RENEWAL) == "drop-reply"

    def commit_reply(self, run_id: str, commit_id: str) -> bool:
        """The store's ``reply_hook``: a commit ran; True drops its reply. Every retry of a
        dropped commit id is dropped too, so the caller sees an unknown outcome."""
        if commit_id == self._dropping:
            return True
        if self.fire(WorkerPoint.AFTER_COMMIT_BEFORE_REPLY) == "drop-reply":
            self._dropping = commit_id
            return True
        return False

    def _record(self, spec: Failpoint) -> None:
        if not self._log_path:
            return
        _append_line(
            self._log_path,
            {
                "pid": os.getpid(),
                "window": spec.point,
                "action": spec.action,
                "hit": self._hits[spec.point],
                "at": time.time(),
                "run_id": self.run_id,
                "lease_version": self.lease_version,
            },
            sync=True,
        )


class EventLog:
    """Append-only JSON lines for one worker process, read by a drill's checker.

    Lines are written with one ``write(2)`` each and not fsynced: they survive the
    process being killed (the checker runs on the same host), not the host crashing.
    """

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        self.path = Path(folder) / f"events-{os.getpid()}.jsonl"

    def __repr__(self) -> str:
        return f"EventLog(path={os.fspath(self.path)!r})"

    def emit(self, kind: str, **fields: Any) -> None:
        _append_line(
            self.path, {"kind": kind, "pid": os.getpid(), "at": time.time(), **fields}, sync=False
        )


def events_from_env() -> EventLog | None:
    """The event log for ``RATCHET_DRILL_EVENTS`` (None when unset)."""
    folder = os.environ.get("RATCHET_DRILL_EVENTS", "")
    return EventLog(folder) if folder else None


@dataclass
class Tripwires:
    """What a job's guards need in a drill: its failpoints, its event log, and a way to
    ask Redis whether its lease is gone (used only after a ``pause`` returned)."""

    run_id: str
    lease_version: int
    points: Failpoints | None
    events: EventLog | None
    lease_gone: Callable[[], bool]
    _wrote: bool = False

    def emit(self, kind: str, **fields: Any) -> None:
        if self.events is not None:
            self.events.emit(kind, run_id=self.run_id, lease_version=self.lease_version, **fields)

    def _zombie(self, point: WorkerPoint) -> bool:
        """Fire ``point``; True when the worker was paused there and its lease is gone."""
        if self.points is None:
            return False
        self.points.fire(point)
        if not self.points.woke:
            return False
        self.points.woke = False
        try:
            return self.lease_gone()
        except RatchetError:
            return True  # cannot prove the lease: count the attempt as stale

    def commit(self, send: Callable[[], None], *, commits: Sequence[tuple[int, bytes]]) -> None:
        """Send commits (``(generation, blob)`` each, one round trip) past the guard; log
        a stale attempt's outcome and every ack.

        Raises whatever ``send`` raises.
        """
        generation = commits[-1][0]
        stale = self._zombie(WorkerPoint.AFTER_GUARD_BEFORE_COMMIT)
        try:
            send()
        except CommitOutcomeUnknownError:
            if stale:
                self.emit("stale_commit", outcome="unknown", generation=generation)
            raise
        except RatchetError as exc:
            if stale:
                self.emit(
                    "stale_commit",
                    outcome="rejected",
                    generation=generation,
                    error=type(exc).__name__,
                )
            raise
        if stale:
            self.emit("stale_commit", outcome="accepted", generation=generation)
        for acked, blob in commits:
            self.emit("ack", generation=acked, digest=hashlib.sha256(blob).hexdigest())

    def write(self, send: Callable[[], _T], *, key: str | None, kind: str) -> _T:
        """Send an adapter write past the guard; log a stale attempt's outcome.

        Raises whatever ``send`` raises.
        """
        stale = self._zombie(WorkerPoint.AFTER_GUARD_BEFORE_ADAPTER)
        try:
            result = send()
        except RatchetError as exc:
            if stale:
                refused = isinstance(exc, FenceRejectedError)
                self.emit(
                    "stale_write",
                    outcome="refused" if refused else "failed",
                    key=key,
                    action_kind=kind,
                    error=type(exc).__name__,
                )
            raise
        if stale:
            self.emit("stale_write", outcome="accepted", key=key, action_kind=kind)
        self._wrote = True
        return result

    def observe(self) -> None:
        """Before an observation: the one right after a write fires ``observe_after_write``.

        Raises AdapterError (retryable) when that failpoint's ``raise`` fires.
        """
        if not self._wrote or self.points is None:
            return
        self._wrote = False
        try:
            self.points.fire(WorkerPoint.OBSERVE_AFTER_WRITE)
        except FailpointFired:
            raise AdapterError("observation failed (failpoint)", retryable=True) from None


class TripwireHooks(Hooks):
    """The executor's hooks for a job's tripwires: commits and adapter writes pass through
    :meth:`Tripwires.commit` and :meth:`Tripwires.write` (after the lease guard, before
    the port), and each observation first through :meth:`Tripwires.observe`."""

    def __init__(self, wires: Tripwires) -> None:
        self._wires = wires

    def around(self, effect: Effect, proceed: Callable[[], Any]) -> Any:
        wires = self._wires
        if isinstance(effect, Commit):
            commits = [(c.expected_generation + 1, c.blob) for c in effect.batch]
            wires.commit(proceed, commits=commits)
            return None
        if isinstance(effect, Execute):
            action = effect.action
            return wires.write(proceed, key=action.idempotency_key, kind=str(action.kind))
        if isinstance(effect, Observe):
            wires.observe()
        return proceed()


def probe_from_env() -> Failpoints | None:
    """The failpoints for ``RATCHET_FAILPOINTS`` (None when unset or empty)."""
    text = os.environ.get("RATCHET_FAILPOINTS", "")
    points = parse_failpoints(text)
    if not points:
        return None
    return Failpoints(points, os.environ.get("RATCHET_FAILPOINTS_LOG"))
