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

This module keeps the timeline, the pacing of runs and the Redis lane (at most one Redis
fault in force: ``holding`` or an armed ``cut``, each spaced from ``last_redis_fault``).
Each family of faults is injected from the tick by its own module: the workers'
failpoints, zombies and twins (:mod:`~ratchet.chaos.drill.processfaults`); Redis killed,
rolled back or wiped (:mod:`~ratchet.chaos.drill.restartfaults`); the store paused,
slowed, full or corrupted (:mod:`~ratchet.chaos.drill.storefaults`); runs enqueued again
or cancelled (:mod:`~ratchet.chaos.drill.operatorfaults`); partitions
(:mod:`~ratchet.chaos.drill.netfaults`); the workspaces' locked journal and full disk
(:mod:`~ratchet.chaos.drill.workspacefaults`); approvers and reviewers
(:mod:`~ratchet.chaos.drill.humans`, :mod:`~ratchet.chaos.drill.reviewers`). What the
drill is asked and what it records are :mod:`~ratchet.chaos.drill.plan`'s.
"""

from __future__ import annotations

import os
import random
import secrets
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import SecretStr
from redis.exceptions import RedisError

from ratchet.adapters.sandbox import for_own_verifiers
from ratchet.chaos.drill.cluster import choose_redis
from ratchet.chaos.drill.clustered import CLUSTER_FAULTS, ClusterStore
from ratchet.chaos.drill.humans import Humans
from ratchet.chaos.drill.netfaults import NetFaults
from ratchet.chaos.drill.operatorfaults import cancel_one, enqueue_again
from ratchet.chaos.drill.plan import DrillOptions, DrillRecord
from ratchet.chaos.drill.processfaults import ProcessFaults
from ratchet.chaos.drill.replicated import REPLICATED_FAULTS, TOPOLOGIES, ReplicatedStore
from ratchet.chaos.drill.restartfaults import Cut, kill_redis, roll_back, unwipe, wipe_store
from ratchet.chaos.drill.reviewers import Reviewers
from ratchet.chaos.drill.schedule import Schedule
from ratchet.chaos.drill.scrape import MetricsWatch, free_port_block
from ratchet.chaos.drill.services import TenantOrders, drill_document, make_workspace
from ratchet.chaos.drill.storefaults import StoreFaults, Tmpfs
from ratchet.chaos.drill.workers import WorkerPool
from ratchet.chaos.drill.workspacefaults import BUSY_TIMEOUT_MS, WorkspaceFaults
from ratchet.errors import ConfigurationError, RatchetError
from ratchet.fleet.context import Fleet
from ratchet.fleet.settings import Settings
from ratchet.leasing import RedisStore
from ratchet.ops import create_run, inspect_run
from ratchet.ops.diagnosis import FREEZING_KINDS
from ratchet.redis_server import RedisServer
from ratchet.runtime import Phase
from ratchet.runtime.state import TERMINAL_PHASES

__all__ = ["DrillOptions", "DrillRecord", "classify_run", "run_drill_processes"]

_TICK_S = 0.05


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
    if refused and not snap.lease_live and fleet.store.expiry.expiry_score(run_id) is None:
        return "frozen", phase.value
    return "active", phase.value


Progress = Callable[[str, int, int], None]


class _Drill:
    """One drill in progress: its processes, its runs and their pacing, and what every
    fault family reads and writes of it (each family's own state is its own)."""

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
        self.pending: list[str] = []
        self.index: dict[str, int] = {}
        self.last_observe = 0.0
        self.quick_deaths = 0  # workers that exited at start-up in a row
        self.last_redis_fault = time.time()
        self.injecting = True
        self.cut: Cut | None = None  # an armed AOF rollback
        self.holding: dict[str, Any] | None = None  # an OOM or disk-full fault in force
        self.processes = ProcessFaults(record.events_dir)  # failpoints, zombies, twins
        self.store_faults = StoreFaults()  # paused, slowed, full or corrupted store
        self.net: NetFaults | None = None  # proxies and network faults
        self.ws: WorkspaceFaults | None = None  # a locked journal, a full workspace disk
        self.humans = Humans(options.seed, options.runs, frozenset(), record.folder)
        self.reviewers = Reviewers(
            options.seed, options.runs, frozenset(), record.folder, frozenset()
        )

    # -- one tick -----------------------------------------------------------------------

    def tick(self) -> None:
        self.processes.read_fired(self)  # first: a worker that fired "kill" is dead by now
        for dead in self.pool.reap_dead():
            if dead.spec and dead.fired_at is None and self.injecting:
                self.schedule.put_back(dead.spec)
            early = dead.fired_at is None and time.time() - dead.started_at < 5.0
            self.quick_deaths = self.quick_deaths + 1 if early else 0
            self.processes.respawn_twin(self, dead)
        self.processes.watch_pauses(self)
        self.processes.recycle(self)
        self._staff()
        self._submit()
        self._observe()
        skip = set(self.rec.corrupted)
        self.humans.tick(
            self.fleet, self.pool, self.rec.runs, self.settled, skip, self.o.lease_ttl_s
        )
        self.reviewers.tick(self.fleet, self.settled, skip, self.rec.runs)
        if self.injecting:
            self._due_faults()
        self.scrape()

    def scrape(self) -> None:
        """Scrape every running worker's metrics once (each request bounded)."""
        if self.rec.metrics is not None:
            self.rec.metrics.scrape(self.pool.scrapable())

    def _staff(self) -> None:
        while self.pool.active < self.o.workers and len(self.pool.workers) < self.o.workers + 4:
            spec = (
                self.schedule.next_spec(self.processes.hits, self._fraction())
                if self.injecting
                else ""
            )
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
        return count + min(2, self.schedule.short(self.processes.hits))

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
                refused = self.store_faults.refused(self, run_id)
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

    def unsettled(self) -> set[str]:
        return {r for r in self.rec.runs if r not in self.settled}

    # -- the faults of the schedule -------------------------------------------------------

    def _due_faults(self) -> None:
        """Every fault family in turn injects what fell due, at one ``now`` and one
        fraction of the runs settled; the Redis faults among them share one lane."""
        now, fraction = time.time(), self._fault_clock()
        kill_redis(self, now, fraction)
        roll_back(self, now, fraction)
        enqueue_again(self)
        cancel_one(self, fraction)
        self.processes.owner_collision(self, now, fraction)
        self.store_faults.tick(self, now, fraction)
        if self.net is not None:
            self.net.tick(self, now, fraction)
        if self.ws is not None:
            self.ws.tick(self, now, fraction)

    # -- the whole drill ------------------------------------------------------------------

    def run(self) -> None:
        start = time.time()
        while time.time() - start < self.o.duration_s:
            self.guarded_tick()
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
                and not self.store_faults.pending(self)
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
                self.store_faults.lift(self)
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
            self.guarded_tick()
            if len(self.settled) == len(self.rec.runs):
                break
            time.sleep(_TICK_S)

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

    def guarded_tick(self) -> None:
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
        RedisStore(server.client()).identity.init_epoch()
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
        drill.store_faults.disk = disk
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
            wipe_store(drill)  # last: it ends the old runs' store
        record.workers = [
            {"pid": w.pid, "spec": w.spec, "fired": w.fired_action} for w in pool.everyone.values()
        ]
        drill.scrape()  # the last counts of every worker still running
        pool.stop_all(while_waiting=drill.scrape)
        record.deaths = pool.deaths
        unwipe(drill)
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
