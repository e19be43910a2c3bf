"""Faults that take the drill's Redis down and bring it back: ``redis-kill``, ``rollback``
and ``store-wipe``. Each is a restart with something different on disk afterwards.

* **redis-kill**, at fixed fractions of the runs settled: ``kill -9`` and a restart on
  the same folder (the AOF, ``appendfsync always``, keeps every acknowledged write). In
  the replicated topology the primary dies for good and Sentinel promotes the replica;
  in the cluster topology the master holding the most runs in flight crashes and comes
  back. No runbook step: a job lost with Redis is handed out again by the reaper when the
  run's pickup deadline passes;
* **rollback**: Redis cut back to an earlier second of its AOF
  (:func:`ratchet.chaos.drill.cluster.truncate_aof`). The cut is armed first, and the
  rollback waits until some run has committed after it, so the rollback really rewinds
  a run (past :data:`_CUT_PATIENCE_S` it happens anyway, and may rewind nothing). The
  queue is rolled back with the store: every run enqueued so far is enqueued again and
  counts as unsettled until the drill sees it settle once more;
* **store-wipe**, once every run settled: Redis restarted on an empty folder, the old
  runs put on the queue again (RQ only: the fresh store knows no run), and every worker
  must refuse a store without its epoch. The old folder is brought back for the checker.

The Redis lane is the runner's drill's (its armed ``cut``, the store fault ``holding``
Redis, the time of the ``last_redis_fault``): a kill or a cut waits for the store faults
and partitions that hold it, and for the spacing after the last Redis fault.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from ratchet.chaos.drill.cluster import truncate_aof
from ratchet.chaos.drill.clustered import ClusterStore
from ratchet.chaos.drill.replicated import ReplicatedStore
from ratchet.chaos.drill.storefaults import effect_counts, lease_snapshot
from ratchet.errors import RatchetError
from ratchet.fleet.context import JOB_FUNCTION

if TYPE_CHECKING:
    from ratchet.chaos.drill.runner import _Drill

__all__ = ["Cut", "kill_redis", "roll_back", "unwipe", "wipe_store"]

_CUT_PATIENCE_S = 20.0  # how long an armed rollback waits for a commit after its cut
_POLL_S = 0.05  # as often as the drill ticks


@dataclass
class Cut:
    """An armed AOF rollback: its cut second, and every run's generation once the next
    second began (the rollback fires when one of them moves on)."""

    second: int
    deadline: float
    generations: dict[str, int] | None = None


def kill_redis(drill: _Drill, now: float, fraction: float) -> None:
    """The next Redis kill once its fraction is reached and the Redis lane is free."""
    if (
        drill.schedule.redis_kills_at
        and fraction >= drill.schedule.redis_kills_at[0]
        and now - drill.last_redis_fault > 2
        and drill.holding is None  # a restart would drop an OOM or disk-full fault's setup
        and not (
            drill.net is not None
            and drill.net.redis_turn(fraction, drill.schedule.redis_kills_at[0])
        )
    ):
        drill.schedule.redis_kills_at.pop(0)
        if isinstance(drill.server, ReplicatedStore):
            # The primary dies for good; Sentinel promotes the replica, and the killed
            # server comes back as its replica.
            drill.rec.failovers.append(drill.server.failover(sorted(drill.rec.runs)))
        elif isinstance(drill.server, ClusterStore):
            # The master with the most runs in flight crashes and comes back on its
            # AOF; the runs of the other masters' slots go on meanwhile.
            drill.rec.master_kills.append(drill.server.kill_master(sorted(drill.unsettled())))
        else:
            drill.server.kill()
            time.sleep(0.2)  # down long enough for workers to notice
            drill.server.start()
        drill.rec.redis_kills.append(now)
        drill.last_redis_fault = time.time()
        # No runbook step: a job lost with Redis (or with the worker that popped it) is
        # handed out again by the reaper when the run's pickup deadline passes.


def roll_back(drill: _Drill, now: float, fraction: float) -> None:
    """Once the rollback is due: skip it (no ``redis-check-aof`` able to cut), arm its
    cut, or, once armed, roll back when a commit followed the cut."""
    if (
        drill.schedule.rollback_at is not None
        and drill.rec.rollback is None
        and drill.rec.rollback_skipped is None
        and fraction >= drill.schedule.rollback_at
    ):
        if drill.rec.redis.check_aof is None:
            drill.rec.rollback_skipped = drill.rec.redis.rollback_skip_reason
        elif drill.cut is not None:
            _rollback_when_a_commit_follows_the_cut(drill, drill.rec.redis.check_aof)
        elif now - drill.last_redis_fault > 2.5 and not (
            drill.net is not None and drill.net.redis_turn(fraction, drill.schedule.rollback_at)
        ):
            drill.cut = Cut(second=int(now), deadline=now + _CUT_PATIENCE_S)


def _generations(drill: _Drill, runs: Iterable[str]) -> dict[str, int]:
    """Every readable run's generation. A run whose record the drill corrupted may not
    be readable at all; it is left out (nothing the rollback does can move it)."""
    out: dict[str, int] = {}
    for run_id in runs:
        if run_id in drill.rec.corrupted:
            continue
        out[run_id] = drill.fleet.store.read_run(run_id).generation
    return out


def _rollback_when_a_commit_follows_the_cut(drill: _Drill, check_aof: str) -> None:
    """Roll back once a run has committed after the armed cut (whole seconds, as AOF
    timestamps are), so the rollback really rewinds a run and the invariant it
    exercises is judged, not left unknown.

    The cut is armed, not waited for: every tick meanwhile still resumes zombies and
    respawns workers, so a fleet that is all paused or dead when the cut is chosen
    commits again. Past the deadline the rollback happens anyway (and may rewind
    nothing: its invariant is then unknown).
    """
    cut, now = drill.cut, time.time()
    if cut is None or now < cut.second + 1:
        return
    if cut.generations is None:  # the first look once the next second has begun
        cut.generations = _generations(drill, drill.index)
        return
    moved = any(g > cut.generations.get(r, g) for r, g in _generations(drill, drill.index).items())
    if moved or now > cut.deadline:
        _rollback(drill, check_aof, cut.second)


def _rollback(drill: _Drill, check_aof: str, cut: int) -> None:
    before = _generations(drill, drill.rec.runs)
    killed_at = time.time()
    drill.server.kill()
    output = truncate_aof(check_aof, drill.server.data_dir, cut)
    drill.server.start()
    after = _generations(drill, drill.rec.runs)
    rewound = {r: [before[r], after[r]] for r in before if after.get(r, 0) < before[r]}
    drill.rec.rollback = {
        "at": time.time(),
        "killed_at": killed_at,
        "cut_s": cut,
        "rewound": rewound,
        "tool": output[-200:],
    }
    drill.cut = None
    drill.last_redis_fault = time.time()
    # The queue was rolled back too: hand every unfinished run to the workers again.
    for run_id in drill.rec.runs:
        drill.settled.pop(run_id, None)
        drill.fleet.enqueue(run_id)


# -- the store wipe, after everything else -------------------------------------------------


def _quiet(drill: _Drill) -> bool:
    """Nothing can start on the old store: the queues are empty, no lease is live and
    the reaper's index has no entry due (so every event after the wipe is the wipe's)."""
    client = drill.fleet.store.client
    indexed = drill.fleet.store.expiry.expiry_members()
    return (
        all(queue.count == 0 for queue in drill.fleet.all_queues())
        and not lease_snapshot(client, sorted(drill.rec.runs))
        and not indexed - set(drill.rec.corrupted)  # a corrupted run may stay parked
    )


def wipe_store(drill: _Drill) -> None:
    """Restart Redis on an empty folder (its old folder kept aside), put every old run
    on the queue again (RQ only: the fresh store knows no run), and watch the workers
    refuse the store: no epoch. The old folder comes back in :func:`unwipe`."""
    deadline = time.time() + max(10.0, 5 * drill.o.lease_ttl_s)
    quiet = False
    while time.time() < deadline:
        drill.guarded_tick()
        try:
            quiet = _quiet(drill)
        except (RatchetError, RedisError):
            quiet = False
        if quiet:
            break
        time.sleep(_POLL_S)
    drill.rec.final = drill.final_classification()
    effects = {r: effect_counts(drill.rec.folder, i) for r, i in drill.rec.runs.items()}
    old_dir = drill.server.data_dir
    fresh = old_dir.parent / f"redis-wiped-{secrets.token_hex(4)}"
    at = time.time()
    drill.server.kill()
    drill.server.data_dir = fresh
    drill.server.start()
    wipe: dict[str, Any] = {
        "at": at,
        "quiet": quiet,
        "old_dir": str(old_dir),
        "fresh_dir": str(fresh),
        "effects_before": effects,
        "enqueued": 0,
    }
    drill.rec.wipe = wipe
    queue = drill.fleet.queue
    for run_id in sorted(drill.rec.runs):
        try:
            queue.enqueue(JOB_FUNCTION, run_id, job_timeout=drill.fleet.settings.job_timeout_s)
            wipe["enqueued"] += 1
        except RedisError as exc:
            drill.rec.errors.append(f"enqueue after wipe {run_id}: {type(exc).__name__}")
    end = time.time() + max(10.0, 5 * drill.o.lease_ttl_s)
    while time.time() < end:
        drill.pool.reap_dead()  # a worker refusing to start on this store is expected
        if drill.pool.active == 0 and not drill.pool.workers:
            drill.pool.spawn("")  # a new worker must refuse the store too
        drill.scrape()
        try:
            if queue.count == 0 and time.time() - at > 2.0:
                break
        except RedisError:
            pass
        time.sleep(_POLL_S)
    client = drill.fleet.store.client
    keys = [k.decode("utf-8", "replace") for k in client.scan_iter(match="ratchet:*", count=500)]
    wipe["store_keys"] = sorted(keys)[:50]
    wipe["run_keys"] = sorted(k for k in keys if k.startswith("ratchet:{"))[:50]
    wipe["ended_at"] = time.time()


def unwipe(drill: _Drill) -> None:
    """Bring the old store back (its folder as it was at the wipe) for the checker."""
    if drill.rec.wipe is None:
        return
    drill.rec.wipe["effects_after"] = {
        r: effect_counts(drill.rec.folder, i) for r, i in drill.rec.runs.items()
    }
    drill.server.kill()
    drill.server.data_dir = Path(drill.rec.wipe["old_dir"])
    drill.server.start()
