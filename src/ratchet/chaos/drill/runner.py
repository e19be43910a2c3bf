"""Run a drill: Redis, the orders service, workers, runs, and faults from the schedule.

Timeline of one drill (every wait is a poll with a deadline):

1. start a private ``redis-server`` (AOF, ``appendfsync always``; timestamps when the
   binary supports rollback) and the orders service, in the drill folder;
2. start W worker processes, each with the next failpoint spec of the schedule; submit
   runs, at most ``max_in_flight`` unsettled at a time, so faults land across the drill;
3. every tick: replace dead workers (next spec); notice workers stopped by a ``pause``
   failpoint, start a replacement, and SIGCONT the zombie only once another worker has
   taken its run over (a higher lease version and progress, or the run settled), so its
   next write and commit are genuinely stale; recycle (SIGTERM) workers whose spec was
   non-lethal and fired, or never fired; at fixed fractions of runs settled, ``kill -9``
   Redis and restart it, roll it back, and enqueue runs that already ended again;
4. when every run settled, or ``duration`` passed, stop injecting, resume any zombie,
   and let clean workers settle what is left within ``settle_bound_s``;
5. stop every process (``finally``, also on errors), then hand everything to the checker.

Every tick also scrapes each running worker's ``/metrics`` (a loopback port per worker,
from a block the drill picked; :mod:`ratchet.chaos.drill.scrape`), and the workers are
scraped once more before and while they stop, so the checker can hold the fleet's own
counters against what the drill saw.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import SecretStr
from redis.exceptions import RedisError

from ratchet.adapters.sandbox import for_own_verifiers
from ratchet.chaos.drill.cluster import RedisChoice, choose_redis, truncate_aof
from ratchet.chaos.drill.clustered import CLUSTER_FAULTS, ClusterStore
from ratchet.chaos.drill.humans import Humans
from ratchet.chaos.drill.netfaults import Acquires, NetFaults
from ratchet.chaos.drill.replicated import REPLICATED_FAULTS, TOPOLOGIES, ReplicatedStore
from ratchet.chaos.drill.reviewers import Reviewers
from ratchet.chaos.drill.schedule import FAULTS, Schedule
from ratchet.chaos.drill.scrape import MetricsWatch, free_port_block
from ratchet.chaos.drill.services import TenantOrders, drill_document, make_workspace
from ratchet.chaos.drill.storefaults import (
    CORRUPTIONS,
    Tmpfs,
    aof_write_ok,
    corrupt_run,
    effect_counts,
    lease_snapshot,
    lift_maxmemory,
    pause_redis,
    slow_redis,
    start_disk_full,
    start_maxmemory,
    store_refusal,
)
from ratchet.chaos.drill.workers import DrillWorker, WorkerPool
from ratchet.chaos.drill.workspacefaults import BUSY_TIMEOUT_MS, WorkspaceFaults
from ratchet.errors import ConfigurationError, RatchetError
from ratchet.fleet.context import JOB_FUNCTION, Fleet
from ratchet.fleet.settings import Settings
from ratchet.leasing import RedisStore
from ratchet.ops import cancel, create_run, inspect_run
from ratchet.ops.diagnosis import FREEZING_KINDS
from ratchet.redis_server import RedisServer
from ratchet.runtime import Phase
from ratchet.runtime.state import TERMINAL_PHASES

__all__ = ["DrillOptions", "DrillRecord", "classify_run", "run_drill_processes"]

_TICK_S = 0.05
_CUT_PATIENCE_S = 20.0  # how long an armed rollback waits for a commit after its cut


@dataclass
class _Cut:
    """An armed AOF rollback: its cut second, and every run's generation once the next
    second began (the rollback fires when one of them moves on)."""

    second: int
    deadline: float
    generations: dict[str, int] | None = None


_LETHAL = ("kill",)
#: The configured name both workers of an owner-collision fault are started with.
TWIN_NAME = "drill-twin"
#: Incidents that show a worker (or its reaper) refused a corrupted run's record.
REFUSAL_INCIDENTS = frozenset(
    {"restore_refused", "store_record_unreadable", "reaper_entry_refused"}
)


@dataclass
class DrillOptions:
    workers: int = 3
    runs: int = 24
    lease_ttl_s: float = 1.0
    duration_s: float = 240.0
    faults: frozenset[str] = frozenset(FAULTS)
    seed: int = 1
    folder: Path | None = None
    think_ms: int = 150
    redis_server: str | None = None
    max_in_flight: int | None = None
    # "replicated": a primary, a replica and Sentinels; redis-kill is a failover there
    # (ratchet.chaos.drill.replicated). "cluster": three masters and the queue's own Redis;
    # redis-kill is a master's crash and restart (ratchet.chaos.drill.clustered).
    # min_replicas_ack: the fleet's acknowledgement rule.
    topology: str = "single"
    min_replicas_ack: int = 0

    @property
    def ttl_ms(self) -> int:
        return max(50, round(self.lease_ttl_s * 1000))

    @property
    def settle_bound_s(self) -> float:
        """How long after injection stops a run may still be unsettled before it counts as
        stuck: a takeover (TTL + reaper tick) several times over, plus the run's own work."""
        return max(20.0, 15 * self.lease_ttl_s)


