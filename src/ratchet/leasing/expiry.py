"""The expiry index: run ids scored by lease expiry (Redis ms), the reaper's index.

A run is on it while a worker holds it (and stays if that worker dies), with its pickup
deadline while it waits in the queue, and scored "now" when a worker hands it back. The
reaper reads the entries due (:meth:`ExpiryIndex.expired_entries`); an entry only says
"look at this run", so every reader re-reads the run before acting.

On a single Redis it is one key, :data:`ratchet.leasing.keyspace.EXPIRY_INDEX`, which the
lease and commit scripts update inline. On Redis Cluster it is split into
:data:`~ratchet.leasing.keyspace.INDEX_SHARDS` keys of their own slots, spread over the
masters (:class:`~ratchet.leasing.keyspace.IndexLayout`): the store writes a run's entry in
its shard after each script, and the reaper reads every shard, in one pipeline, or, when
a master is down, master by master, leaving out only the shards it cannot reach
(:attr:`ExpiryIndex.expiry_shards_unreadable`).

:class:`ratchet.leasing.store.RedisStore` holds one as ``store.expiry``: the reaper and
the drills read it there, and the store writes a run's entry through it where the scripts
cannot (Cluster: after each lease script; ``finished`` commits).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import RedisError

from ratchet.errors import StoreUnavailableError
from ratchet.leasing.keyspace import IndexLayout, check_id
from ratchet.leasing.plumbing import call, member_text, run_script
from ratchet.leasing.replies import decode_drop_expiry
from ratchet.leasing.scripts import ScriptName, ScriptRunner

__all__ = ["ExpiryIndex"]


class ExpiryIndex:
    """Reading and writing the expiry index (see the module docstring) with the store's
    client and script runner, over the shards of ``layout`` (one on a single Redis);
    ``clock`` is Redis' time in ms (the store's ``server_time_ms``), what deadlines and
    "due" are measured against."""

    def __init__(
        self, client: Any, runner: ScriptRunner, layout: IndexLayout, clock: Callable[[], int]
    ) -> None:
        self._client = client
        self._runner = runner
        self._indexes = layout
        self._clock = clock
        #: How many shards the last read could not reach (Cluster, a master down): their
        #: runs are not taken over until it is back. The reaper reports it.
        self.expiry_shards_unreadable = 0

    def expired_runs(self, *, limit: int = 100) -> list[str]:
        """Run ids whose indexed lease expiry is at or before Redis' now (a reaper hint).

        Re-read each run with the store's ``read_run`` before acting on it. Raises
        StoreUnavailableError, StoreProtocolError.
        """
        return [run_id for run_id, _ in self.expired_entries(limit=limit)]

    def expired_entries(self, *, limit: int = 100) -> list[tuple[str, int]]:
        """``(run id, indexed expiry ms)`` pairs at or before Redis' now (a reaper hint).

        Raises StoreUnavailableError, StoreProtocolError.
        """
        now_ms = self._clock()
        shards = self._indexes.expiry()
        if len(shards) == 1:
            replies = [
                call(
                    "expiry index",
                    None,
                    lambda: self._client.zrangebyscore(
                        shards[0], "-inf", now_ms, start=0, num=limit, withscores=True
                    ),
                )
            ]
        else:
            replies = self._read_shards(shards, now_ms, limit)
        # Every shard's earliest ``limit``, merged: the earliest ``limit`` of them all.
        entries = [(member_text(m), int(score)) for reply in replies for m, score in reply]
        entries.sort(key=lambda entry: (entry[1], entry[0]))
        return entries[:limit]

    def _read_shards(self, shards: Sequence[str], now_ms: int, limit: int) -> list[Any]:
        """Each expiry shard's due entries (Cluster): one pipeline over the masters; when
        that fails (a master is down), shard by shard, leaving out the ones that cannot be
        read, so the runs of the other masters' shards are still taken over (how many were
        left out: :attr:`expiry_shards_unreadable`, which the reaper reports). Raises
        StoreUnavailableError when no shard can be read."""
        pipe = self._client.pipeline(transaction=False)
        for key in shards:
            pipe.zrangebyscore(key, "-inf", now_ms, start=0, num=limit, withscores=True)
        try:
            together = list(pipe.execute())
        except RedisError:
            pass
        else:
            self.expiry_shards_unreadable = 0
            return together
        # Master by master, one attempt each on that master's own connection (the cluster
        # client would retry a dead node for seconds per key).
        by_node: dict[str, tuple[Any, list[str]]] = {}
        for key in shards:
            node = self._client.get_node_from_key(key)
            by_node.setdefault(node.name, (node, []))[1].append(key)
        replies: list[Any] = []
        failures = 0
        for node, keys in by_node.values():
            try:
                direct = self._client.get_redis_connection(node).pipeline(transaction=False)
                for key in keys:
                    direct.zrangebyscore(key, "-inf", now_ms, start=0, num=limit, withscores=True)
                replies += direct.execute()
            except RedisError:
                failures += len(keys)
        if failures == len(shards):
            raise StoreUnavailableError(
                "no shard of the expiry index can be read", shards=len(shards)
            )
        self.expiry_shards_unreadable = failures
        return replies

    def key_of(self, run_id: str) -> str:
        """The expiry index key that holds ``run_id``'s entry."""
        return self._indexes.expiry_of(run_id)

    def expiry_score(self, run_id: str) -> int | None:
        """``run_id``'s score on the expiry index (None: not on it). Raises
        StoreUnavailableError."""
        check_id(run_id, "run_id")
        score = call(
            "expiry index", run_id, lambda: self._client.zscore(self.key_of(run_id), run_id)
        )
        return None if score is None else int(score)

    def expiry_members(self) -> set[str]:
        """Every member of the expiry index, all shards (drills and diagnostics: it reads
        the whole index). Raises StoreUnavailableError."""

        def read() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for key in self._indexes.expiry():
                pipe.zrange(key, 0, -1)
            return list(pipe.execute())

        return {member_text(m) for reply in call("expiry index", None, read) for m in reply}

    def expect_pickup(self, run_id: str, *, within_ms: int) -> None:
        """Put ``run_id`` on the expiry index with a pickup deadline (``ZADD GT``).

        Called when a run is enqueued: if no worker acquires it by then (its job was lost
        with a worker, or with Redis), the reaper re-enqueues it. A later score (a live
        lease) is kept. Raises StoreUnavailableError.
        """
        check_id(run_id, "run_id")
        deadline = self._clock() + within_ms
        index = self.key_of(run_id)
        call(
            "expiry index",
            run_id,
            lambda: self._client.zadd(index, {run_id: deadline}, gt=True),
        )

    def park_expiry_entry(self, run_id: str, *, for_ms: int) -> None:
        """Move ``run_id``'s expiry index entry ``for_ms`` into the future (``ZADD XX``):
        an entry the reaper cannot handle stops blocking the ones behind it. Index entries
        only say "look at this run", so a race with a worker re-scoring it is harmless.
        Raises StoreUnavailableError."""
        later = self._clock() + for_ms
        index = self.key_of(run_id)
        call("expiry index", None, lambda: self._client.zadd(index, {run_id: later}, xx=True))

    def forget_index_member(self, member: str) -> None:
        """Remove a member that is not a run id from the expiry index (junk written there
        names no run). Raises StoreUnavailableError."""
        index = self.key_of(member)
        call("expiry index", None, lambda: self._client.zrem(index, member))

    def drop_expiry_entry(self, run_id: str, score_ms: int) -> bool:
        """Remove ``run_id`` from the expiry index if its score is still ``score_ms``.

        Raises StoreUnavailableError, StoreProtocolError.
        """
        check_id(run_id, "run_id")
        reply = run_script(
            self._runner,
            ScriptName.DROP_EXPIRY_ENTRY,
            run_id,
            [self.key_of(run_id)],
            [run_id, score_ms],
        )
        return decode_drop_expiry(reply)

    # -- the store's own writes where its scripts cannot reach the index (Cluster) ------

    def score(self, run_id: str, at_ms: int) -> None:
        """Put ``run_id`` on the index scored ``at_ms`` (a renewed lease's expiry, or "now"
        for a run handed back). Raises StoreUnavailableError."""
        index = self.key_of(run_id)
        call("expiry index", run_id, lambda: self._client.zadd(index, {run_id: at_ms}))

    def remove(self, run_id: str) -> None:
        """Take ``run_id`` off the index (released for good, or finished). Raises
        StoreUnavailableError."""
        index = self.key_of(run_id)
        call("expiry index", run_id, lambda: self._client.zrem(index, run_id))
