"""Worker-process faults of a drill, as the runner follows them: the failpoints that fired,
the zombies a ``pause`` left, the workers recycled once their fault is spent, and two
workers started under one configured name (``owner-collision``).

Each worker process carries one failpoint spec of the schedule
(:mod:`ratchet.chaos.drill.schedule`); the failpoint fires inside the worker and appends
a line to the drill's fired log. What the drill does about it is here, called from its
tick (:mod:`ratchet.chaos.drill.runner`):

* the fired log is read incrementally: each failpoint's hits (the schedule aims later
  workers at the failpoints still short of theirs) and, per worker, what it fired and
  when (a ``pause`` also names the run and lease version it stopped on);
* a worker stopped by ``pause`` is a zombie: SIGCONT only once another worker has taken
  its run over (a higher lease version and progress, or the run settled), so its next
  write and commit are genuinely stale; past a bound it is resumed anyway;
* a worker whose fault was not lethal and fired, or that never fired while specs are
  left, is recycled (SIGTERM): the next spec needs a process;
* ``owner-collision``: two more workers started at once with :data:`TWIN_NAME`; a twin
  that died before it took any lease is started again (at most four times), since the
  fault needs both twins taking leases
  (:func:`ratchet.chaos.drill.storechecks.owner_collision_fenced` judges it).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from ratchet.chaos.drill.netfaults import Acquires
from ratchet.chaos.drill.workers import DrillWorker
from ratchet.errors import RatchetError

if TYPE_CHECKING:
    from ratchet.chaos.drill.runner import _Drill

__all__ = ["TWIN_NAME", "ProcessFaults"]

_LETHAL = ("kill",)
#: The configured name both workers of an owner-collision fault are started with.
TWIN_NAME = "drill-twin"


class ProcessFaults:
    """What the drill keeps of its workers' faults: how far it read the fired log, each
    failpoint's hits, who acquired which lease (to tell a twin that worked from one that
    died at start-up) and how often a twin was started again."""

    def __init__(self, events_dir: Path) -> None:
        self.fired_offset = 0
        self.hits: Counter[str] = Counter()  # failpoint -> hits, from the fired log
        self.acquires = Acquires(events_dir)  # which process took which lease
        self.twin_restarts = 0

    def read_fired(self, drill: _Drill) -> None:
        path = drill.rec.fired_log
        if not path.exists():
            return
        with path.open("rb") as fh:
            fh.seek(self.fired_offset)
            data = fh.read()
        cut = data.rfind(b"\n") + 1
        self.fired_offset += cut
        for line in data[:cut].splitlines():
            entry = json.loads(line)
            self.hits[str(entry.get("window"))] += 1
            worker = drill.pool.everyone.get(int(entry["pid"]))
            if worker is not None:
                worker.fired_at, worker.fired_action = float(entry["at"]), entry["action"]
                if entry["action"] == "pause":
                    worker.pause = {
                        "run_id": entry.get("run_id"),
                        "lease_version": entry.get("lease_version"),
                        "point": entry["window"],
                    }

    def watch_pauses(self, drill: _Drill) -> None:
        now = time.time()
        for worker in drill.pool.stopped():
            worker.paused_at = now
            run_id = worker.pause.get("run_id")
            if isinstance(run_id, str):
                try:
                    worker.pause["generation"] = drill.fleet.store.read_run(run_id).generation
                except RatchetError:
                    worker.pause["generation"] = None
        for worker in list(drill.pool.workers.values()):
            if worker.paused_at is None or worker.resumed_at is not None:
                continue
            if _taken_over(drill, worker) or now - worker.paused_at > 10 * drill.o.lease_ttl_s + 10:
                drill.pool.resume(worker)
                drill.rec.pauses.append(
                    {
                        "pid": worker.pid,
                        "paused_at": worker.paused_at,
                        "resumed_at": worker.resumed_at,
                        **worker.pause,
                    }
                )

    def recycle(self, drill: _Drill) -> None:
        now = time.time()
        patience = max(12.0, 12 * drill.o.lease_ttl_s)
        for worker in list(drill.pool.workers.values()):
            if worker.terminating_at is not None or (
                worker.paused_at is not None and worker.resumed_at is None
            ):
                continue
            spent = (
                worker.fired_at is not None
                and worker.fired_action not in _LETHAL
                and now - max(worker.fired_at, worker.resumed_at or 0) > 1.0
            )
            idle = (
                worker.fired_at is None
                and now - worker.started_at > patience
                and worker.spec != ""
                and drill.schedule.remaining > 0
            )
            if spent or idle:
                drill.pool.terminate(worker)
        drill.pool.enforce(grace_s=15.0)

    def respawn_twin(self, drill: _Drill, dead: DrillWorker) -> bool:
        """A twin that died before it took any lease (Redis was down at its epoch check,
        or its RQ loop quit on a Redis fault) is started again under the same name, at
        most four times: the fault needs both twins taking leases. Only a twin: the
        far-off worker also has a name of its own, and exiting at start-up is what it must
        do (started again without its skew, it ran jobs under its name)."""
        if dead.name != TWIN_NAME or not drill.injecting or self.twin_restarts >= 4:
            return False
        self.acquires.refresh()
        if dead.pid in self.acquires.owners.values():
            return False  # it took a lease: the fault had it
        self.twin_restarts += 1
        drill.rec.twins.append(drill.pool.spawn("", name=dead.name).pid)
        return True

    def owner_collision(self, drill: _Drill, now: float, fraction: float) -> None:
        """Two more workers, started at once with one configured worker name, once the
        fault is due and the Redis lane is quiet."""
        if (
            drill.schedule.owner_collision_at is not None
            and fraction >= drill.schedule.owner_collision_at
            and drill.holding is None
            and now - drill.last_redis_fault > 2.5  # twins check the store epoch at start
        ):
            drill.schedule.owner_collision_at = None
            for _ in range(2):
                drill.rec.twins.append(drill.pool.spawn("", name=TWIN_NAME).pid)
            drill.rec.store_faults.append(
                {"kind": "owner-collision", "at": time.time(), "pids": list(drill.rec.twins)}
            )


def _taken_over(drill: _Drill, worker: DrillWorker) -> bool:
    """The paused worker's run has a newer lease and moved on (or settled)."""
    run_id, version = worker.pause.get("run_id"), worker.pause.get("lease_version")
    if not isinstance(run_id, str) or not isinstance(version, int):
        return time.time() - (worker.paused_at or 0) > 3 * drill.o.lease_ttl_s
    try:
        snap = drill.fleet.store.read_run(run_id)
    except RatchetError:
        return False
    if snap.lease_version <= version:
        return False
    generation = worker.pause.get("generation")
    moved = not isinstance(generation, int) or snap.generation > generation
    return moved or not snap.lease_live
