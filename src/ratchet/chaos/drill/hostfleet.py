"""One host of the multi-host drill: its namespace, its workers and its submitter.

Every worker is a real worker process (``hostproc worker``) started inside the host,
with the next failpoint spec of the host's own seeded :class:`Schedule` (SIGKILL at every
crash window; see :mod:`ratchet.chaos.drill.schedule`). A worker that died is replaced by
one with the next spec while the host is up; one whose spec did not fire in ``patience``
seconds is recycled (SIGTERM, its spec put back). The host's event log and failpoint log
live in ``events/<host>/`` of the drill folder, so every event is attributed to the host
of the worker that wrote it.

The submitter (``hostproc submitter``) is one long-lived process per life of the host; the
drill writes a request and polls for its answer (a reader thread puts each line it reads
on a queue), one request at a time.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ratchet.chaos.drill.hostns import HostNamespace
from ratchet.chaos.drill.schedule import Schedule

__all__ = ["DrillHost", "HostWorker", "operator_argv"]

_PYTHON = [sys.executable, "-m"]


def operator_argv(*args: str) -> list[str]:
    """``ratchet ARGS`` as an operator on a host runs it."""
    return [*_PYTHON, "ratchet.cli.entry", *args]


@dataclass
class HostWorker:
    proc: subprocess.Popen[bytes]
    spec: str
    started_at: float
    fired_at: float | None = None
    terminating_at: float | None = None


@dataclass
class DrillHost:
    """A host of the drill (see the module docstring)."""

    name: str
    ns: HostNamespace
    env: dict[str, str]  # every process of the host: the fleet's RATCHET_* settings
    folder: Path  # the drill folder
    schedule: Schedule
    workers: dict[int, HostWorker] = field(default_factory=dict)
    everyone: dict[int, str] = field(default_factory=dict)  # pid -> spec, every worker
    lives: int = 0
    started: int = 0
    deaths: list[dict[str, Any]] = field(default_factory=list)
    fired: list[dict[str, Any]] = field(default_factory=list)
    _fired_offset: int = 0
    submitter: subprocess.Popen[bytes] | None = None
    _replies: queue.Queue[str] = field(default_factory=queue.Queue)
    outstanding: dict[str, Any] | None = None  # the request the submitter is answering

    def __repr__(self) -> str:
        return f"DrillHost({self.name!r}, up={self.up}, workers={len(self.workers)})"

    @property
    def up(self) -> bool:
        return self.ns.up

    @property
    def events_dir(self) -> Path:
        return self.folder / "events" / self.name

    @property
    def logs_dir(self) -> Path:
        return self.folder / "logs" / self.name

    def start(self) -> None:
        """Bring the host up (a new namespace on its disk) with its submitter; workers
        are staffed by :meth:`staff`. Raises ConfigurationError."""
        self.events_dir.mkdir(parents=True, exist_ok=True)
        self.ns.start()
        self.lives += 1
        self._replies = queue.Queue()
        self.outstanding = None
        self.submitter = self.ns.popen(
            [*_PYTHON, "ratchet.chaos.drill.hostproc", "submitter"],
            env=self.env,
            log=self.logs_dir / f"submitter-{self.lives}.log",
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        out = self.submitter.stdout
        if out is not None:
            threading.Thread(
                target=_read_lines, args=(out, self._replies), daemon=True, name="submitter"
            ).start()

    def lose(self) -> list[int]:
        """Lose the host whole (every process SIGKILLed, its disk unmounted)."""
        self.read_fired()
        killed = self.ns.lose()
        now = time.time()
        for pid, worker in self.workers.items():
            self.deaths.append({"pid": pid, "at": now, "spec": worker.spec, "lost": True})
        self.workers.clear()
        if self.submitter is not None and self.submitter.stdin is not None:
            with contextlib.suppress(OSError):
                self.submitter.stdin.close()
        self.submitter = None
        self.outstanding = None
        return killed

    # -- workers ------------------------------------------------------------------------

    def staff(self, wanted: int, *, injecting: bool) -> None:
        """Start workers until ``wanted`` are active (the host must be up)."""
        while self.up and self._active() < wanted and len(self.workers) < wanted + 2:
            spec = self.schedule.next_spec() if injecting else ""
            env = dict(
                self.env,
                RATCHET_FAILPOINTS=spec,
                RATCHET_FAILPOINTS_LOG=os.fspath(self.events_dir / "failpoints.jsonl"),
                RATCHET_DRILL_EVENTS=os.fspath(self.events_dir),
            )
            proc = self.ns.popen(
                [*_PYTHON, "ratchet.chaos.drill.hostproc", "worker", str(self.started)],
                env=env,
                log=self.logs_dir / f"worker-{self.started}.log",
            )
            self.started += 1
            self.workers[proc.pid] = HostWorker(proc, spec, time.time())
            self.everyone[proc.pid] = spec

    def _active(self) -> int:
        return sum(1 for w in self.workers.values() if w.terminating_at is None)

    def reap(self, *, injecting: bool) -> list[HostWorker]:
        """Forget workers that exited (a spec that never fired is put back)."""
        self.read_fired()
        dead = [w for w in self.workers.values() if w.proc.poll() is not None]
        for worker in dead:
            del self.workers[worker.proc.pid]
            self.deaths.append(
                {
                    "pid": worker.proc.pid,
                    "at": time.time(),
                    "spec": worker.spec,
                    "exitcode": worker.proc.returncode,
                }
            )
            if worker.spec and worker.fired_at is None and injecting:
                self.schedule.put_back(worker.spec)
        self.ns.reap()
        return dead

    def recycle(self, patience_s: float, *, injecting: bool) -> None:
        """SIGTERM workers whose spec did not fire within ``patience_s`` (while specs are
        left to hand out); SIGKILL those that have not left 15 s after SIGTERM."""
        now = time.time()
        for worker in self.workers.values():
            idle = (
                injecting
                and worker.spec
                and worker.fired_at is None
                and worker.terminating_at is None
                and now - worker.started_at > patience_s
                and self.schedule.remaining > 0
            )
            if idle:
                worker.terminating_at = now
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.proc.pid, signal.SIGTERM)
            elif worker.terminating_at is not None and now - worker.terminating_at > 15.0:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.proc.pid, signal.SIGKILL)

    def read_fired(self) -> None:
        """Read the host's failpoint log from where it was read last."""
        path = self.events_dir / "failpoints.jsonl"
        if not path.exists():
            return
        with path.open("rb") as fh:
            fh.seek(self._fired_offset)
            data = fh.read()
        cut = data.rfind(b"\n") + 1
        self._fired_offset += cut
        for line in data[:cut].splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            self.fired.append(entry)
            worker = self.workers.get(int(entry.get("pid", 0)))
            if worker is not None:
                worker.fired_at = float(entry.get("at", time.time()))

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every worker, SIGKILL what has not left after ``grace_s``, then lose the
        namespace (its submitter and anything else in it)."""
        for worker in self.workers.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(
            w.proc.poll() is None for w in self.workers.values()
        ):
            time.sleep(0.05)
        self.reap(injecting=False)
        self.lose()

    # -- the submitter ------------------------------------------------------------------

    def ask(self, request: dict[str, Any]) -> bool:
        """Send one submit request (False: the submitter is busy or gone)."""
        proc = self.submitter
        if proc is None or proc.stdin is None or self.outstanding is not None:
            return False
        try:
            proc.stdin.write((json.dumps(request) + "\n").encode())
            proc.stdin.flush()
        except OSError:
            return False
        self.outstanding = {**request, "asked_at": time.time()}
        return True

    def answer(self) -> dict[str, Any] | None:
        """The submitter's answer to the outstanding request, when it has come."""
        try:
            line = self._replies.get_nowait()
        except queue.Empty:
            return None
        try:
            reply: dict[str, Any] = json.loads(line)
        except ValueError:
            reply = {"ok": False, "error": f"unreadable answer: {line[:200]!r}"}
        reply["request"] = self.outstanding
        self.outstanding = None
        return reply


def _read_lines(stream: IO[bytes], into: queue.Queue[str]) -> None:
    """Put every line of ``stream`` on ``into`` until its end (the submitter's exit)."""
    with contextlib.suppress(OSError, ValueError):
        for raw in iter(stream.readline, b""):
            into.put(raw.decode("utf-8", "replace"))
