"""Reaper claims: one re-enqueue per lease expiry, and index entries removed only if unchanged."""

from __future__ import annotations

import threading
from collections.abc import Callable

from ratchet.leasing import RedisStore
from ratchet.runtime.ports import RunKey


def test_a_live_lease_cannot_be_claimed_for_reaping(
    store: RedisStore, make_run: Callable[..., RunKey]
) -> None:
    key = make_run()
    store.acquire(key.run_id, owner="w-1", ttl_ms=60_000)
    claim = store.claim_reap(key.run_id)
    assert (claim.claimed, claim.status) == (False, "live")


def test_an_expired_lease_is_claimed_once_per_lease_version(
    store: RedisStore,
    make_run: Callable[..., RunKey],
    expire: Callable[[RedisStore, str], None],
) -> None:
    key = make_run()
    first = store.acquire(key.run_id, owner="w-1", ttl_ms=30)
    assert first is not None
    expire(store, key.run_id)
    claims = [store.claim_reap(key.run_id) for _ in range(5)]
    assert [c.claimed for c in claims] == [True, False, False, False, False]
    assert {c.status for c in claims[1:]} == {"already"}
    assert claims[0].lease_version == first.lease_version
    # A new holder whose lease expires again makes a new claim possible.
    second = store.acquire(key.run_id, owner="w-2", ttl_ms=30)
    assert second is not None
    expire(store, key.run_id)
    assert store.claim_reap(key.run_id).claimed


def test_racing_reapers_claim_one_expiry_exactly_once(
    store: RedisStore,
    make_run: Callable[..., RunKey],
    expire: Callable[[RedisStore, str], None],
) -> None:
    key = make_run()
    store.acquire(key.run_id, owner="w-1", ttl_ms=30)
    expire(store, key.run_id)
    wins: list[bool] = []
    lock = threading.Lock()
    go = threading.Barrier(8)

    def reaper() -> None:
        go.wait(timeout=10)
        claimed = store.claim_reap(key.run_id).claimed
        with lock:
            wins.append(claimed)

    threads = [threading.Thread(target=reaper) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert sorted(wins) == [False] * 7 + [True]


def test_a_stale_claim_can_be_taken_again_after_the_reclaim_delay(
    store: RedisStore,
    make_run: Callable[..., RunKey],
    expire: Callable[[RedisStore, str], None],
) -> None:
    key = make_run()
    store.acquire(key.run_id, owner="w-1", ttl_ms=30)
    expire(store, key.run_id)
    assert store.claim_reap(key.run_id, reclaim_after_ms=60_000).claimed
    assert store.claim_reap(key.run_id, reclaim_after_ms=0).claimed  # its reaper died


def test_unknown_runs_are_reported_not_claimed(store: RedisStore) -> None:
    claim = store.claim_reap("t-never-created-0001")
    assert (claim.claimed, claim.status) == (False, "no_run")


def test_an_index_entry_is_dropped_only_while_its_score_is_unchanged(
    store: RedisStore,
    make_run: Callable[..., RunKey],
    expire: Callable[[RedisStore, str], None],
) -> None:
    key = make_run()
    store.acquire(key.run_id, owner="w-1", ttl_ms=30)
    expire(store, key.run_id)
    entries = dict(store.expiry.expired_entries(limit=10_000))
    score = entries[key.run_id]
    # A worker re-acquires between the reaper's read and its drop: the entry must stay.
    store.acquire(key.run_id, owner="w-2", ttl_ms=60_000)
    assert store.expiry.drop_expiry_entry(key.run_id, score) is False
    fresh = store.client.zscore("ratchet:index:expiry", key.run_id)
    assert fresh is not None and int(fresh) != score
    assert store.expiry.drop_expiry_entry(key.run_id, int(fresh)) is True
    assert store.expiry.drop_expiry_entry(key.run_id, int(fresh)) is False
