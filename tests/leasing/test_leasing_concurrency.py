"""Real concurrency against a real server: exactly one of two racing commits wins."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import pytest

from ratchet.errors import GenerationMismatchError, LeaseLostError, StoreError
from ratchet.leasing import LeasedRun, RedisStore, run_keys
from tests.leasing.conftest import commit_one

ROUNDS = 100
TAKEOVER_ROUNDS = 25


def history_generations(store: RedisStore, run_id: str) -> list[int]:
    entries = store.client.lrange(run_keys(run_id).history, 0, -1)
    return [int(e.split(b"|")[0]) for e in entries]


def race(*calls: Callable[[], Any]) -> list[Any]:
    """Run the calls in threads released together by a barrier; return result or error."""
    barrier = threading.Barrier(len(calls), timeout=10)

    def run(call: Callable[[], Any]) -> Any:
        barrier.wait()
        try:
            return call()
        except StoreError as exc:
            return exc

    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        return [f.result(timeout=30) for f in [pool.submit(run, c) for c in calls]]


@pytest.fixture
def two_stores(real_redis_url: str) -> Any:
    a, b = RedisStore.from_url(real_redis_url), RedisStore.from_url(real_redis_url)
    yield a, b
    a.client.close()
    b.client.close()


def test_two_holders_of_the_same_generation_racing_to_commit_have_exactly_one_winner(
    two_stores: tuple[RedisStore, RedisStore], new_run_id: Callable[[], str]
) -> None:
    store_a, store_b = two_stores
    run_id = new_run_id()
    store_a.create_run(run_id, task_id="t", env_instance_id="e", scenario=b"s", checkpoint=b"g1")
    run = store_a.acquire(run_id, owner="w1", ttl_ms=120_000)
    assert run is not None
    for round_no in range(ROUNDS):
        gen = round_no + 2
        lease = run.lease
        blobs = {"a": b"a-%d" % gen, "b": b"b-%d" % gen}
        outcomes = race(
            partial(
                commit_one,
                store_a,
                lease,
                generation=gen,
                expected_state_version=gen - 1,
                checkpoint=blobs["a"],
            ),
            partial(
                commit_one,
                store_b,
                lease,
                generation=gen,
                expected_state_version=gen - 1,
                checkpoint=blobs["b"],
            ),
        )
        winners = [i for i, o in enumerate(outcomes) if not isinstance(o, Exception)]
        assert len(winners) == 1, outcomes
        loser = outcomes[1 - winners[0]]
        assert isinstance(loser, GenerationMismatchError) and loser.high_water == gen
        snap = store_a.read_run(run_id, with_checkpoint=True)
        assert snap.generation == gen
        assert snap.checkpoint == blobs["ab"[winners[0]]]
    # One history entry per generation: no loser left a trace (the history keeps the
    # newest 64 entries).
    history = history_generations(store_a, run_id)
    assert history == list(range(ROUNDS + 1, ROUNDS + 1 - len(history), -1))


def test_a_commit_racing_a_takeover_has_exactly_one_winner_and_nothing_of_the_loser_stored(
    two_stores: tuple[RedisStore, RedisStore], new_run_id: Callable[[], str]
) -> None:
    store_a, store_b = two_stores
    rng = random.Random(7)
    for _ in range(TAKEOVER_ROUNDS):
        takeover_round(store_a, store_b, new_run_id(), rng)


def takeover_round(
    store_a: RedisStore, store_b: RedisStore, run_id: str, rng: random.Random
) -> None:
    store_a.create_run(run_id, task_id="t", env_instance_id="e", scenario=b"s", checkpoint=b"g1")
    old = store_a.acquire(run_id, owner="old", ttl_ms=15)
    assert old is not None
    # The old owner commits around its expiry instant (by Redis' clock), so either side
    # may win; which one does is not asserted, only that exactly one does.
    target_ms = old.lease.expires_at_ms + rng.randint(-10, 3)

    def old_commits() -> Any:
        for _poll in range(10_000):
            if store_a.read_run(run_id).now_ms >= target_ms:
                break
        return old.commit(b"from-old", generation=2)

    def new_takes_over_and_commits() -> Any:
        # Both loaded generation 1; the new owner polls until the old lease expires.
        for _attempt in range(10_000):
            new: LeasedRun | None = store_b.acquire(run_id, owner="new", ttl_ms=60_000)
            if new is not None:
                return commit_one(
                    store_b,
                    new.lease,
                    generation=2,
                    expected_state_version=1,
                    checkpoint=b"from-new",
                )
        raise AssertionError("the old lease never expired")

    outcomes = race(old_commits, new_takes_over_and_commits)
    winners = [o for o in outcomes if not isinstance(o, Exception)]
    assert len(winners) == 1, outcomes
    snap = store_a.read_run(run_id, with_checkpoint=True)
    assert snap.generation == 2
    if isinstance(outcomes[0], Exception):
        assert isinstance(outcomes[0], LeaseLostError)
        assert snap.checkpoint == b"from-new"
    else:
        assert isinstance(outcomes[1], GenerationMismatchError)
        assert snap.checkpoint == b"from-old"
    assert history_generations(store_a, run_id) == [2, 1]
