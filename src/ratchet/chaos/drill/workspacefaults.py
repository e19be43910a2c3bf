"""Adapter-side faults on the drill's workspaces: a journal another process keeps locked,
and the workspaces' disk full.

Each run's workspace adapter keeps its journal in SQLite (:mod:`ratchet.adapters.journal`);
the drill's workers wait :data:`BUSY_TIMEOUT_MS` for its lock
(``RATCHET_WORKSPACE_BUSY_TIMEOUT_MS``), then the call fails with a retryable
``AdapterError`` and the job ends ``retry_later`` (its lease left to expire, the reaper
hands the run on). Both faults fire at a fraction of the runs settled, one at a time in a
lane of their own (they touch neither Redis nor the orders service):

* ``sqlite-busy``: the journal of one run whose lease is live, held by a running worker
  (its ``acquire`` event names the process; not dead with its lease still ticking, not
  paused), and whose second write is still to come, is opened by the drill and held in
  ``BEGIN EXCLUSIVE`` for :func:`hold_s`; then released. Its job meets the lock mid-run,
  and the jobs after it as they open the journal;
* ``workspace-full``: every run's workspace lives on one tmpfs the drill mounts (root
  only; otherwise skipped with the reason). At a moment such a run exists, the tmpfs is
  shrunk to what is in use and filled: file writes fail with ``ENOSPC``, journal writes
  with ``SQLITE_FULL``. Freed after :func:`hold_s`.

Each fault is recorded in ``DrillRecord.workspace_faults`` with what it held and when; a
grace of the busy timeout + 1 s after it ended, the drill reads the jobs that ended
meanwhile from the event logs (``job_end``, with its outcome and detail): a fault no job
met is tried again, at most twice. The checker
(:mod:`ratchet.chaos.drill.workspacechecks`) judges by those jobs' identities. At the end
the tmpfs' contents are copied back to ``workspaces/`` and it is unmounted.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import sqlite3
import time
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError

from ratchet.chaos.drill.netfaults import Acquires
from ratchet.chaos.drill.storefaults import Tmpfs, effect_counts, lease_snapshot

__all__ = [
    "BUSY_TIMEOUT_MS",
    "WORKSPACE_FAULTS",
    "WORKSPACE_FAULTS_AT",
    "WorkspaceFaults",
    "failed_on_storage",
    "grace_s",
    "hold_s",
    "job_ends",
    "met_the_fault",
    "retried",
]

#: The workspace faults, each at a fraction of the runs settled.
WORKSPACE_FAULTS_AT = (("sqlite-busy", 0.22), ("workspace-full", 0.4))
WORKSPACE_FAULTS = tuple(kind for kind, _ in WORKSPACE_FAULTS_AT)
#: The drill's workers' ``RATCHET_WORKSPACE_BUSY_TIMEOUT_MS``.
BUSY_TIMEOUT_MS = 1000
_PATIENCE_S = 60.0
_RETRIES = 2
#: What a job that met either fault ends with: ``retry_later`` and one of these details.
_WORKSPACE_DETAILS = (
    "workspace journal failed",
    "workspace journal cannot be opened",
    "workspace write failed",
)
_STORAGE = re.compile(r"sqlite|database|disk|No space|OperationalError|OSError", re.IGNORECASE)


def hold_s(ttl_s: float) -> float:
    """How long a fault is held: long enough for a job to meet it, give up and be
    handed on (its lease expires) and the next job to meet it again."""
    return max(3.0, 3 * ttl_s)


def grace_s() -> float:
    """After a fault ended, how long a job that met it may take to log its end."""
    return BUSY_TIMEOUT_MS / 1000 + 1.0


def retried(event: dict[str, Any]) -> bool:
    """A ``job_end`` event of a job that met a workspace fault as it should: it ended
    ``retry_later`` with the workspace's retryable failure."""
    return event.get("outcome") == "retry_later" and str(event.get("detail", "")).startswith(
        _WORKSPACE_DETAILS
    )


def failed_on_storage(event: dict[str, Any]) -> bool:
    """A ``job_end`` event of a job that met a workspace fault and ended as a job error
    (or poisoned the run) on it: what a storage failure that is not typed retryable
    does."""
    return event.get("outcome") in ("job_error", "poisoned") and bool(
        _STORAGE.search(str(event.get("detail", "")))
    )


def met_the_fault(event: dict[str, Any]) -> bool:
    """A ``job_end`` event of a job that met a workspace fault, either way."""
    return retried(event) or failed_on_storage(event)


