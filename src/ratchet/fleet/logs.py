"""Structured logs: readable text by default, JSON lines on request.

``RATCHET_LOG_FORMAT=json`` makes every line one JSON object; anything else (or unset) is
text for a person. ``RATCHET_LOG_LEVEL`` picks the level (``INFO`` by default).

Every line about a run carries ``run_id``, ``lease_version``, ``generation`` and
``worker_id``. A job binds its run once it holds the lease (:func:`bind_run`) and moves
the generation after each commit (:func:`set_generation`); :class:`RunContextFilter`
adds those fields to every record logged by that job, by threads serving the same run
(the heartbeat names its run), and the worker id to every record of the process.

What a line may carry is a fixed list of fields (:data:`FIELDS`): ids, versions, reasons,
counters and exception class names. Nothing else from ``extra`` is written, so a key, a
checkpoint or a payload passed by mistake never reaches a log line; exception messages of
ratchet's own errors never carry key material either (see ``ratchet.errors``).
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any

__all__ = [
    "FIELDS",
    "JsonFormatter",
    "RunContextFilter",
    "TextFormatter",
    "bind_run",
    "configure_logging",
    "enter_run",
    "leave_run",
    "set_generation",
    "set_worker_id",
]

#: The fields a line may carry besides time, level, logger and message.
FIELDS = (
    "worker_id",
    "run_id",
    "lease_version",
    "generation",
    "reason",
    "outcome",
    "phase",
    "error",
    "kind",
    "port",
    "steps",
    "windows",
    "cause",
    "job_id",
)
_RUN_FIELDS = ("run_id", "lease_version", "generation")


@dataclass
class _RunContext:
    run_id: str
    lease_version: int | None
    generation: int | None


_current: contextvars.ContextVar[_RunContext | None] = contextvars.ContextVar(
    "ratchet_run_context", default=None
)
_by_run: dict[str, _RunContext] = {}
_lock = threading.Lock()
_worker_id: str | None = None


def set_worker_id(worker_id: str | None) -> None:
    """Name this process on every line (``<host>-<pid>``, the lease owner id)."""
    global _worker_id  # noqa: PLW0603 - one process, one worker id
    _worker_id = worker_id


def enter_run(
    run_id: str, *, lease_version: int | None, generation: int | None
) -> contextvars.Token[_RunContext | None]:
    """Attach a run to every line logged from here on (by this job and its heartbeat),
    until :func:`leave_run` with the returned token."""
    ctx = _RunContext(run_id, lease_version, generation)
    with _lock:
        _by_run[run_id] = ctx
    return _current.set(ctx)


def leave_run(token: contextvars.Token[_RunContext | None]) -> None:
    """Undo :func:`enter_run`."""
    ctx = _current.get()
    _current.reset(token)
    if ctx is not None:
        with _lock:
            if _by_run.get(ctx.run_id) is ctx:
                del _by_run[ctx.run_id]


@contextmanager
def bind_run(run_id: str, *, lease_version: int | None, generation: int | None) -> Iterator[None]:
    """Attach a run to every line logged inside the block (and by its heartbeat)."""
    ctx = _RunContext(run_id, lease_version, generation)
    token = _current.set(ctx)
    with _lock:
        _by_run[run_id] = ctx
    try:
        yield
    finally:
        _current.reset(token)
        with _lock:
            if _by_run.get(run_id) is ctx:
                del _by_run[run_id]


def set_generation(run_id: str, generation: int) -> None:
    """The run's generation moved (a commit landed)."""
    with _lock:
        ctx = _by_run.get(run_id)
        if ctx is not None:
            ctx.generation = generation


class RunContextFilter(logging.Filter):
    """Adds ``worker_id`` to every record, and the bound run's fields to records about it.

    A record about a run is one logged inside :func:`bind_run`, or one whose ``extra``
    names a ``run_id`` that is bound in this process (the heartbeat thread's lines).
    Fields passed explicitly in ``extra`` win.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "worker_id", None) is None:
            record.worker_id = _worker_id
        ctx = _current.get()
        named = getattr(record, "run_id", None)
        if isinstance(named, str) and (ctx is None or ctx.run_id != named):
            with _lock:
                ctx = _by_run.get(named)
            if ctx is None:
                return True
        if ctx is not None:
            for name in _RUN_FIELDS:
                if getattr(record, name, None) is None:
                    setattr(record, name, getattr(ctx, name))
        return True


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in FIELDS:
        value = getattr(record, name, None)
        if value is None:
            continue
        out[name] = value if isinstance(value, int | str | bool) else str(value)
    if record.exc_info and record.exc_info[0] is not None:
        out["exception"] = record.exc_info[0].__name__
    return out


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts``, ``level``, ``logger``, ``message`` and the
    allowed fields. Tracebacks are reduced to the exception class name."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        data.update(_fields(record))
        return json.dumps(data, sort_keys=False, separators=(",", ":"), default=str)


class TextFormatter(logging.Formatter):
    """``time level logger message key=value ...`` for a person at a terminal."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        record.message = record.getMessage()
        record.asctime = self.formatTime(record)
        head = self._style.format(record)
        pairs = " ".join(f"{k}={v}" for k, v in _fields(record).items())
        return f"{head} {pairs}" if pairs else head


def configure_logging(
    *,
    worker_id: str | None = None,
    stream: IO[str] | None = None,
    level: str | None = None,
    fmt: str | None = None,
) -> logging.Handler:
    """Install ratchet's handler on the root logger (replacing earlier handlers).

    ``fmt`` and ``level`` default to ``RATCHET_LOG_FORMAT`` and ``RATCHET_LOG_LEVEL``.
    Returns the handler.
    """
    set_worker_id(worker_id)
    chosen = (fmt or os.environ.get("RATCHET_LOG_FORMAT", "text")).strip().lower()
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if chosen == "json" else TextFormatter())
    handler.addFilter(RunContextFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel((level or os.environ.get("RATCHET_LOG_LEVEL", "INFO")).upper())
    return handler
