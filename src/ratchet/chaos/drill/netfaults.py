"""Network faults and adapter-side crashes in a drill: partitions and a killed orders service.

Links. With ``partition-store`` or ``partition-reply`` requested, every worker process
gets its own :class:`~ratchet.chaos.netfault.FaultProxy` to Redis (its settings'
``redis_url`` points at its proxy, so one worker can be cut while the others, and the
drill itself, still reach Redis). Redis restarts on the same port (``RedisServer`` keeps
the port after its first start), so a proxy forwards to the same place across the drill's
Redis kills, rollbacks and the wipe. With ``partition-adapter`` requested, every run's
orders URL points at a proxy of its own in front of the orders service, so one run's
link can be cut while the others' stay up.

Faults (at fractions of the runs settled, one at a time in each of two lanes: the Redis
partitions, and the orders faults, which never touch Redis; each recorded in
``DrillRecord.net_faults`` with what it saw):

* ``partition-store``: a worker that holds a live lease is cut from Redis in both
  directions, while its adapters stay reachable, until its lease has expired, another
  worker has taken the run over and moved it on (or settled it), and at least
  max(2 x TTL, TTL + 1 s) passed; then healed. What the worker sent meanwhile waits in
  the proxy (a partition stalls, it does not reset) and reaches Redis after the heal,
  under a lease that is no longer its own;
* ``partition-reply``: the same, with only Redis -> worker cut: requests arrive and run,
  their replies stall (the "reply lost" case on a real network);
* ``partition-adapter``: the link of one run before its order (no order yet, its lease
  live: its worker calls the service next) is cut both ways for longer
  than the HTTP adapter's timeout, then healed: the call times out with its outcome
  unknown, and what the proxy held reaches the service after the heal;
* ``orders-kill``: at a moment some leased run has not placed its order, the orders service
  process is SIGKILLed and started again on the same port and databases.

The Redis lane is shared with the store faults and the rollback's cut: a partition waits
for them to end and for the Redis faults' spacing, and a store fault that falls due after
a partition waits for that partition (:meth:`NetFaults.redis_turn`). A fault that finds
nothing to hit (no live lease, no run at its order step) once it may look waits for at
most :data:`_PATIENCE_S` while runs are unsettled, then is recorded as skipped with the
reason (its invariant is then ``unknown``).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError

from ratchet.adapters.http import HttpAdapter
from ratchet.chaos.drill.services import TenantOrders
from ratchet.chaos.drill.storefaults import effect_counts, lease_snapshot
from ratchet.chaos.netfault import Direction, FaultProxy, LinkCounters
from ratchet.errors import RatchetError
from ratchet.leasing import run_keys
from ratchet.redis_server import RedisServer

__all__ = ["NET_FAULTS", "NET_FAULTS_AT", "Acquires", "NetFaults", "http_timeout_s"]

#: The network and adapter-side faults, in the order they fire, each at a fraction of
#: the runs settled (between the Redis kills at 25 % and 60 %, away from the rollback).
NET_FAULTS_AT = (
    ("partition-store", 0.12),
    ("partition-adapter", 0.15),
    # Right after the first partition (its lane runs one fault at a time), before the
    # Redis kills, store faults and the rollback's cut hold the Redis lane back.
    ("partition-reply", 0.18),
    ("orders-kill", 0.35),
)
NET_FAULTS = tuple(kind for kind, _ in NET_FAULTS_AT)
_REDIS_LINKED = frozenset({"partition-store", "partition-reply"})
_PATIENCE_S = 60.0  # how long a fault waits for something to hit
_REDIS_QUIET_S = 2.5  # spacing from any other Redis fault, as the store faults keep
_ORDERS_DOWN_S = 0.5  # how long the orders service stays dead


def http_timeout_s() -> float:
    """The HTTP adapter's per-request timeout (its default; runs do not set one)."""
    default = inspect.signature(HttpAdapter.__init__).parameters["timeout_seconds"].default
    return float(default)


def _counters(c: LinkCounters) -> dict[str, int]:
    return {
        "connections": c.connections,
        "bytes_up": c.bytes_up,
        "bytes_down": c.bytes_down,
        "severed": c.severed,
    }


def _redis_int(client: Any, key: str, name: str) -> int | None:
    raw = client.hget(key, name)
    text = raw.decode("ascii", "replace") if isinstance(raw, bytes) else str(raw or "")
    return int(text) if text.isdigit() else None