@dataclass
class DrillRecord:
    """What the runner saw and did; the checker reads it with the logs and the stores."""

    folder: Path
    options: DrillOptions
    redis: RedisChoice
    runs: dict[str, int] = field(default_factory=dict)
    redis_kills: list[float] = field(default_factory=list)
    failovers: list[dict[str, Any]] = field(default_factory=list)  # replicated topology
    master_kills: list[dict[str, Any]] = field(default_factory=list)  # cluster topology
    rollback: dict[str, Any] | None = None
    rollback_skipped: str | None = None
    duplicate_enqueues: list[dict[str, Any]] = field(default_factory=list)
    cancels: list[dict[str, Any]] = field(default_factory=list)  # operator cancels posted
    pauses: list[dict[str, Any]] = field(default_factory=list)
    deaths: list[dict[str, object]] = field(default_factory=list)
    specs_used: int = 0
    workers: list[dict[str, Any]] = field(default_factory=list)
    started_at: float = 0.0
    injection_ended_at: float = 0.0
    finished_at: float = 0.0
    final: dict[str, tuple[str, str]] = field(default_factory=dict)  # run -> (status, phase)
    errors: list[str] = field(default_factory=list)
    metrics: MetricsWatch | None = None
    # Store faults: each one injected (kind, times, what it saw), and those skipped (why).
    store_faults: list[dict[str, Any]] = field(default_factory=list)
    store_skipped: dict[str, str] = field(default_factory=dict)
    corrupted: dict[str, dict[str, Any]] = field(default_factory=dict)  # run -> corruption
    twins: list[int] = field(default_factory=list)  # pids started with one worker name
    wipe: dict[str, Any] | None = None
    # Network faults (ratchet.chaos.drill.netfaults): each injected, and those skipped.
    net_faults: list[dict[str, Any]] = field(default_factory=list)
    net_skipped: dict[str, str] = field(default_factory=dict)
    # Workspace faults (ratchet.chaos.drill.workspacefaults): each injected, and skipped.
    workspace_faults: list[dict[str, Any]] = field(default_factory=list)
    workspace_skipped: dict[str, str] = field(default_factory=dict)
    # Approvers and skewed clocks (ratchet.chaos.drill.humans): what was signed and posted.
    humans: dict[str, Any] = field(default_factory=dict)
    # Reviewers (ratchet.chaos.drill.reviewers): conflicts planted, decisions signed.
    reviews: dict[str, Any] = field(default_factory=dict)

    def faults_of(self, kind: str) -> list[dict[str, Any]]:
        return [f for f in self.store_faults if f.get("kind") == kind]

    @property
    def fired_log(self) -> Path:
        return self.folder / "failpoints.jsonl"

    @property
    def events_dir(self) -> Path:
        return self.folder / "events"


def _restore_queue_url(server: object, before: str | None) -> None:
    """Put back the queue URL a cluster drill set for its fleet (see run_drill)."""
    if not isinstance(server, ClusterStore):
        return
    if before is None:
        os.environ.pop("RATCHET_QUEUE_REDIS_URL", None)
    else:
        os.environ["RATCHET_QUEUE_REDIS_URL"] = before


def _check_topology(options: DrillOptions) -> None:
    """Raises ConfigurationError for a topology the drill does not know, or faults it
    cannot inject on it."""
    if options.topology not in TOPOLOGIES:
        raise ConfigurationError(
            f"unknown topology {options.topology!r}; known: {', '.join(TOPOLOGIES)}",
            field="topology",
        )
    if options.min_replicas_ack and options.topology != "replicated":
        raise ConfigurationError(
            "--min-replicas-ack needs --topology replicated", field="min_replicas_ack"
        )
    allowed = {"replicated": REPLICATED_FAULTS, "cluster": CLUSTER_FAULTS}.get(options.topology)
    if allowed is not None:
        other = sorted(options.faults - allowed)
        if other:
            raise ConfigurationError(
                f"faults {other} need a single Redis; the {options.topology} topology runs: "
                f"{', '.join(sorted(allowed))}",
                field="faults",
            )


def classify_run(fleet: Fleet, run_id: str) -> tuple[str, str]:
    """``(status, phase)``: status is terminal, waiting, frozen or active.

    Frozen: a restore was refused, or the last job that took the run refused it for
    another freezing reason (:data:`ratchet.ops.diagnosis.FREEZING_KINDS`, under the
    run's current lease version: the environment changed behind a pending write, say),
    the lease is free and the run is off the reaper's index, so nothing continues it
    until an operator acts. The checker then asks whether that freeze was expected.
    Raises RatchetError.
    """
    view = inspect_run(fleet, run_id)
    phase, snap = view.state.phase, view.snapshot
    if phase in TERMINAL_PHASES:
        return "terminal", phase.value
    if phase in (Phase.NEEDS_REVIEW, Phase.AWAITING_APPROVAL) and not snap.lease_live:
        return "waiting", phase.value
    refused = any(
        i.get("kind") == "restore_refused"
        or (i.get("kind") in FREEZING_KINDS and i.get("lease_version") == snap.lease_version)
        for i in view.incidents
    )
    if refused and not snap.lease_live and fleet.store.expiry_score(run_id) is None:
        return "frozen", phase.value
    return "active", phase.value


Progress = Callable[[str, int, int], None]