def job_ends(events_dir: Path, since: float, until: float) -> list[dict[str, Any]]:
    """Every ``job_end`` event logged between ``since`` and ``until`` (drill clock; a
    skewed worker's few seconds do not matter at this grain)."""
    out: list[dict[str, Any]] = []
    for path in sorted(events_dir.glob("events-*.jsonl")):
        with contextlib.suppress(OSError):
            for line in path.read_bytes().splitlines():
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                at = event.get("at")
                if (
                    event.get("kind") == "job_end"
                    and isinstance(at, int | float)
                    and since <= at <= until
                ):
                    out.append(event)
    return out


class WorkspaceFaults:
    """The drill's workspace faults (see the module docstring). ``tick`` never blocks for
    long; ``end`` releases whatever is held; ``close`` keeps the tmpfs' contents and
    unmounts it."""

    def __init__(self, faults: frozenset[str], folder: Path, *, ttl_s: float) -> None:
        self.folder, self.ttl_s = folder, ttl_s
        self.wanted = [(k, at) for k, at in WORKSPACE_FAULTS_AT if k in faults]
        self.disk: Tmpfs | None = None
        self.active: dict[str, Any] | None = None
        self.grading: list[dict[str, Any]] = []  # released, their jobs not read yet
        self.lock: sqlite3.Connection | None = None
        self.waiting_since: float | None = None
        self.tries: dict[str, int] = {}
        self.last_look = 0.0
        self.faults: list[dict[str, Any]] = []
        self.skipped: dict[str, str] = {}
        self.errors: list[str] = []  # a release that failed at the end, for the record
        self.acquires = Acquires(folder / "events")

    def __repr__(self) -> str:
        return f"WorkspaceFaults(due={[k for k, _ in self.wanted]}, disk={self.disk!r})"

    @property
    def root(self) -> Path:
        """Where the runs' workspaces are made."""
        return self.folder / "workspaces"

    def mount(self) -> None:
        """With ``workspace-full`` wanted, put the workspaces on a tmpfs of their own (or
        record why not: the fault is then skipped)."""
        if not any(k == "workspace-full" for k, _ in self.wanted):
            return
        disk = Tmpfs(self.root, size_mb=256, what="the workspaces' disk")
        why = disk.mount()
        if why is None:
            self.disk = disk
        else:
            self.skipped["workspace-full"] = why
            self.wanted = [w for w in self.wanted if w[0] != "workspace-full"]

    @property
    def pending(self) -> bool:
        return bool(self.wanted) or self.active is not None or bool(self.grading)

    # -- the faults -----------------------------------------------------------------------

    def tick(self, drill: Any, now: float, fraction: float) -> None:
        """Read the jobs of the faults whose grace passed, release the fault in force once
        held long enough, or start the next one once it is due. ``drill`` is the runner's
        drill (its fleet, pool, runs and settled runs)."""
        for fault in [f for f in self.grading if now - f["ended_at"] >= grace_s()]:
            self._grade(drill, fault)
        if self.active is not None:
            self.release_due(now)
            return
        if not self.wanted or fraction < self.wanted[0][1] or now - self.last_look < 0.2:
            return
        self.last_look = now
        kind = self.wanted[0][0]
        since = self.waiting_since = self.waiting_since or now
        started = self._start(drill, kind, now)
        if started or now - since > _PATIENCE_S or not (drill.unsettled() or drill.pending):
            if not started:
                self.skipped[kind] = (
                    f"no run held a live lease with a write to come within {_PATIENCE_S:.0f} s"
                    if now - since > _PATIENCE_S
                    else "every run settled before it found something to hit"
                )
            self.wanted.pop(0)
            self.waiting_since = None

    def release_due(self, now: float) -> None:
        """Release the fault in force once it has been held long enough. The runner calls
        this on its own, ahead of its tick, so a tick that keeps failing earlier (Redis
        down) cannot keep a journal locked or the disk full. Raises OSError (the fault
        then stays in force and the next call tries again)."""
        if self.active is not None and now - self.active["at"] >= self.active["hold_s"]:
            self._release(self.active)
            self.grading.append(self.active)
            self.active = None

    def targets(self, drill: Any) -> list[dict[str, Any]]:
        """Live leases of unsettled, uncorrupted runs whose second write is still to come,
        held by a worker that is running (not dead with its lease still ticking, not
        paused), not held up elsewhere (:meth:`_elsewhere`): its job calls the workspace
        next, or soon. Each with its ``pid``."""
        runs = sorted(drill.unsettled() - set(drill.rec.corrupted) - self._elsewhere(drill))
        try:
            live = lease_snapshot(drill.fleet.store.client, runs)
        except RedisError:
            return []
        self.acquires.refresh()
        running = {
            w.pid
            for w in drill.pool.workers.values()
            if w.paused_at is None and w.proc.exitcode is None
        }
        out = []
        for lease in live:
            pid = self.acquires.owners.get((lease["run_id"], lease["lease_version"]))
            if pid not in running:
                continue
            counts = effect_counts(self.folder, drill.index[lease["run_id"]])
            if 0 <= counts["workspace"] < 2:
                out.append({**lease, "pid": pid})
        return out

    def _elsewhere(self, drill: Any) -> set[str]:
        """Runs a job of which is held up elsewhere now (its orders link cut, the orders
        service down: its worker is not calling the workspace) or that this fault kind
        already held without any job meeting it."""
        out = {str(f["run_id"]) for f in self.faults if not f.get("jobs_met")}
        out |= {str(f["run_id"]) for f in self.grading}
        net = getattr(drill, "net", None)
        for fault in net.lanes.values() if net is not None else ():
            if fault is not None and fault.get("kind") in ("partition-adapter", "orders-kill"):
                out |= {str(fault.get("run_id"))} | {str(r) for r in fault.get("runs_at_order", [])}
        return out

    def _start(self, drill: Any, kind: str, now: float) -> bool:
        live = self.targets(drill)
        if not live:
            return False
        lease = drill.rng.choice(live)
        index = drill.index[lease["run_id"]]
        fault: dict[str, Any] = {
            "kind": kind,
            "run_id": lease["run_id"],
            "index": index,
            "lease_version": lease["lease_version"],
            "pid": lease["pid"],
            "live_runs": sorted(x["run_id"] for x in live),
            "hold_s": hold_s(self.ttl_s),
        }
        if kind == "sqlite-busy":
            journal = self.root / f"ws-{index}" / ".ratchet" / "journal.sqlite3"
            try:
                lock = sqlite3.connect(journal, timeout=0.5, isolation_level=None)
                try:
                    lock.execute("BEGIN EXCLUSIVE")
                except sqlite3.Error:
                    lock.close()
                    raise
            except sqlite3.Error:
                return False  # a writer holds it this instant: look again next tick
            self.lock = lock
        else:
            if self.disk is None:
                return False
            try:
                fault["filler_bytes"] = self.disk.fill()
            except OSError as exc:
                self.skipped[kind] = f"the workspaces' tmpfs could not be filled: {exc}"
                return True
        fault["at"] = time.time()
        self.active = fault
        return True

    def _release(self, fault: dict[str, Any]) -> None:
        if fault["kind"] == "sqlite-busy":
            if self.lock is not None:
                with contextlib.suppress(sqlite3.Error):
                    self.lock.rollback()
                self.lock.close()
                self.lock = None
        elif self.disk is not None:
            self.disk.free()
        fault["ended_at"] = time.time()

    def _grade(self, drill: Any, fault: dict[str, Any]) -> None:
        """Record ``fault`` with the jobs that met it; one no job met is tried again."""
        self.grading.remove(fault)
        ends = job_ends(drill.rec.events_dir, fault["at"], fault["ended_at"] + grace_s())
        fault["jobs_met"] = [
            {k: e.get(k) for k in ("run_id", "lease_version", "pid", "at", "outcome", "detail")}
            for e in ends
            if met_the_fault(e)
            and (fault["kind"] == "workspace-full" or e.get("run_id") == fault["run_id"])
        ]
        self.faults.append(fault)
        kind = fault["kind"]
        tries = self.tries.get(kind, 0)
        if not fault["jobs_met"] and tries < _RETRIES and drill.injecting:
            # No job called the workspace while it was held (its worker was killed or
            # paused right after, the run ended): again, on whatever run is live then.
            self.tries[kind] = tries + 1
            self.wanted.insert(0, (kind, 0.0))

    def end(self) -> None:
        """Injection is over: release what is held; the jobs of the faults not graded yet
        are read by the checker (``jobs_met`` None)."""
        if self.active is not None:
            try:
                self._release(self.active)
            except OSError as exc:
                self.errors.append(f"release {self.active['kind']}: {exc}"[:300])
            self.grading.append(self.active)
            self.active = None
        for fault in self.grading:
            fault["jobs_met"] = None
            self.faults.append(fault)
        self.grading = []
        for kind, _ in self.wanted:
            self.skipped.setdefault(kind, "injection ended before it was due")
        self.wanted = []

    def close(self) -> None:
        """Keep the workspaces (copied off the tmpfs into ``workspaces/``) and unmount."""
        if self.lock is not None:
            self.lock.close()
            self.lock = None
        disk = self.disk
        if disk is None or not disk.mounted:
            return
        kept = self.folder / "workspaces.kept"
        with contextlib.suppress(OSError):
            disk.filler.unlink(missing_ok=True)
            shutil.copytree(self.root, kept, symlinks=True)
        disk.unmount()
        if kept.exists() and not self.root.exists():
            kept.rename(self.root)
