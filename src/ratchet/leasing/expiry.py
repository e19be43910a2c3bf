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
(:attr:`ExpiryIndex.expiry_shards_unreadable`). Part of
:class:`ratchet.leasing.store.RedisStore`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.exceptions import RedisError

from ratchet.errors import StoreUnavailableError
from ratchet.leasing.keyspace import IndexLayout, check_id
from ratchet.leasing.plumbing import StorePlumbing
from ratchet.leasing.replies import decode_drop_expiry
from ratchet.leasing.scripts import ScriptName

__all__ = ["ExpiryIndex"]


class ExpiryIndex(StorePlumbing):
    """Reading and writing the expiry index (see the module docstring)."""

    #: The index keys: one shard on a single Redis, several on a Cluster (set by RedisStore).
    _indexes: IndexLayout
    #: How many shards the last read could not reach (Cluster, a master down): their
    #: runs are not taken over until it is back. The reaper reports it.
    expiry_shards_unreadable: int

    def server_time_ms(self) -> int:  # provided by RedisStore
        raise NotImplementedError

    def expired_runs(self, *, limit: int = 100) -> list[str]:
        """Run ids whose indexed lease expiry is at or before Redis' now (a reaper hint).

        Re-read each run with :meth:`read_run` before acting on it. Raises
        StoreUnavailableError, StoreProtocolError.
        """
        return [run_id for run_id, _ in self.expired_entries(limit=limit)]

    def expired_entries(self, *, limit: int = 100) -> list[tuple[str, int]]:
        """``(run id, indexed expiry ms)`` pairs at or before Redis' now (a reaper hint).

        Raises StoreUnavailableError, StoreProtocolError.
        """
        now_ms = self.server_time_ms()
        shards = self._indexes.expiry()
        if len(shards) == 1:
            replies = [
                self._call(
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
        entries = [(self._member(m), int(score)) for reply in replies for m, score in reply]
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

    def _expiry(self, run_id: str) -> str:
        """The expiry index key that holds ``run_id``'s entry."""
        return self._indexes.expiry_of(run_id)

    def expiry_score(self, run_id: str) -> int | None:
        """``run_id``'s score on the expiry index (None: not on it). Raises
        StoreUnavailableError."""
        check_id(run_id, "run_id")
        score = self._call(
            "expiry index", run_id, lambda: self._client.zscore(self._expiry(run_id), run_id)
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

        return {self._member(m) for reply in self._call("expiry index", None, read) for m in reply}

    def expect_pickup(self, run_id: str, *, within_ms: int) -> None:
        """Put ``run_id`` on the expiry index with a pickup deadline (``ZADD GT``).

        Called when a run is enqueued: if no worker acquires it by then (its job was lost
        with a worker, or with Redis), the reaper re-enqueues it. A later score (a live
        lease) is kept. Raises StoreUnavailableError.
        """
        check_id(run_id, "run_id")
        deadline = self.server_time_ms() + within_ms
        index = self._expiry(run_id)
        self._call(
            "expiry index",
            run_id,
            lambda: self._client.zadd(index, {run_id: deadline}, gt=True),
        )

    def park_expiry_entry(self, run_id: str, *, for_ms: int) -> None:
        """Move ``run_id``'s expiry index entry ``for_ms`` into the future (``ZADD XX``):
        an entry the reaper cannot handle stops blocking the ones behind it. Index entries
        only say "look at this run", so a race with a worker re-scoring it is harmless.
        Raises StoreUnavailableError."""
        later = self.server_time_ms() + for_ms
        index = self._expiry(run_id)
        self._call("expiry index", None, lambda: self._client.zadd(index, {run_id: later}, xx=True))

    def forget_index_member(self, member: str) -> None:
        """Remove a member that is not a run id from the expiry index (junk written there
        names no run). Raises StoreUnavailableError."""
        index = self._expiry(member)
        self._call("expiry index", None, lambda: self._client.zrem(index, member))

    def drop_expiry_entry(self, run_id: str, score_ms: int) -> bool:
        """Remove ``run_id`` from the expiry index if its score is still ``score_ms``.

        Raises StoreUnavailableError, StoreProtocolError.
        """
        check_id(run_id, "run_id")
        reply = self._run(
            ScriptName.DROP_EXPIRY_ENTRY, run_id, [self._expiry(run_id)], [run_id, score_ms]
        )
        return decode_drop_expiry(reply)