class _Drill:
    def __init__(
        self,
        options: DrillOptions,
        record: DrillRecord,
        server: RedisServer | ReplicatedStore | ClusterStore,
        orders: TenantOrders,
        fleet: Fleet,
        pool: WorkerPool,
        progress: Progress | None,
    ) -> None:
        self.o, self.rec, self.server, self.orders = options, record, server, orders
        self.fleet, self.pool, self.progress = fleet, pool, progress
        self.schedule = Schedule(seed=options.seed, faults=options.faults, runs=options.runs)
        self.rng = random.Random(options.seed + 7)  # noqa: S311 - reproducible, not secret
        self.settled: dict[str, tuple[str, str]] = {}
        self.fired_offset = 0
        self.hits: Counter[str] = Counter()  # failpoint -> hits, from the fired log
        self.pending: list[str] = []
        self.index: dict[str, int] = {}
        self.last_observe = 0.0
        self.quick_deaths = 0  # workers that exited at start-up in a row
        self.last_redis_fault = time.time()
        self.injecting = True
        self.cut: _Cut | None = None  # an armed AOF rollback
        self.disk: Tmpfs | None = None  # Redis' own tmpfs, for the disk-full fault
        self.holding: dict[str, Any] | None = None  # an OOM or disk-full fault in force
        self.twin_restarts = 0
        self.live_tries_until: dict[str, float] = {}  # a store fault waits for a live lease
        self.net: NetFaults | None = None  # proxies and network faults
        self.ws: WorkspaceFaults | None = None  # a locked journal, a full workspace disk
        self.acquires = Acquires(record.events_dir)  # which process took which lease
        self.humans = Humans(options.seed, options.runs, frozenset(), record.folder)
        self.reviewers = Reviewers(
            options.seed, options.runs, frozenset(), record.folder, frozenset()
        )

    # -- one tick -----------------------------------------------------------------------

    def tick(self) -> None:
        self._read_fired()  # first: a worker that fired "kill" is dead by now
        for dead in self.pool.reap_dead():
            if dead.spec and dead.fired_at is None and self.injecting:
                self.schedule.put_back(dead.spec)
            early = dead.fired_at is None and time.time() - dead.started_at < 5.0
            self.quick_deaths = self.quick_deaths + 1 if early else 0
            self._respawn_twin(dead)
        self._watch_pauses()
        self._recycle()
        self._staff()
        self._submit()
        self._observe()
        skip = set(self.rec.corrupted)
        self.humans.tick(
            self.fleet, self.pool, self.rec.runs, self.settled, skip, self.o.lease_ttl_s
        )
        self.reviewers.tick(self.fleet, self.settled, skip, self.rec.runs)
        if self.injecting:
            self._cluster_faults()
        self.scrape()

    def _respawn_twin(self, dead: DrillWorker) -> bool:
        """A twin that died before it took any lease (Redis was down at its epoch check,
        or its RQ loop quit on a Redis fault) is started again under the same name, at
        most four times: the fault needs both twins taking leases. Only a twin: the
        far-off worker also has a name of its own, and exiting at start-up is what it must
        do (started again without its skew, it ran jobs under its name)."""
        if dead.name != TWIN_NAME or not self.injecting or self.twin_restarts >= 4:
            return False
        self.acquires.refresh()
        if dead.pid in self.acquires.owners.values():
            return False  # it took a lease: the fault had it
        self.twin_restarts += 1
        self.rec.twins.append(self.pool.spawn("", name=dead.name).pid)
        return True

    def scrape(self) -> None:
        """Scrape every running worker's metrics once (each request bounded)."""
        if self.rec.metrics is not None:
            self.rec.metrics.scrape(self.pool.scrapable())

    def _read_fired(self) -> None:
        path = self.rec.fired_log
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
            worker = self.pool.everyone.get(int(entry["pid"]))
            if worker is not None:
                worker.fired_at, worker.fired_action = float(entry["at"]), entry["action"]
                if entry["action"] == "pause":
                    worker.pause = {
                        "run_id": entry.get("run_id"),
                        "lease_version": entry.get("lease_version"),
                        "point": entry["window"],
                    }

    def _watch_pauses(self) -> None:
        now = time.time()
        for worker in self.pool.stopped():
            worker.paused_at = now
            run_id = worker.pause.get("run_id")
            if isinstance(run_id, str):
                try:
                    worker.pause["generation"] = self.fleet.store.read_run(run_id).generation
                except RatchetError:
                    worker.pause["generation"] = None
        for worker in list(self.pool.workers.values()):
            if worker.paused_at is None or worker.resumed_at is not None:
                continue
            if self._taken_over(worker) or now - worker.paused_at > 10 * self.o.lease_ttl_s + 10:
                self.pool.resume(worker)
                self.rec.pauses.append(
                    {
                        "pid": worker.pid,
                        "paused_at": worker.paused_at,
                        "resumed_at": worker.resumed_at,
                        **worker.pause,
                    }
                )

    def _taken_over(self, worker: DrillWorker) -> bool:
        """The paused worker's run has a newer lease and moved on (or settled)."""
        run_id, version = worker.pause.get("run_id"), worker.pause.get("lease_version")
        if not isinstance(run_id, str) or not isinstance(version, int):
            return time.time() - (worker.paused_at or 0) > 3 * self.o.lease_ttl_s
        try:
            snap = self.fleet.store.read_run(run_id)
        except RatchetError:
            return False
        if snap.lease_version <= version:
            return False
        generation = worker.pause.get("generation")
        moved = not isinstance(generation, int) or snap.generation > generation
        return moved or not snap.lease_live

    def _recycle(self) -> None:
        now = time.time()
        patience = max(12.0, 12 * self.o.lease_ttl_s)
        for worker in list(self.pool.workers.values()):
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
                and self.schedule.remaining > 0
            )
            if spent or idle:
                self.pool.terminate(worker)
        self.pool.enforce(grace_s=15.0)

    def _staff(self) -> None:
        while self.pool.active < self.o.workers and len(self.pool.workers) < self.o.workers + 4:
            spec = self.schedule.next_spec(self.hits, self._fraction()) if self.injecting else ""
            self.rec.specs_used += bool(spec)
            self.humans.spawn(self.pool, spec)

    def create_runs(self) -> None:
        """Create every run up front (not enqueued yet): a later AOF rollback then never
        cuts a run out of existence, only back to an earlier checkpoint."""
        for index in range(self.o.runs):
            root = make_workspace(self.rec.folder / "workspaces" / f"ws-{index}")
            url = self.orders.add(f"t{index}")
            run_id = f"drill-{self.o.seed}-{index}"
            self.reviewers.plant(run_id, index, url)  # before the run sees its environment
            if self.net is not None:
                url = self.net.orders_url(index, url)
            approval = index in self.humans.need_approval
            doc = drill_document(root, url, index, think_ms=self.o.think_ms, approval=approval)
            create_run(self.fleet, doc, run_id=run_id)
            self.pending.append(run_id)
            self.index[run_id] = index

    def _submit(self) -> None:
        # While worker or network faults are still to come, keep few runs in flight so the
        # runs last as long as the schedule does (a fault needs a run in progress to land
        # in).
        net_due = (self.net is not None and self.net.pending) or (
            self.ws is not None and self.ws.pending
        )
        due = self.schedule.remaining or net_due
        limit = self.o.max_in_flight or (self.o.workers + 1 if due else 2 * self.o.workers)
        while self.pending:
            # Down to its reserve, or while a Redis fault that fell due waits for the lane,
            # the drill keeps at most two runs in flight: the fraction of runs settled does
            # not run ahead of the lane, and the fault still has a run in flight to hit.
            cap = min(limit, 2) if self._down_to_reserve() or self._redis_backlog() else limit
            # A corrupted run holds no place: it may wait long for a worker to refuse it.
            flying = [r for r in self.rec.runs if r not in self.settled]
            if len([r for r in flying if r not in self.rec.corrupted]) >= cap:
                break
            run_id = self.pending[0]
            try:
                self.fleet.enqueue(run_id)
            except (RedisError, RatchetError) as exc:
                self.rec.errors.append(f"enqueue {run_id}: {type(exc).__name__}")
                return
            self.pending.pop(0)
            self.rec.runs[run_id] = self.index[run_id]

    def faults_to_come(self) -> int:
        """Faults still to fire (or in force) that need a run in flight to land in: the
        store faults, the rollback, the network and the workspace faults, and (two at
        most) the failpoints still short of their hits."""
        count = len(self.schedule.store_faults_at) + (self.holding is not None)
        count += self._rollback_pending()
        if self.net is not None:
            count += len(self.net.wanted) + sum(f is not None for f in self.net.lanes.values())
        if self.ws is not None:
            count += len(self.ws.wanted) + (self.ws.active is not None) + len(self.ws.grading)
        # A failpoint still short of its hits needs runs left for its aimed worker to land
        # in: keep a run or two back for it, as for a fault.
        return count + min(2, self.schedule.short(self.hits))

    def _down_to_reserve(self) -> bool:
        """Whether the runs not yet enqueued are no more than the faults still to come.
        Then each fault is due at once (in its order, one at a time on the Redis lane) and
        at most two runs are in flight: the faults queue behind each other on the Redis
        lane (one at a time, spaced), and without a reserve, on a fast machine, every run
        had settled before the last of them found anything to hit."""
        if not self.injecting:
            return False
        to_come = self.faults_to_come()
        return to_come > 0 and len(self.pending) <= to_come

    def _redis_backlog(self) -> bool:
        """Whether a Redis fault (store fault, partition, rollback) is in force, or fell
        due and has not fired yet."""
        if not self.injecting:
            return False
        fraction = self._fraction()
        store = self.schedule.store_faults_at
        rollback = self.schedule.rollback_at
        return (
            self.holding is not None
            or self.cut is not None
            or bool(store and fraction >= store[0][1])
            or (self.net is not None and self.net.redis_turn(fraction, 1.0))
            or (self._rollback_pending() and rollback is not None and fraction >= rollback)
        )

    def _rollback_pending(self) -> bool:
        """The schedule has a rollback that has neither happened nor been skipped."""
        return (
            self.schedule.rollback_at is not None
            and self.rec.rollback is None
            and self.rec.rollback_skipped is None
        )

    def _fault_clock(self) -> float:
        """The fraction the faults' schedule is read at: the fraction of runs settled, or
        1.0 (everything due) once the drill is down to its reserve of runs."""
        return 1.0 if self._down_to_reserve() else self._fraction()

    def _observe(self) -> None:
        now = time.time()
        if now - self.last_observe < 0.2:
            return
        self.last_observe = now
        for run_id in [r for r in self.rec.runs if r not in self.settled]:
            if run_id in self.rec.corrupted:
                refused = self._corruption_refused(run_id)
                if refused is not None:
                    self.settled[run_id] = ("corrupted", refused)
                    continue
            try:
                status = classify_run(self.fleet, run_id)
            except RatchetError:
                continue  # Redis restarting, or mid-rollback: look again next tick
            if status[0] != "active":
                self.settled[run_id] = status
        if self.progress is not None:
            label = "injecting" if self.injecting else "settling"
            self.progress(label, len(self.settled), self.o.runs)

    def _fraction(self) -> float:
        return len(self.settled) / max(self.o.runs, 1)

    # -- cluster faults -------------------------------------------------------------------

    def _cluster_faults(self) -> None:
        now, fraction = time.time(), self._fault_clock()
        if (
            self.schedule.redis_kills_at
            and fraction >= self.schedule.redis_kills_at[0]
            and now - self.last_redis_fault > 2
            and self.holding is None  # a restart would drop an OOM or disk-full fault's setup
            and not (
                self.net is not None
                and self.net.redis_turn(fraction, self.schedule.redis_kills_at[0])
            )
        ):
            self.schedule.redis_kills_at.pop(0)
            if isinstance(self.server, ReplicatedStore):
                # The primary dies for good; Sentinel promotes the replica, and the killed
                # server comes back as its replica.
                self.rec.failovers.append(self.server.failover(sorted(self.rec.runs)))
            elif isinstance(self.server, ClusterStore):
                # The master with the most runs in flight crashes and comes back on its
                # AOF; the runs of the other masters' slots go on meanwhile.
                self.rec.master_kills.append(self.server.kill_master(sorted(self.unsettled())))
            else:
                self.server.kill()
                time.sleep(0.2)  # down long enough for workers to notice
                self.server.start()
            self.rec.redis_kills.append(now)
            self.last_redis_fault = time.time()
            # No runbook step: a job lost with Redis (or with the worker that popped it) is
            # handed out again by the reaper when the run's pickup deadline passes.
        if (
            self.schedule.rollback_at is not None
            and self.rec.rollback is None
            and self.rec.rollback_skipped is None
            and fraction >= self.schedule.rollback_at
        ):
            if self.rec.redis.check_aof is None:
                self.rec.rollback_skipped = self.rec.redis.rollback_skip_reason
            elif self.cut is not None:
                self._rollback_when_a_commit_follows_the_cut(self.rec.redis.check_aof)
            elif now - self.last_redis_fault > 2.5 and not (
                self.net is not None and self.net.redis_turn(fraction, self.schedule.rollback_at)
            ):
                self.cut = _Cut(second=int(now), deadline=now + _CUT_PATIENCE_S)
        if (
            len(self.rec.duplicate_enqueues) < self.schedule.duplicate_enqueues
            and self.rng.random() < 0.05
        ):
            done = sorted(
                r
                for r, (s, _) in self.settled.items()
                if s == "terminal" and r not in {d["run_id"] for d in self.rec.duplicate_enqueues}
            )
            if done:
                self._duplicate(self.rng.choice(done))
        if self.schedule.cancels_at and fraction >= self.schedule.cancels_at[0]:
            self._cancel_one()
        if (
            self.schedule.owner_collision_at is not None
            and fraction >= self.schedule.owner_collision_at
            and self.holding is None
            and now - self.last_redis_fault > 2.5  # twins check the store epoch at start
        ):
            self.schedule.owner_collision_at = None
            self._owner_collision()
        self._store_faults(now, fraction)
        if self.net is not None:
            self.net.tick(self, now, fraction)
        if self.ws is not None:
            self.ws.tick(self, now, fraction)

    # -- store faults ---------------------------------------------------------------------

    @property
    def store_faults_pending(self) -> bool:
        return bool(self.schedule.store_faults_at) or self.holding is not None

    def _store_faults(self, now: float, fraction: float) -> None:
        """The next store fault once its fraction of runs settled is reached, spaced from
        every other Redis fault and never while a rollback cut is armed (the AOF it cuts
        must not hold a fault's own writes)."""
        if self.holding is not None:
            if now >= float(self.holding["lift_at"]):
                self._lift()
            return
        due = self.schedule.store_faults_at
        if not due or fraction < due[0][1] or self.cut is not None:
            return
        if self.net is not None and self.net.redis_turn(fraction, due[0][1]):
            return  # a partition in force, or one due first
        if now - self.last_redis_fault <= 2.5:
            return
        kind = due[0][0]
        ttl = self.o.lease_ttl_s
        client = self.fleet.store.client
        if kind in ("redis-pause", "redis-slow"):
            live = lease_snapshot(client, sorted(self.unsettled()))
            until = self.live_tries_until.setdefault(kind, now + 60.0)
            if not live and (self.unsettled() or self.pending) and now < until:
                # Wait for a run that holds a lease, so the pause expires one and the slowed
                # store has commits to acknowledge (runs spend stretches between jobs, and
                # the next run may not be enqueued yet).
                return
        if kind == "redis-pause" and isinstance(self.server, RedisServer):  # single Redis only
            fault = pause_redis(
                self.server, client, sorted(self.unsettled()), hold_s=max(2 * ttl, ttl + 1.0)
            )
            fault["unsettled"] = sorted(self.unsettled())
            self.rec.store_faults.append(fault)
        elif kind == "redis-slow":
            fault = slow_redis(client, sleeps=6, sleep_s=min(0.25, ttl / 4), gap_s=0.3)
            if fault["refused"] and not fault["sleeps"]:
                self.rec.store_skipped[kind] = f"DEBUG SLEEP refused: {fault['refused']}"
            self.rec.store_faults.append(fault)
        elif kind == "maxmemory":
            fault = start_maxmemory(client)
            self._hold(fault, hold_s=max(2.0, 2 * ttl))
        elif kind == "disk-full":
            if self.disk is None or not self.disk.mounted:
                self.rec.store_skipped[kind] = self.rec.store_skipped.get(
                    kind, "Redis' folder is not on a tmpfs of its own"
                )
            else:
                fault = start_disk_full(client, self.disk)
                self._hold(fault, hold_s=max(2.0, 2 * ttl))
        elif kind == "corrupt-record" and not self._corrupt_some(now):
            return  # no run with a free lease yet: try again next tick
        due.pop(0)
        self.last_redis_fault = time.time()

    def unsettled(self) -> set[str]:
        return {r for r in self.rec.runs if r not in self.settled}

    def _hold(self, fault: dict[str, Any], hold_s: float) -> None:
        """Probe until Redis refuses a write of the drill's own (bounded), then keep the
        fault in force for ``hold_s`` while the drill goes on ticking."""
        client = self.fleet.store.client
        deadline = time.time() + 3.0
        refused = store_refusal(client)
        while refused is None and time.time() < deadline:
            time.sleep(_TICK_S)  # the write that fails the AOF is buffered; the next is refused
            refused = store_refusal(client)
        fault["refused"] = refused
        fault["unsettled"] = sorted(self.unsettled())
        fault["lift_at"] = time.time() + hold_s
        self.holding = fault
        self.rec.store_faults.append(fault)

    def _lift(self) -> None:
        """End the OOM or disk-full fault in force; Redis must accept writes again."""
        fault, self.holding = self.holding, None
        if fault is None:
            return
        client = self.fleet.store.client
        if fault["kind"] == "maxmemory":
            lift_maxmemory(client, fault)
        else:
            disk = self.disk
            if disk is not None:
                disk.free()
            deadline = time.time() + 15.0
            while time.time() < deadline:
                if not self.server.running:
                    fault["redis_exited"] = True
                    self.server.start()
                    break
                try:
                    if aof_write_ok(client):
                        break
                except RedisError:
                    pass
                time.sleep(_TICK_S)
            client.config_set("appendfsync", "always")
            fault["aof_ok"] = aof_write_ok(client)
            fault["ended_at"] = time.time()
        self.last_redis_fault = time.time()

    def _corrupt_some(self, now: float) -> bool:
        """Corrupt one run per kind of :data:`CORRUPTIONS`, each a run nobody holds: first
        runs in flight, else runs not yet enqueued. False when none could be had."""
        zombies = {
            w.pause.get("run_id")
            for w in self.pool.everyone.values()
            if w.paused_at is not None and w.resumed_at is None
        }
        asked = {c["run_id"] for c in self.rec.cancels}
        # A run waiting for the drill's reviewer is nobody's: spared, or its review is lost.
        spared = zombies | asked | set(self.reviewers.log["runs"])
        in_flight = sorted(self.unsettled() - spared)
        self.rng.shuffle(in_flight)
        waiting = [r for r in self.pending if r not in spared][: len(CORRUPTIONS)]
        done: list[dict[str, Any]] = []
        for how in CORRUPTIONS:
            for run_id in [*in_flight, *reversed(waiting)]:
                if run_id in self.rec.corrupted:
                    continue
                got = corrupt_run(self.fleet.store.client, run_id, how)
                if got is None:
                    continue
                got["index"] = self.index[run_id]
                got["enqueued"] = run_id in self.rec.runs
                got["effects"] = effect_counts(self.rec.folder, self.index[run_id])
                self.rec.corrupted[run_id] = got
                done.append(got)
                break
        if not done:
            return False
        self.rec.store_faults.append({"kind": "corrupt-record", "at": now, "runs": done})
        return True

    def _corruption_refused(self, run_id: str) -> str | None:
        """The kind of the first incident recorded for ``run_id`` since its corruption
        that shows a worker refused it; None while there is none."""
        since = int(self.rec.corrupted[run_id]["at_ms"])
        try:
            incidents = self.fleet.store.incidents(run_id)
        except RatchetError:
            return None
        for incident in incidents:
            kind = str(incident.get("kind"))
            if kind in REFUSAL_INCIDENTS and int(incident.get("at_ms") or 0) >= since:
                self.rec.corrupted[run_id].setdefault("refusal", incident)
                return kind
        return None

    def _owner_collision(self) -> None:
        """Two more workers, started at once with one configured worker name."""
        for _ in range(2):
            self.rec.twins.append(self.pool.spawn("", name=TWIN_NAME).pid)
        self.rec.store_faults.append(
            {"kind": "owner-collision", "at": time.time(), "pids": list(self.rec.twins)}
        )

    def _cancel_one(self) -> None:
        """An operator cancels a run still in flight, as ``ratchet cancel`` does: the
        request goes to the run's inbox and a worker ends the run at its next safe
        point. A run that cannot be cancelled right now (it just ended, or is under
        review) is passed over; the next tick tries another."""
        asked = {c["run_id"] for c in self.rec.cancels} | set(self.rec.corrupted)
        candidates = sorted(r for r in self.rec.runs if r not in self.settled and r not in asked)
        if not candidates:
            return
        run_id = self.rng.choice(candidates)
        try:
            posted = cancel(
                self.fleet, run_id, reason="drill: an operator ends the run", operator="drill"
            )
        except RatchetError:
            return
        self.schedule.cancels_at.pop(0)
        self.rec.cancels.append(
            {
                "run_id": run_id,
                "at": time.time(),
                "request_id": posted.request.request_id,
                "phase": posted.phase,
                "held_by": posted.held_by,
            }
        )

    def _generations(self, runs: Iterable[str]) -> dict[str, int]:
        """Every readable run's generation. A run whose record the drill corrupted may not
        be readable at all; it is left out (nothing the rollback does can move it)."""
        out: dict[str, int] = {}
        for run_id in runs:
            if run_id in self.rec.corrupted:
                continue
            out[run_id] = self.fleet.store.read_run(run_id).generation
        return out

    def _rollback_when_a_commit_follows_the_cut(self, check_aof: str) -> None:
        """Roll back once a run has committed after the armed cut (whole seconds, as AOF
        timestamps are), so the rollback really rewinds a run and the invariant it
        exercises is judged, not left unknown.

        The cut is armed, not waited for: every tick meanwhile still resumes zombies and
        respawns workers, so a fleet that is all paused or dead when the cut is chosen
        commits again. Past the deadline the rollback happens anyway (and may rewind
        nothing: its invariant is then unknown).
        """
        cut, now = self.cut, time.time()
        if cut is None or now < cut.second + 1:
            return
        if cut.generations is None:  # the first look once the next second has begun
            cut.generations = self._generations(self.index)
            return
        moved = any(g > cut.generations.get(r, g) for r, g in self._generations(self.index).items())
        if moved or now > cut.deadline:
            self._rollback(check_aof, cut.second)

    def _rollback(self, check_aof: str, cut: int) -> None:
        before = self._generations(self.rec.runs)
        killed_at = time.time()
        self.server.kill()
        output = truncate_aof(check_aof, self.server.data_dir, cut)
        self.server.start()
        after = self._generations(self.rec.runs)
        rewound = {r: [before[r], after[r]] for r in before if after.get(r, 0) < before[r]}
        self.rec.rollback = {
            "at": time.time(),
            "killed_at": killed_at,
            "cut_s": cut,
            "rewound": rewound,
            "tool": output[-200:],
        }
        self.cut = None
        self.last_redis_fault = time.time()
        # The queue was rolled back too: hand every unfinished run to the workers again.
        for run_id in self.rec.runs:
            self.settled.pop(run_id, None)
            self.fleet.enqueue(run_id)

    def _duplicate(self, run_id: str) -> None:
        try:
            view = inspect_run(self.fleet, run_id)
            self.fleet.enqueue(run_id)
            self.fleet.enqueue(run_id)
        except RatchetError:
            return
        self.rec.duplicate_enqueues.append(
            {
                "run_id": run_id,
                "at": time.time(),
                "generation": view.generation,
                "phase": view.state.phase.value,
            }
        )

    # -- the whole drill ------------------------------------------------------------------

    def run(self) -> None:
        start = time.time()
        while time.time() - start < self.o.duration_s:
            self._guarded_tick()
            everything_done = len(self.rec.runs) == self.o.runs and len(self.settled) == self.o.runs
            zombies = any(
                w.paused_at is not None and w.resumed_at is None for w in self.pool.workers.values()
            )
            if (
                everything_done
                and not zombies
                and (
                    self.rec.rollback is not None
                    or self.schedule.rollback_at is None
                    or self.rec.rollback_skipped is not None
                )
                and not self.store_faults_pending
                and self.schedule.owner_collision_at is None
                and (self.net is None or not self.net.pending)
                and (self.ws is None or not self.ws.pending)
            ):
                break
            time.sleep(_TICK_S)
        self.injecting = False
        if self.net is not None:
            self.net.end()
        if self.ws is not None:
            self.ws.end()
            self.rec.errors.extend(self.ws.errors)
        if self.holding is not None:
            try:
                self._lift()
            except (RatchetError, RedisError, OSError) as exc:
                self.rec.errors.append(f"lift {self.holding and self.holding['kind']}: {exc!r}")
        self.rec.injection_ended_at = time.time()
        for worker in list(self.pool.workers.values()):
            if worker.paused_at is not None and worker.resumed_at is None:
                self.pool.resume(worker)
                self.rec.pauses.append(
                    {
                        "pid": worker.pid,
                        "paused_at": worker.paused_at,
                        "resumed_at": worker.resumed_at,
                        **worker.pause,
                    }
                )
            if worker.spec:
                self.pool.terminate(worker)  # faults stop: clean workers settle the rest
        settle_end = time.time() + self.o.settle_bound_s
        while time.time() < settle_end:
            self._guarded_tick()
            if len(self.settled) == len(self.rec.runs):
                break
            time.sleep(_TICK_S)

    # -- the store wipe, after everything else ---------------------------------------------

    def _quiet(self) -> bool:
        """Nothing can start on the old store: the queues are empty, no lease is live and
        the reaper's index has no entry due (so every event after the wipe is the wipe's)."""
        client = self.fleet.store.client
        indexed = self.fleet.store.expiry_members()
        return (
            all(queue.count == 0 for queue in self.fleet.all_queues())
            and not lease_snapshot(client, sorted(self.rec.runs))
            and not indexed - set(self.rec.corrupted)  # a corrupted run may stay parked
        )

    def wipe_store(self) -> None:
        """Restart Redis on an empty folder (its old folder kept aside), put every old run
        on the queue again (RQ only: the fresh store knows no run), and watch the workers
        refuse the store: no epoch. The old folder comes back in :meth:`unwipe`."""
        deadline = time.time() + max(10.0, 5 * self.o.lease_ttl_s)
        quiet = False
        while time.time() < deadline:
            self._guarded_tick()
            try:
                quiet = self._quiet()
            except (RatchetError, RedisError):
                quiet = False
            if quiet:
                break
            time.sleep(_TICK_S)
        self.rec.final = self.final_classification()
        effects = {r: effect_counts(self.rec.folder, i) for r, i in self.rec.runs.items()}
        old_dir = self.server.data_dir
        fresh = old_dir.parent / f"redis-wiped-{secrets.token_hex(4)}"
        at = time.time()
        self.server.kill()
        self.server.data_dir = fresh
        self.server.start()
        wipe: dict[str, Any] = {
            "at": at,
            "quiet": quiet,
            "old_dir": str(old_dir),
            "fresh_dir": str(fresh),
            "effects_before": effects,
            "enqueued": 0,
        }
        self.rec.wipe = wipe
        queue = self.fleet.queue
        for run_id in sorted(self.rec.runs):
            try:
                queue.enqueue(JOB_FUNCTION, run_id, job_timeout=self.fleet.settings.job_timeout_s)
                wipe["enqueued"] += 1
            except RedisError as exc:
                self.rec.errors.append(f"enqueue after wipe {run_id}: {type(exc).__name__}")
        end = time.time() + max(10.0, 5 * self.o.lease_ttl_s)
        while time.time() < end:
            self.pool.reap_dead()  # a worker refusing to start on this store is expected
            if self.pool.active == 0 and not self.pool.workers:
                self.pool.spawn("")  # a new worker must refuse the store too
            self.scrape()
            try:
                if queue.count == 0 and time.time() - at > 2.0:
                    break
            except RedisError:
                pass
            time.sleep(_TICK_S)
        client = self.fleet.store.client
        keys = [
            k.decode("utf-8", "replace") for k in client.scan_iter(match="ratchet:*", count=500)
        ]
        wipe["store_keys"] = sorted(keys)[:50]
        wipe["run_keys"] = sorted(k for k in keys if k.startswith("ratchet:{"))[:50]
        wipe["ended_at"] = time.time()

    def unwipe(self) -> None:
        """Bring the old store back (its folder as it was at the wipe) for the checker."""
        if self.rec.wipe is None:
            return
        self.rec.wipe["effects_after"] = {
            r: effect_counts(self.rec.folder, i) for r, i in self.rec.runs.items()
        }
        self.server.kill()
        self.server.data_dir = Path(self.rec.wipe["old_dir"])
        self.server.start()

    def final_classification(self) -> dict[str, tuple[str, str]]:
        final: dict[str, tuple[str, str]] = {}
        for run_id in self.rec.runs:
            if run_id in self.rec.corrupted and run_id in self.settled:
                final[run_id] = self.settled[run_id]
                continue
            try:
                final[run_id] = classify_run(self.fleet, run_id)
            except RatchetError as exc:
                final[run_id] = ("unreadable", type(exc).__name__)
        return final

    def _guarded_tick(self) -> None:
        if self.ws is not None:
            try:
                self.ws.release_due(time.time())
            except OSError as exc:
                self.rec.errors.append(f"workspace release: {type(exc).__name__}: {exc}"[:300])
        try:
            self.tick()
        except (RatchetError, RedisError, OSError) as exc:
            self.rec.errors.append(f"tick: {type(exc).__name__}: {exc}"[:300])
        if self.quick_deaths >= 3 * self.o.workers + 10:
            raise ConfigurationError(
                "worker processes keep exiting at start-up; see the logs folder of the drill",
                folder=str(self.rec.folder),
            )