@dataclass
class Acquires:
    """(run, lease version) -> the pid whose event log says it acquired that lease, read
    incrementally from the drill's event logs."""

    folder: Path
    owners: dict[tuple[str, int], int] = field(default_factory=dict)
    _offsets: dict[Path, int] = field(default_factory=dict)

    def refresh(self) -> None:
        for path in sorted(self.folder.glob("events-*.jsonl")):
            start = self._offsets.get(path, 0)
            with path.open("rb") as fh:
                fh.seek(start)
                data = fh.read()
            cut = data.rfind(b"\n") + 1
            self._offsets[path] = start + cut
            for line in data[:cut].splitlines():
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    event = json.loads(line)
                    if event.get("kind") == "acquire":
                        key = (str(event["run_id"]), int(event["lease_version"]))
                        self.owners[key] = int(event["pid"])


class NetFaults:
    """The drill's proxies and its network faults (see the module docstring).

    ``tick`` is called from the drill's tick while it injects; it never blocks for long
    (a fault in force is advanced one step per tick), so the drill goes on replacing
    workers and resuming zombies while a link is cut. ``end`` heals everything and
    brings the orders service back; ``stop`` closes the proxies.
    """

    def __init__(
        self,
        faults: frozenset[str],
        server: RedisServer,
        orders: TenantOrders,
        *,
        events_dir: Path,
        ttl_s: float,
    ) -> None:
        self.wanted = [(k, at) for k, at in NET_FAULTS_AT if k in faults]
        self.server, self.orders, self.ttl_s = server, orders, ttl_s
        self.redis_links: list[FaultProxy] = []
        self.orders_links: dict[int, FaultProxy] = {}
        self.link_redis = bool(_REDIS_LINKED & faults)
        self.link_orders = "partition-adapter" in faults
        self.acquires = Acquires(events_dir)
        # Two lanes, each one fault at a time: Redis partitions, and the orders faults
        # (which never touch Redis, so they need not wait for its spacing).
        self.lanes: dict[str, dict[str, Any] | None] = {"redis": None, "orders": None}
        self.waiting_since: dict[str, float] = {}
        self.attempts = 0
        self.retries: dict[str, int] = {}  # partitions healed before any takeover, by kind
        self.last_look = 0.0
        self.faults: list[dict[str, Any]] = []
        self.skipped: dict[str, str] = {}

    def __repr__(self) -> str:
        return (
            f"NetFaults(due={[k for k, _ in self.wanted]}, redis_links={len(self.redis_links)}, "
            f"orders_links={len(self.orders_links)})"
        )

    # -- links ----------------------------------------------------------------------------

    def redis_link(self) -> tuple[str, object]:
        """A new proxy to Redis for one worker: its URL and the proxy. Raises
        ConfigurationError when it cannot listen."""
        proxy = FaultProxy(("127.0.0.1", self.server.port)).start()
        self.redis_links.append(proxy)
        return f"redis://127.0.0.1:{proxy.port}/0", proxy

    def orders_url(self, index: int, url: str) -> str:
        """Run ``index``'s orders URL: through a proxy of its own when links are cut."""
        if not self.link_orders:
            return url
        proxy = FaultProxy(("127.0.0.1", self.orders.port)).start()
        self.orders_links[index] = proxy
        return url.replace(f"127.0.0.1:{self.orders.port}/", f"127.0.0.1:{proxy.port}/", 1)

    @property
    def active(self) -> dict[str, Any] | None:
        return next((f for f in self.lanes.values() if f is not None), None)

    @property
    def pending(self) -> bool:
        return bool(self.wanted) or self.active is not None

    @staticmethod
    def _lane(kind: str) -> str:
        return "redis" if kind in _REDIS_LINKED else "orders"

    # -- the faults -----------------------------------------------------------------------

    def tick(self, drill: Any, now: float, fraction: float) -> None:
        """One step per lane: advance its fault in force, or start its next one when due.

        ``drill`` is the runner's drill (its fleet, pool, runs, Redis fault spacing)."""
        for fault in list(self.lanes.values()):
            if fault is not None:
                self._advance(drill, fault, now)
        if now - self.last_look < 0.2:
            return
        self.last_look = now
        for lane in self.lanes:
            due = [(k, at) for k, at in self.wanted if self._lane(k) == lane]
            if self.lanes[lane] is None and due and fraction >= due[0][1]:
                self._start(drill, due[0][0], now)

    def redis_turn(self, fraction: float, store_at: float) -> bool:
        """Whether a Redis partition goes before a store fault due at ``store_at`` (a
        fraction of the runs settled): one is in force, or the next one fell due no later
        than that and waits for the lane. The Redis faults take the lane in the order they
        fall due; the store faults, ticked first, would otherwise take it one after another
        while a partition waited, until every run had settled."""
        if self.lanes["redis"] is not None:
            return True
        due = [at for kind, at in self.wanted if kind in _REDIS_LINKED]
        return bool(due) and due[0] <= min(fraction, store_at)

    def _start(self, drill: Any, kind: str, now: float) -> None:
        lane = self._lane(kind)
        if lane == "redis" and (
            drill.holding is not None
            or drill.cut is not None
            or now - drill.last_redis_fault <= _REDIS_QUIET_S
        ):
            return  # not its turn yet: its patience starts once it may look
        since = self.waiting_since.setdefault(lane, now)
        started = {
            "partition-store": self._cut_worker,
            "partition-reply": self._cut_worker,
            "partition-adapter": self._cut_orders,
            "orders-kill": self._kill_orders,
        }[kind](drill, kind, now)
        if started or now - since > _PATIENCE_S or not (drill.unsettled() or drill.pending):
            if not started:
                self.skipped[kind] = (
                    f"nothing to hit within {_PATIENCE_S:.0f} s (no live lease held by a "
                    "linked worker, or no run before its order)"
                    if now - since > _PATIENCE_S
                    else "every run settled before it found something to hit"
                )
            self.wanted.remove(next(w for w in self.wanted if w[0] == kind))
            self.waiting_since.pop(lane, None)

    def _cut_worker(self, drill: Any, kind: str, now: float) -> bool:
        client = drill.fleet.store.client
        try:
            live = lease_snapshot(client, sorted(drill.unsettled() - set(drill.rec.corrupted)))
        except RedisError:
            return False
        self.acquires.refresh()
        workers = {
            w.pid: w
            for w in drill.pool.workers.values()
            if w.link is not None and w.active and w.proc.exitcode is None
        }
        for lease in live:
            pid = self.acquires.owners.get((lease["run_id"], lease["lease_version"]))
            if pid is None or pid not in workers:
                continue
            proxy = workers[pid].link
            directions = (Direction.DOWN,) if kind == "partition-reply" else ()
            proxy.partition(*directions)
            self.lanes["redis"] = {
                "kind": kind,
                "at": time.time(),
                "pid": pid,
                "run_id": lease["run_id"],
                "lease_version": lease["lease_version"],
                "generation": lease["generation"],
                "directions": [d.value for d in directions] or ["up", "down"],
                "counters_at_cut": _counters(proxy.counters()),
                "_proxy": proxy,
            }
            return True
        return False

    def _at_order_step(self, drill: Any) -> list[str]:
        """Unsettled runs before their order (no order yet), their lease live: their worker
        calls the orders service next (observations, the fence, the order)."""
        try:
            live = lease_snapshot(drill.fleet.store.client, sorted(drill.unsettled()))
        except RedisError:
            return []
        out = []
        for lease in live:
            run_id = lease["run_id"]
            if run_id in drill.rec.corrupted:
                continue
            counts = effect_counts(drill.rec.folder, drill.index[run_id])
            if counts["orders"] == 0 and counts["workspace"] >= 0:
                out.append(run_id)
        return sorted(out)

    def _cut_orders(self, drill: Any, kind: str, now: float) -> bool:
        runs = [r for r in self._at_order_step(drill) if drill.index[r] in self.orders_links]
        if not runs:
            return False
        run_id = drill.rng.choice(runs)
        proxy = self.orders_links[drill.index[run_id]]
        proxy.partition()
        self.lanes["orders"] = {
            "kind": kind,
            "at": time.time(),
            "run_id": run_id,
            "index": drill.index[run_id],
            "hold_s": http_timeout_s() + 0.5,
            "counters_at_cut": _counters(proxy.counters()),
            "_proxy": proxy,
        }
        return True

    def _kill_orders(self, drill: Any, kind: str, now: float) -> bool:
        runs = self._at_order_step(drill)
        if not runs:
            return False
        pid = self.orders.pid
        self.orders.kill()
        self.lanes["orders"] = {
            "kind": kind,
            "at": time.time(),
            "killed_pid": pid,
            "runs_at_order": runs,
            "effects_at_kill": {r: effect_counts(drill.rec.folder, drill.index[r]) for r in runs},
        }
        return True

    def _advance(self, drill: Any, fault: dict[str, Any], now: float) -> None:
        kind = fault["kind"]
        if kind == "orders-kill":
            if now - fault["at"] >= _ORDERS_DOWN_S:
                self.orders.restart()
                fault["restarted_at"] = time.time()
                fault["pid"] = self.orders.pid
                self._done(fault)
            return
        proxy: FaultProxy = fault["_proxy"]
        if kind == "partition-adapter":
            if now - fault["at"] >= fault["hold_s"]:
                fault["counters_at_heal"] = _counters(proxy.counters())
                proxy.heal()
                fault["healed_at"] = time.time()
                cut = fault["counters_at_heal"]["connections"]
                fault["calls_cut"] = cut - fault["counters_at_cut"]["connections"]
                self._done(fault)
                if not fault["calls_cut"] and self.attempts < 2:
                    # Nothing called the service while it was cut (the worker died, the
                    # run was cancelled): try another run.
                    self.attempts += 1
                    self.wanted.insert(0, (kind, 0.0))
            return
        self._advance_partition(drill, fault, proxy, now)

    def _advance_partition(
        self, drill: Any, fault: dict[str, Any], proxy: FaultProxy, now: float
    ) -> None:
        """Heal once the run was taken over and moved on (or settled), at least
        max(2 x TTL, TTL + 1 s) after the cut; at the latest max(8 s, 8 x TTL) after it."""
        run_id, ttl = fault["run_id"], self.ttl_s
        client = drill.fleet.store.client
        keys = run_keys(run_id)
        try:
            version = _redis_int(client, keys.lease, "lease_version")
            generation = _redis_int(client, keys.state, "generation")
        except (RedisError, RatchetError):
            version = generation = None
        if (
            version is not None
            and version > fault["lease_version"]
            and fault.get("taken_over_by") is None
        ):
            fault["taken_over_by"] = version
            fault["taken_over_at"] = now
            fault["generation_at_takeover"] = generation
        elapsed = now - fault["at"]
        taken = fault.get("taken_over_by") is not None
        moved = taken and (
            run_id in drill.settled
            or (generation is not None and generation > (fault.get("generation_at_takeover") or 0))
        )
        if (moved and elapsed >= max(2 * ttl, ttl + 1.0)) or elapsed >= max(8.0, 8 * ttl):
            fault["counters_at_heal"] = _counters(proxy.counters())
            proxy.heal()
            fault["healed_at"] = time.time()
            fault["generation_at_heal"] = generation
            drill.last_redis_fault = time.time()
            self._done(fault)
            tries = self.retries.get(fault["kind"], 0)
            if not taken and tries < 2:
                # No takeover while cut (a loaded machine): nothing was at stake; again.
                self.retries[fault["kind"]] = tries + 1
                self.wanted.insert(0, (fault["kind"], 0.0))

    def _done(self, fault: dict[str, Any]) -> None:
        fault.pop("_proxy", None)
        self.faults.append(fault)
        self.lanes[self._lane(str(fault["kind"]))] = None

    def end(self) -> None:
        """Injection is over: heal every link and bring the orders service back."""
        for fault in [f for f in self.lanes.values() if f is not None]:
            if fault["kind"] == "orders-kill":
                self.orders.restart()
                fault["restarted_at"] = time.time()
            else:
                proxy = fault["_proxy"]
                fault["counters_at_heal"] = _counters(proxy.counters())
                fault["healed_at"] = time.time()
            self._done(fault)
        for proxy in [*self.redis_links, *self.orders_links.values()]:
            with contextlib.suppress(RatchetError):
                proxy.heal()
        for kind, _ in self.wanted:
            self.skipped.setdefault(kind, "injection ended before it was due")

    def stop(self) -> None:
        for proxy in [*self.redis_links, *self.orders_links.values()]:
            proxy.stop()
