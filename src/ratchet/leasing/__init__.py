"""Leases, fenced checkpoint commits and generation high-water marks on Redis.

The protocol is in :mod:`ratchet.leasing.store` and the script headers under
``ratchet/leasing/lua/``; key names are in :mod:`ratchet.leasing.keyspace`; every reply is
decoded in :mod:`ratchet.leasing.replies`. Starting a real ``redis-server`` (embedded
use, tests, drills) is not part of the protocol: it is :mod:`ratchet.redis_server`.

Typical use by a worker::

    store = RedisStore.from_url("redis://127.0.0.1:6379/0")
    run = store.acquire("r-42", owner="worker-7", ttl_ms=30_000)
    if run is None:
        return                      # another live worker holds it
    checkpoint = run.load(key)      # GenerationStore port: generation checked against Redis
    run.commit_batch(key, [Advance(checkpoint.generation, next_blob)])
"""

from __future__ import annotations

from ratchet.leasing.handle import LeasedRun, RunCreator, new_commit_id
from ratchet.leasing.keyspace import EXPIRY_INDEX, RUNS_INDEX, RunKeys, nonce_key, run_keys
from ratchet.leasing.results import (
    Acquired,
    CommitResult,
    Lease,
    LeaseHolder,
    PreparedCommit,
    ReapClaim,
    Released,
    RunCreated,
    RunSnapshot,
)
from ratchet.leasing.store import DEFAULT_MAX_CHECKPOINT_BYTES, RedisStore

__all__ = [
    "DEFAULT_MAX_CHECKPOINT_BYTES",
    "EXPIRY_INDEX",
    "RUNS_INDEX",
    "Acquired",
    "CommitResult",
    "Lease",
    "LeaseHolder",
    "LeasedRun",
    "PreparedCommit",
    "ReapClaim",
    "RedisStore",
    "Released",
    "RunCreated",
    "RunCreator",
    "RunKeys",
    "RunSnapshot",
    "new_commit_id",
    "nonce_key",
    "run_keys",
]