def run_drill_processes(
    options: DrillOptions, *, progress: Progress | None = None
) -> tuple[DrillRecord, Fleet, Any]:
    """Run the drill; returns the record, a fleet on the drill's Redis and a ``close``
    callable (the checker reads the stores before everything stops). Processes are stopped
    in ``finally`` on any error. Raises ConfigurationError on a bad setup."""
    folder = (
        Path(options.folder)
        if options.folder is not None
        else Path(tempfile.mkdtemp(prefix="ratchet-drill-"))
    )
    folder.mkdir(parents=True, exist_ok=True)
    _check_topology(options)
    choice = choose_redis(options.redis_server, want_rollback="rollback" in options.faults)
    record = DrillRecord(folder=folder, options=options, redis=choice)
    disk: Tmpfs | None = None
    redis_dir = folder / "redis"
    if "disk-full" in options.faults:
        disk = Tmpfs(folder / f"redis-tmpfs-{secrets.token_hex(4)}")
        skipped = disk.mount()
        if skipped is None:
            redis_dir = disk.point
        else:
            record.store_skipped["disk-full"] = skipped
    server: Any
    try:
        if options.topology == "replicated":
            server = ReplicatedStore(redis_dir, executable=choice.executable).start()
        elif options.topology == "cluster":
            server = ClusterStore(redis_dir, executable=choice.executable).start()
        else:
            server = choice.server(redis_dir).start()
        RedisStore(server.client()).init_epoch()
    except BaseException:
        if disk is not None:
            disk.unmount()
        raise
    queue_url_before = os.environ.get("RATCHET_QUEUE_REDIS_URL")
    orders: TenantOrders | None = None
    pool: WorkerPool | None = None
    net: NetFaults | None = None
    ws = WorkspaceFaults(options.faults, folder, ttl_s=options.lease_ttl_s)
    record.workspace_faults, record.workspace_skipped = ws.faults, ws.skipped
    try:
        ws.mount()
        orders = TenantOrders(folder / "orders", process=True)
        ttl = options.ttl_ms
        humans = Humans(options.seed, options.runs, options.faults, folder)
        record.humans = humans.log
        reviewers = Reviewers(
            options.seed, options.runs, options.faults, folder, humans.need_approval
        )
        record.reviews = reviewers.log
        if isinstance(server, ClusterStore):
            # RQ cannot use a Cluster: the queue is on the store's own extra Redis. The
            # drill's fleet and every worker it spawns (which copy this environment)
            # read it from here; close() puts the variable back.
            os.environ["RATCHET_QUEUE_REDIS_URL"] = server.queue_url
        settings = Settings(
            redis_url=SecretStr(server.url),
            state_dir=folder / "state",
            queue=f"drill-{options.seed}",
            lease_ttl_ms=ttl,
            renew_interval_ms=max(ttl // 3, 50),
            stall_timeout_ms=max(20 * ttl, 20_000),
            reaper_interval_ms=max(ttl // 5, 50),
            job_timeout_s=max(600, ttl // 100),
            pickup_timeout_ms=max(3 * ttl, 1000),
            checkpoint_key=SecretStr(secrets.token_hex(32)),
            worker_name="drill",
            verifier_sandbox=for_own_verifiers(),
            approvers_file=humans.approvers_file,
            reviewers_file=reviewers.reviewers_file,
            workspace_busy_timeout_ms=BUSY_TIMEOUT_MS,
            min_replicas_ack=options.min_replicas_ack,
            replicas_ack_timeout_ms=max(50, ttl // 4),
        )  # the drill's verifier is its own grep
        fleet = Fleet.connect(settings)
        record.events_dir.mkdir(parents=True, exist_ok=True)
        block = options.workers + 6  # live workers never exceed workers + 4
        record.metrics = MetricsWatch(free_port_block(block), block)
        pool = WorkerPool(
            settings,
            folder,
            fired_log=record.fired_log,
            events_dir=record.events_dir,
            metrics=record.metrics,
        )
        record.started_at = time.time()
        drill = _Drill(options, record, server, orders, fleet, pool, progress)
        drill.disk = disk
        net = NetFaults(
            options.faults, server, orders, events_dir=record.events_dir, ttl_s=options.lease_ttl_s
        )
        record.net_faults, record.net_skipped = net.faults, net.skipped
        if net.wanted:
            drill.net = net
            if net.link_redis:
                pool.redis_link = net.redis_link
        drill.humans = humans
        drill.reviewers = reviewers
        if ws.wanted:
            drill.ws = ws
        drill.create_runs()
        created = int(time.time())
        while int(time.time()) <= created + 1:  # creations sit before any later AOF cut
            time.sleep(_TICK_S)
        drill.run()
        if drill.schedule.store_wipe:
            drill.wipe_store()  # last: it ends the old runs' store
        record.workers = [
            {"pid": w.pid, "spec": w.spec, "fired": w.fired_action} for w in pool.everyone.values()
        ]
        drill.scrape()  # the last counts of every worker still running
        pool.stop_all(while_waiting=drill.scrape)
        record.deaths = pool.deaths
        drill.unwipe()
        if record.wipe is None:
            record.final = drill.final_classification()
        record.finished_at = time.time()
    except BaseException:
        _restore_queue_url(server, queue_url_before)
        if pool is not None:
            pool.stop_all(grace_s=2.0)
        if net is not None:
            net.stop()
        if orders is not None:
            orders.stop()
        server.kill()
        if disk is not None:
            disk.unmount()
        ws.close()
        raise
    final_orders, final_server, final_net = orders, server, net

    def close() -> None:
        try:
            _restore_queue_url(server, queue_url_before)
            if final_net is not None:
                final_net.stop()
            final_orders.stop()
            final_server.stop()
        finally:
            if disk is not None:
                disk.unmount()
            ws.close()

    return record, fleet, close
