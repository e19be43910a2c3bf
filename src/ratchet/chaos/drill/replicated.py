"""The drill on a replicated store: a primary, one replica and three Sentinels
(:class:`ratchet.testing.sentinel.LocalReplicated`), the fleet on the ``redis+sentinel://``
URL, and the ``redis-kill`` fault turned into a failover.

``ratchet drill --topology replicated [--min-replicas-ack N]``. At each of the schedule's
Redis-kill fractions the drill SIGKILLs whichever server is primary, waits for the
Sentinels to agree on the promoted replica, reads every run's generation from it (what the
promotion kept), then restarts the killed server on its own folder, which Sentinel turns
into the new primary's replica, and waits until it is in sync. :meth:`failover` returns
that record; the checker (:func:`failover_losses`) compares it with the workers' acks:

The replica is cut off first (paused, its link closed by the primary, then
:data:`LAG_S` of commits it never receives): a failover loses exactly what the promoted
replica had not received, and on loopback an unhindered replica receives everything
within a millisecond (a merely paused one too, once resumed: the stream waits in its
socket; one whose link is closed but runs reconnects at once and resyncs).

* an ack made before the promotion whose generation the promoted primary did not have,
  or held with another digest by the end, was **lost to the failover**. With
  ``--min-replicas-ack`` >= 1 none may be (``failover_acks_kept``); without, they are
  counted and reported, as the guarantee says;
* a run that lost acks is **rewound by the failover**: like a run the AOF rollback
  rewound, it must end frozen with evidence, continue with every adapter effect recorded
  and none doubled, or be cancelled with the mismatch recorded (the adapters' fences and
  the restore's environment check make sure of it).

Only faults that do not need one server's process or folder run on this topology
(:data:`REPLICATED_FAULTS`); asking for another is a configuration error.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ratchet.fleet.redisurl import redis_client
from ratchet.leasing import run_keys
from ratchet.redis_server import RedisServer
from ratchet.testing.sentinel import LocalReplicated

__all__ = ["REPLICATED_FAULTS", "TOPOLOGIES", "ReplicatedStore"]

TOPOLOGIES = ("single", "replicated", "cluster")
#: How long the replica is cut off before the primary dies: long enough that the primary
#: takes commits the replica never receives (every one a loss without the rule; several
#: times the drill's WAIT timeout, so a build that ignored WAIT's count would lose acks
#: too), shorter than Sentinel's down-after (2 s: the paused replica stays a candidate).
LAG_S = 1.2
#: The faults a replicated drill runs: the workers' own, the duplicate enqueues and
#: operator cancels, and ``redis-kill`` (a failover here).
REPLICATED_FAULTS = frozenset(
    {"kill", "pause", "drop-reply", "delay", "raise", "redis-kill", "duplicate-enqueue", "cancel"}
)


class ReplicatedStore:
    """The drill's store as a replicated topology, with the parts of a server's interface
    the drill uses for it (``url``, ``client``, ``start``, ``stop``, ``kill``)."""

    def __init__(self, folder: Path, *, executable: str | None = None) -> None:
        # Down after 2 s, not 1: on a loaded two-core machine a Sentinel that took 1 s to
        # hear from the promoted replica judged it down too and failed over again.
        self.topology = LocalReplicated(
            folder, replicas=1, sentinels=3, executable=executable, down_after_ms=2000
        )
        self.data_dir = folder

    def __repr__(self) -> str:
        return f"ReplicatedStore({self.topology!r})"

    @property
    def url(self) -> str:
        return self.topology.url

    @property
    def running(self) -> bool:
        return any(s.running for s in self.topology.servers)

    def client(self, **kwargs: Any) -> Any:
        """A client of the primary the Sentinels name (it follows a failover)."""
        kwargs.setdefault("socket_timeout", 10.0)
        return redis_client(self.url, **kwargs)

    def start(self) -> ReplicatedStore:
        self.topology.start()
        return self

    def stop(self) -> None:
        self.topology.stop()

    kill = stop  # the drill's clean-up path: everything goes

    def failover(self, run_ids: Iterable[str], *, lag_s: float = LAG_S) -> dict[str, Any]:
        """Let the replica fall behind (the primary drops its replica links for ``lag_s``
        and goes on taking commits the replica never receives), kill the primary, wait for
        the replica's promotion, read what it kept, bring the killed server back as its
        replica. Raises ConfigurationError when no failover happens."""
        primary = self.topology.primary
        (replica,) = self.topology.replicas
        replica.pause()  # so that it cannot reconnect while the link is down
        try:
            cut = _cut_replicas(primary)
            time.sleep(lag_s)  # the lag itself is the fault: a span of commits it misses
            at = time.time()
            old = self.topology.kill_primary()
        finally:
            replica.resume()
        promoted = self.topology.wait_failover(old)
        promoted_at = time.time()
        kept = _generations(promoted, run_ids)
        self.topology.rejoin(old)
        return {
            "at": at,
            "promoted_at": promoted_at,
            "took_s": round(promoted_at - at, 3),
            "lag_s": lag_s,
            "replica_links_cut": cut,
            "killed_port": old.port,
            "promoted_port": promoted.port,
            "kept": kept,
        }


def _cut_replicas(primary: RedisServer) -> int:
    """The primary closes its replica links (``CLIENT KILL TYPE replica``): what it
    commits from now on reaches no replica until one reconnects. A replica that was only
    paused would lose nothing (the stream waits in its socket buffer) and one left running
    reconnects at once and resyncs from the backlog: the drill pauses it first. Returns
    the links closed."""
    client: Any = primary.client(socket_timeout=2.0)
    try:
        return int(client.execute_command("CLIENT", "KILL", "TYPE", "replica"))
    finally:
        client.close()


def _generations(server: RedisServer, run_ids: Iterable[str]) -> dict[str, int]:
    """Each existing run's generation (high-water mark) on ``server``."""
    ids = list(run_ids)
    client: Any = server.client()
    try:
        pipe = client.pipeline(transaction=False)
        for run_id in ids:
            pipe.hget(run_keys(run_id).state, "generation")
        values = pipe.execute()
    finally:
        client.close()
    return {r: int(v) for r, v in zip(ids, values, strict=True) if v is not None}
