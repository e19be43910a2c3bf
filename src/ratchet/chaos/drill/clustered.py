"""The drill on Redis Cluster: three masters (:class:`ratchet.testing.cluster.LocalCluster`,
AOF ``always``), the RQ queue on a Redis of its own, the fleet on the
``redis+cluster://`` URL, and the ``redis-kill`` fault turned into a master's crash.

``ratchet drill --topology cluster``. At each of the schedule's Redis-kill fractions the
drill SIGKILLs the master that holds the most unsettled runs' slots (so the kill lands on
runs in flight), keeps it down for :data:`DOWN_S` while the fleet goes on with the runs of
the other masters' slots, then restarts it on its own folder and port and waits until
the cluster is ``ok`` again. :meth:`ClusterStore.kill_master` returns that record. A
master that restarts on an AOF fsync'd at every write has every acknowledged commit, so
the checker's usual invariants apply unchanged (``no_acked_checkpoint_lost``: an ack is
never lost; ``one_effect_per_intent``; ``no_run_stuck``, ...): a run whose slot was down
waits, and one whose commit's reply was lost with the master settles by its retry's
``already_applied`` or by a takeover, fenced at every adapter.

The cross-run indexes (expiry, runs, phases) each live in one slot, so on one of the
masters: while that one is down the reaper cannot read the expiry index and a phase move
cannot reach its index (see ``docs/redis.md``, "Redis Cluster"). The drill's own
settling reads each run's records, never the indexes.

Only faults that do not need one server's process or folder run on this topology
(:data:`CLUSTER_FAULTS`, the same as the replicated topology's); asking for another is a
configuration error.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ratchet.fleet.redisurl import redis_client
from ratchet.leasing import run_keys
from ratchet.redis_server import RedisServer
from ratchet.testing.cluster import LocalCluster

__all__ = ["CLUSTER_FAULTS", "DOWN_S", "ClusterStore"]

#: How long a killed master stays down: several lease TTLs of the drill's CI profile, so
#: the runs of its slots lose their leases and their commits' replies while the others go on.
DOWN_S = 1.5
#: The faults a cluster drill runs: the workers' own, the duplicate enqueues and operator
#: cancels, and ``redis-kill`` (a master's crash and restart here).
CLUSTER_FAULTS = frozenset(
    {"kill", "pause", "drop-reply", "delay", "raise", "redis-kill", "duplicate-enqueue", "cancel"}
)


class ClusterStore:
    """The drill's store as a three-master cluster plus the queue's own Redis, with the
    parts of a server's interface the drill uses (``url``, ``client``, ``start``,
    ``stop``, ``kill``, ``running``) and :attr:`queue_url` for the fleet's settings."""

    def __init__(self, folder: Path, *, executable: str | None = None) -> None:
        self.cluster = LocalCluster(folder / "cluster", executable=executable, appendfsync="always")
        self.queue = RedisServer(folder / "queue", executable=executable)
        self.data_dir = folder

    def __repr__(self) -> str:
        return f"ClusterStore({self.cluster!r}, queue_port={self.queue.port})"

    @property
    def url(self) -> str:
        nodes = ",".join(f"{host}:{port}" for host, port in self.cluster.startup_nodes)
        return f"redis+cluster://{nodes}"

    @property
    def queue_url(self) -> str:
        return self.queue.url

    @property
    def running(self) -> bool:
        return any(s.running for s in self.cluster.servers)

    def client(self, **kwargs: Any) -> Any:
        """A cluster client (it follows the slots to their masters)."""
        kwargs.setdefault("socket_timeout", 10.0)
        return redis_client(self.url, **kwargs)

    def start(self) -> ClusterStore:
        self.queue.start()
        try:
            self.cluster.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        self.cluster.stop()
        self.queue.stop()

    kill = stop  # the drill's clean-up path: everything goes

    def _master_of(self, client: Any, run_id: str) -> int:
        return int(client.get_node_from_key(run_keys(run_id).lease).port)

    def kill_master(self, run_ids: Iterable[str], *, down_s: float = DOWN_S) -> dict[str, Any]:
        """SIGKILL the master holding the most of ``run_ids``' slots, keep it down for
        ``down_s``, restart it on its folder and wait until the cluster is ``ok``.
        Raises ConfigurationError when the cluster does not recover in time."""
        ids = list(run_ids)
        client = self.client()
        try:
            ports = [self._master_of(client, r) for r in ids]
        finally:
            client.close()
        servers = self.cluster.servers
        victim = max(servers, key=lambda s: ports.count(s.port))
        at = time.time()
        victim.kill()
        time.sleep(down_s)  # the outage itself is the fault
        victim.start()
        self.cluster.wait_ok()
        return {
            "at": at,
            "port": victim.port,
            "runs_on_it": sorted(r for r, p in zip(ids, ports, strict=True) if p == victim.port),
            "down_s": down_s,
            "recovered_s": round(time.time() - at, 3),
        }
