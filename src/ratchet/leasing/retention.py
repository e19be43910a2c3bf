"""Removing finished runs from the store: the purge script and the tombstone it leaves.

``purge_run`` (one script call on the run's slot, see ``lua/purge_run.lua``) deletes a
run's records only if it is still at the generation and state version the caller
verified and no live lease holds it, and leaves ``ratchet:{<run>}:tombstone``: a small
hash that keeps the id taken for good. ``create_run`` refuses an id with a tombstone, so
the run's idempotency keys (which derive from its id) are never issued again, and the
global nonce records are never deleted, so its nonces are never consumed again. What a
purge removes is meant to have been exported first (``ratchet export``, or ``ratchet
purge --export-dir``); deciding that a run may go is the caller's job
(:mod:`ratchet.ops.retention`).

On a single Redis the script also takes the run off every cross-run index; on Redis
Cluster those live in other slots and are cleared by separate calls after it.
"""

from __future__ import annotations

from typing import Any

from ratchet.errors import StoreProtocolError
from ratchet.leasing.keyspace import INDEX_KEYS, check_id, run_keys
from ratchet.leasing.scripts import ScriptName
from ratchet.leasing.sharded import ShardedIndexes

__all__ = ["RunRetention"]

_OUTCOMES = frozenset({"purged", "gone", "moved", "held"})


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class RunRetention(ShardedIndexes):
    """Purge and tombstones (see the module docstring)."""

    _inline_indexes: bool  # set by RedisStore: a single Redis (not a Cluster)

    def purge_run(
        self,
        run_id: str,
        *,
        generation: int,
        state_version: int,
        phase: str,
        checkpoint_digest: str,
        export: str = "",
    ) -> str:
        """Remove a verified finished run, leaving its tombstone. Returns ``purged``,
        ``gone`` (no such run), ``moved`` (it changed since it was verified: kept) or
        ``held`` (a live lease: kept).

        Raises StoreUnavailableError, StoreProtocolError.
        """
        keys = run_keys(run_id)
        inline = self._inline_indexes
        reply = self._run(
            ScriptName.PURGE_RUN,
            run_id,
            [
                keys.state,
                keys.lease,
                keys.tombstone,
                keys.ckpt,
                keys.scenario,
                keys.history,
                keys.commits,
                keys.nonces,
                keys.incidents,
                keys.inbox,
                keys.archive,
                keys.keys,
                keys.ledger,
                keys.calls,
                keys.placement,
                *(INDEX_KEYS if inline else ()),
            ],
            [run_id, generation, state_version, phase, checkpoint_digest, export[:500]],
        )
        if not isinstance(reply, list) or not reply or _text(reply[0]) not in _OUTCOMES:
            raise StoreProtocolError(
                "unexpected reply from purge_run", run_id=run_id, script="purge_run"
            )
        outcome = _text(reply[0])
        if outcome == "purged" and not inline:
            self._index_purged(run_id)  # Cluster: the run's own shard of each index
        return outcome

    def tombstone(self, run_id: str) -> dict[str, str] | None:
        """The tombstone a purge left for ``run_id`` (None: the run was never purged).

        Raises ContractError (a bad id), StoreUnavailableError.
        """
        check_id(run_id, "run_id")
        raw = self._call(
            "tombstone", run_id, lambda: self._client.hgetall(run_keys(run_id).tombstone)
        )
        if not raw:
            return None
        return {_text(k): _text(v) for k, v in raw.items()}
