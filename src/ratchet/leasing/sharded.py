"""The cross-run index writes that scripts cannot make on Redis Cluster.

On a single Redis the create, lease, commit and purge scripts update the runs, phase and
expiry indexes inline. On a Cluster those live in other slots, split into shards
(:class:`~ratchet.leasing.keyspace.IndexLayout`): a run's entries in every index are in one
shard, whose keys share a hash tag, so the store writes them after each script in one
call of ``lua/index_run.lua`` on that shard's slot, one round trip:

===================  ==================================================================
after                the shard's write
===================  ==================================================================
create               runs ``ZADD NX``; the run listed under its phase only
acquire              expiry ``ZADD`` (the new lease's expiry); the run listed under the
                     phase its state hash records only (``ZADD NX``: the time it
                     entered the phase is kept): the repair of a phase entry a crash or
                     an outage left stale
commit (a move)      the run listed under its new phase only (``ZADD``, ``ZREM`` from
                     every other phase)
renew, release       expiry ``ZADD`` or ``ZREM`` (:mod:`ratchet.leasing.store`)
purge                ``ZREM`` from every index (one ``MULTI``)
===================  ==================================================================

"Listed under its phase only" removes the run from every other phase's shard in the same
script, after the addition: no interleaving of these writes leaves a run listed twice or
nowhere, and any later move or acquire heals an entry an earlier failure left. A script,
not a ``MULTI``: a ``MULTI`` runs every command even when one fails (junk at a key,
``WRONGTYPE``), so it could remove the run from its old phase without adding it to the
new one; the script stops at the failing command, before any removal.

A commit is applied in the run's slot before its move is written in the shard's. If that
write fails (the shard's master is down, junk sits at one of the shard's keys, the worker
dies in between), the commit stands
(it was acknowledged) and the run stays listed under its old phase until a repair:
:attr:`ShardedIndexes.index_moves_deferred` counts the moves left so, and each is logged.
The store keeps the run ids of its deferred moves (in memory, bounded), and
:meth:`ShardedIndexes.repair_deferred_moves`, which each worker's reaper tick calls, lists
each run under the phase its state hash records once its shard can be written again, so
a run that finished during the outage is repaired without an operator. A run whose
worker died before that is repaired by its next acquire or move, or, if it never has
one, by ``ratchet store init``. Index entries only say "look at this run"; every listing
row shows the phase the state hash records.

A Cluster store written before the indexes were sharded keeps its entries in one key per
index (``ratchet:index:runs``, ...). :meth:`ShardedIndexes.migrate_unsharded_indexes`
moves them into the shards (``ratchet store init`` runs it): each entry is added to its
shard before it is removed from the old key, so a crash in between leaves it in both,
and running it again finishes the move.
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from redis.exceptions import RedisError, ResponseError

from ratchet.errors import RatchetError, StoreProtocolError, StoreUnavailableError
from ratchet.leasing.keyspace import (
    EXPIRY_INDEX,
    PHASE_INDEXES,
    PHASES,
    RUNS_INDEX,
    IndexLayout,
    check_id,
    run_keys,
)
from ratchet.leasing.plumbing import StorePlumbing
from ratchet.leasing.results import PhaseMove
from ratchet.leasing.scripts import ScriptName

__all__ = ["ShardedIndexes"]

_DEFERRED_KEPT = 10_000

log = logging.getLogger(__name__)


class ShardedIndexes(StorePlumbing):
    """The index writes after a script on a Cluster (see the module docstring). Part of
    :class:`ratchet.leasing.store.RedisStore`."""

    _indexes: IndexLayout  # set by RedisStore
    #: Phase moves whose index write failed after their commit applied (Cluster): each
    #: run stays listed under its old phase until it is repaired (module docstring).
    index_moves_deferred: int
    #: The runs of those moves not repaired yet, oldest first (set by RedisStore).
    _deferred_moves: OrderedDict[str, None]

    def _index_run(
        self,
        what: str,
        run_id: str,
        *,
        phase: str = "",
        at_ms: int = 0,
        keep: bool = True,
        created_at_ms: int | None = None,
        expires_at_ms: int | None = None,
        fail_fast: bool = False,
    ) -> None:
        """Write ``run_id``'s entries in its shard of each index, one script call
        (``lua/index_run.lua``): in the runs index (``created_at_ms``), the expiry index
        (``expires_at_ms``), and listed under ``phase`` alone (scored ``at_ms``; with
        ``keep`` an existing entry keeps its score). With ``fail_fast`` the call goes
        first to the node that serves the shard, once: a dead node fails it at once,
        where the cluster client would retry it for seconds (a slot that moved, answered
        ``MOVED``, still goes through the cluster client). Raises StoreUnavailableError,
        StoreProtocolError."""
        keys = [
            self._indexes.runs_of(run_id),
            self._indexes.expiry_of(run_id),
            *self._indexes.phases_of(run_id),
        ]
        args: list[str | bytes | int] = [
            run_id,
            PHASES.index(phase) + 1 if phase in PHASES else 0,
            at_ms,
            "1" if keep else "0",
            "" if created_at_ms is None else created_at_ms,
            "" if expires_at_ms is None else expires_at_ms,
        ]
        if fail_fast and self._indexes.shards > 1:
            reply = self._direct_script(what, run_id, keys, args)
        else:
            reply = None
        if reply is None:
            reply = self._run(ScriptName.INDEX_RUN, run_id, keys, args)
        if reply != [b"indexed"]:
            raise StoreProtocolError(
                "unexpected reply from index_run", run_id=run_id, script="index_run"
            )

    def _direct_script(
        self, what: str, run_id: str, keys: list[str], args: list[str | bytes | int]
    ) -> Any:
        """``index_run`` on the connection of the node the client maps the shard to, one
        attempt. Its reply, or None when the cluster client must take it (the node does
        not serve the slot any more, or lacks the script, or refused it). Raises
        StoreUnavailableError when the node cannot be reached."""
        sha = self._runner.sha_of(ScriptName.INDEX_RUN)
        try:
            node = self._client.get_node_from_key(keys[0])
            return self._client.get_redis_connection(node).evalsha(sha, len(keys), *keys, *args)
        except ResponseError:
            return None  # MOVED, ASK, NOSCRIPT, or a refusal the next call reports
        except RedisError as exc:
            raise StoreUnavailableError(
                f"Redis unreachable during {what}", run_id=run_id, cause=type(exc).__name__
            ) from exc

    def _index_created(self, run_id: str, created_at_ms: int, phase: str, at_ms: int) -> None:
        """A created run (or one a retried create found) in the runs index and listed
        under ``phase``. Raises StoreUnavailableError (create again: it is idempotent)."""
        self._index_run("index", run_id, phase=phase, at_ms=at_ms, created_at_ms=created_at_ms)

    def _index_acquired(self, run_id: str, expires_at_ms: int, phase: str, at_ms: int) -> None:
        """An acquired lease on the expiry index, and the run listed under the phase its
        state hash records (the repair). Raises StoreUnavailableError."""
        self._index_run(
            "expiry index", run_id, phase=phase, at_ms=at_ms, expires_at_ms=expires_at_ms
        )

    def _index_moved(self, move: PhaseMove) -> None:
        """The run listed under its new phase only, after its commit applied. A failure is
        logged and counted, never raised: the commit stands (module docstring)."""
        if move.new not in PHASES:
            return
        try:
            self._index_run(
                "phase index",
                move.run_id,
                phase=move.new,
                at_ms=move.at_ms,
                keep=False,
                fail_fast=True,
            )
        except (StoreUnavailableError, StoreProtocolError) as exc:
            # Unreachable, or junk at a key of the shard: the commit stands either way.
            self.index_moves_deferred += 1
            self._deferred_moves[move.run_id] = None
            while len(self._deferred_moves) > _DEFERRED_KEPT:
                # The oldest are left to their next acquire or to store init.
                self._deferred_moves.popitem(last=False)
            log.warning(
                "phase index not moved; it is repaired once its shard can be written",
                extra={
                    "run_id": move.run_id,
                    "old_phase": move.old,
                    "new_phase": move.new,
                    "error": exc.message,
                },
            )

    def repair_deferred_moves(self, *, limit: int = 100) -> int:
        """List each run of a deferred phase move (oldest first, up to ``limit``) under
        the phase its state hash records now (a later commit may have moved it again),
        one attempt each. Returns how many were repaired; the others stay deferred.
        Nothing to do (no call) when no move was deferred."""
        repaired = 0
        for run_id in list(self._deferred_moves)[:limit]:
            try:
                phase, at_ms = self._recorded_phase(run_id)
                if phase in PHASES:
                    self._index_run("phase index", run_id, phase=phase, at_ms=at_ms, fail_fast=True)
            except (StoreUnavailableError, StoreProtocolError):
                continue  # still deferred; the runs behind it are tried all the same
            self._deferred_moves.pop(run_id, None)
            repaired += 1
        return repaired

    def _recorded_phase(self, run_id: str) -> tuple[str, int]:
        """The phase the run's state hash records and when the run entered it (``""``
        and 0: none, or no run). Raises StoreUnavailableError."""
        phase, at = self._call(
            "phase record",
            run_id,
            lambda: self._client.hmget(run_keys(run_id).state, ["phase", "phase_at_ms"]),
        )
        text = self._member(phase) if isinstance(phase, bytes) else ""
        at_ms = int(at) if isinstance(at, bytes) and at.isdigit() else 0
        return text, at_ms

    def _index_purged(self, run_id: str) -> None:
        """A purged run out of every index (Cluster), one ``MULTI`` of removals on its
        shard. Raises StoreUnavailableError."""

        def remove() -> None:
            pipe = self._client.pipeline(transaction=True)
            for key in self._indexes.keys_of(run_id):
                pipe.zrem(key, run_id)
            pipe.execute()

        self._call("index", run_id, remove)

    def migrate_unsharded_indexes(self, *, chunk: int = 500) -> int:
        """Move the entries of the one-key indexes of a Cluster store written before the
        indexes were sharded into their shards (module docstring); nothing to do on a
        single Redis. Returns how many entries were moved. A member that is not a run id
        is dropped. Raises StoreUnavailableError, StoreProtocolError."""
        if self._indexes.shards <= 1:
            return 0
        moved = 0
        targets: list[tuple[str, Callable[[str], str]]] = [
            (RUNS_INDEX, self._indexes.runs_of),
            (EXPIRY_INDEX, self._indexes.expiry_of),
        ]
        for phase, index in zip(PHASES, PHASE_INDEXES, strict=True):
            targets.append((index, functools.partial(self._phase_shard, phase)))
        for old, shard_of in targets:
            while True:
                entries = self._call(
                    "index",
                    None,
                    functools.partial(self._client.zrange, old, 0, chunk - 1, withscores=True),
                )
                if not entries:
                    break
                moved += self._move_entries(old, shard_of, entries)
        return moved

    def _phase_shard(self, phase: str, run_id: str) -> str:
        return self._indexes.phase_of(phase, run_id)

    def _move_entries(self, old: str, shard_of: Callable[[str], str], entries: list[Any]) -> int:
        """Add ``entries`` of the old key ``old`` to their shards (``ZADD NX``: an entry a
        worker wrote there since is newer), then remove them from ``old``."""
        members: list[bytes] = []
        adds: list[tuple[str, str, float]] = []
        for item in entries:
            member, score = item if isinstance(item, list | tuple) and len(item) == 2 else (b"", 0)
            if not isinstance(member, bytes) or not isinstance(score, float):
                raise StoreProtocolError("an index entry is malformed", index=old)
            members.append(member)
            try:
                run_id = check_id(self._member(member), "run_id")
            except RatchetError:
                continue  # junk: removed below, never copied
            adds.append((shard_of(run_id), run_id, score))

        def move() -> None:
            pipe = self._client.pipeline(transaction=False)
            for key, run_id, score in adds:
                pipe.zadd(key, {run_id: score}, nx=True)
            pipe.execute()
            self._client.zrem(old, *members)

        self._call("index", None, move)
        return len(adds)
