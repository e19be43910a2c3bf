"""Every script on a three-master Redis Cluster on loopback, for runs on different slots."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.crc import key_slot

from ratchet.errors import GenerationMismatchError, LeaseLostError, NonceReplayError
from ratchet.leasing import RedisStore, run_keys
from ratchet.leasing.keys import EXPIRY_INDEX, EXPIRY_SHARDS, expiry_shard, phase_index
from ratchet.runtime.ports import Advance, RunKey
from ratchet.testing.cluster import LocalCluster

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(Path(tmp_path_factory.mktemp("cluster"))) as started:
        yield started


@pytest.fixture
def cluster_store(cluster: LocalCluster) -> Iterator[RedisStore]:
    client = cluster.client()
    yield RedisStore(client)
    client.close()


def runs_on_every_master(client: Any, prefix: str) -> list[str]:
    """One run id per master, so the scripts run on every node of the cluster."""
    wanted = {node.name for node in client.get_primaries()}
    chosen: dict[str, str] = {}
    for i in range(10_000):
        run_id = f"{prefix}-{i}"
        node = client.get_node_from_key(run_keys(run_id).lease)
        chosen.setdefault(node.name, run_id)
        if set(chosen) == wanted:
            break
    assert set(chosen) == wanted
    return list(chosen.values())


def test_every_script_runs_for_runs_whose_keys_land_on_different_masters(
    cluster_store: RedisStore, new_run_id: Any
) -> None:
    store = cluster_store
    run_ids = runs_on_every_master(store.client, new_run_id())
    assert len({key_slot(r.encode()) for r in run_ids}) == len(run_ids) == 3
    nonce = f"n-{new_run_id()}"
    for index, run_id in enumerate(run_ids):
        key = RunKey("t", run_id, "e")
        created = store.create_run(
            run_id,
            task_id="t",
            env_instance_id="e",
            scenario=b"s",
            checkpoint=b"g1",
            commit_id="create-1",
        )
        assert store.create_run(
            run_id,
            task_id="t",
            env_instance_id="e",
            scenario=b"s",
            checkpoint=b"g1",
            commit_id="create-1",
        ).already_applied
        assert created.generation == 1
        run = store.acquire(run_id, owner="w1", ttl_ms=60_000)
        assert run is not None
        assert store.acquire(run_id, owner="w2", ttl_ms=60_000) is None
        assert run.high_water(key) == 1
        if index == 0:
            run.commit_batch(key, [Advance(expected_generation=1, blob=b"g2", nonces=[nonce])])
        else:
            with pytest.raises(NonceReplayError):
                run.commit_batch(key, [Advance(expected_generation=1, blob=b"g2", nonces=[nonce])])
            run.commit_batch(key, [Advance(expected_generation=1, blob=b"g2")])
        again = run.commit(b"g3", commit_id="c-3")
        assert run.commit(b"g3", generation=3, commit_id="c-3").already_applied
        assert again.generation == 3
        with pytest.raises(GenerationMismatchError):
            run.commit(b"g9", generation=9)
        run.renew()
        assert run.load(key).blob == b"g3"
        snap = store.read_run(run_id, with_checkpoint=True, with_scenario=True)
        assert (snap.generation, snap.checkpoint, snap.scenario) == (3, b"g3", b"s")
        run.release()
        with pytest.raises(LeaseLostError):
            run.renew()
        assert store.acquire(run_id, owner="w2", ttl_ms=60_000) is not None
    assert set(run_ids) <= set(store.run_ids(limit=100_000))


def test_scripts_are_reloaded_on_every_master_after_script_flush(
    cluster_store: RedisStore, new_run_id: Any
) -> None:
    store = cluster_store
    run_ids = runs_on_every_master(store.client, new_run_id())
    for run_id in run_ids:
        store.create_run(run_id, task_id="t", env_instance_id="e", scenario=b"s", checkpoint=b"g1")
    store.client.script_flush()
    for run_id in run_ids:
        run = store.acquire(run_id, owner="w1", ttl_ms=60_000)
        assert run is not None
        run.commit(b"g2")
        assert store.read_run(run_id).generation == 2


def test_batched_commits_and_archives_run_on_every_master_also_after_script_flush(
    cluster_store: RedisStore, new_run_id: Any
) -> None:
    store = cluster_store
    run_ids = runs_on_every_master(store.client, new_run_id())
    for run_id in run_ids:
        store.create_run(run_id, task_id="t", env_instance_id="e", scenario=b"s", checkpoint=b"g1")
    store.client.script_flush()
    for run_id in run_ids:
        key = RunKey("t", run_id, "e")
        run = store.acquire(run_id, owner="w1", ttl_ms=60_000)
        assert run is not None
        run.commit_batch(key, [Advance(1, b"g2", segment=b"s2"), Advance(2, b"g3")])
        snap = store.read_run(run_id, with_checkpoint=True)
        assert (snap.generation, snap.state_version, snap.checkpoint) == (3, 3, b"g3")
        assert snap.archive == (b"s2",)  # the archive shares the run's slot
        with pytest.raises(GenerationMismatchError):
            run.commit_batch(key, [Advance(1, b"old-2"), Advance(2, b"old-3")])
        assert store.read_run(run_id).generation == 3
        # The last commit carries the release; the expiry index (another slot) follows.
        run.release_with_next_commit(reap=True)
        run.commit_batch(key, [Advance(3, b"g4")])
        snap = store.read_run(run_id)
        assert snap.generation == 4 and snap.owner is None
        assert store.expiry_score(run_id) is not None


def test_phase_indexes_counts_and_pages_follow_runs_on_every_master(
    cluster_store: RedisStore, new_run_id: Any
) -> None:
    """In a Cluster the phase indexes live in other slots: the store moves runs between
    them after each script, and a page reads hashes on every master in one pipeline."""
    store = cluster_store
    run_ids = runs_on_every_master(store.client, new_run_id())
    before = store.phase_counts()
    for run_id in run_ids:
        store.create_run(run_id, task_id="t", env_instance_id="e", scenario=b"s", checkpoint=b"g1")
    assert store.phase_counts()["running"] == before["running"] + 3
    for run_id in run_ids[:2]:
        run = store.acquire(run_id, owner="w1", ttl_ms=60_000)
        assert run is not None
        run.release_with_next_commit()
        run.commit_batch(
            RunKey("t", run_id, "e"),
            [Advance(1, b"g2", phase="running"), Advance(2, b"g3", phase="awaiting_approval")],
        )
    counts = store.phase_counts()
    assert counts["running"] == before["running"] + 1
    assert counts["awaiting_approval"] == before["awaiting_approval"] + 2
    waiting = store.list_runs("awaiting_approval", limit=1000).rows
    assert {r.run_id for r in waiting} >= set(run_ids[:2])
    assert all(
        r.phase == "awaiting_approval" and r.problem is None for r in waiting if r.run_id in run_ids
    )
    seen: list[str] = []
    after = None
    while True:  # every run of this test once, one per page
        page = store.list_runs(limit=1, after=after)
        seen += [r.run_id for r in page.rows]
        after = page.next_cursor
        if after is None:
            break
    assert len(seen) == len(set(seen)) and set(run_ids) <= set(seen)
    # A run whose recorded phase lost its index entry (a crash between the calls) is
    # found and added back.
    store.client.zrem(phase_index("running"), run_ids[2])
    assert (run_ids[2], "running") in list(store.runs_missing_phase())
    assert store.record_phase(run_ids[2], "running")
    assert store.client.zscore(phase_index("running"), run_ids[2]) is not None


def test_the_expiry_index_is_sharded_over_the_masters_and_read_whole_by_the_reaper(
    cluster_store: RedisStore, new_run_id: Any
) -> None:
    """On a Cluster each run's expiry entry is in its own shard (a key of its own slot):
    the shards of a handful of runs land on several masters, and the reaper's read
    merges them, earliest first, up to its limit."""
    store = cluster_store
    client = store.client
    run_ids = [f"{new_run_id()}-{i}" for i in range(24)]
    for run_id in run_ids:
        store.create_run(run_id, task_id="t", env_instance_id="e", scenario=b"s", checkpoint=b"g1")
        run = store.acquire(run_id, owner="w1", ttl_ms=1)  # expired at once
        assert run is not None
    shards = {expiry_shard(r, EXPIRY_SHARDS) for r in run_ids}
    assert len(shards) >= 8  # spread over the shards...
    masters = {client.get_node_from_key(k).name for k in shards}
    assert len(masters) >= 2  # ...and the shards over the masters
    for run_id in run_ids:
        assert client.zscore(expiry_shard(run_id, EXPIRY_SHARDS), run_id) is not None
        assert store.expiry_score(run_id) is not None
        assert client.zscore(EXPIRY_INDEX, run_id) is None  # not the single-Redis key
    poll_until(lambda: {r for r, _ in store.expired_entries(limit=1000)} >= set(run_ids))
    entries = store.expired_entries(limit=1000)
    assert [score for _, score in entries] == sorted(score for _, score in entries)
    assert len(store.expired_entries(limit=5)) == 5
    assert set(run_ids) <= store.expiry_members()
    # What removes a run for good names its own shard.
    assert expiry_shard(run_ids[0], EXPIRY_SHARDS) in store.index_keys(run_ids[0])


def poll_until(done: Any, deadline_s: float = 5.0) -> None:
    end = time.monotonic() + deadline_s
    while not done():
        if time.monotonic() > end:
            raise AssertionError("condition not met in time")
        time.sleep(0.005)


def test_with_a_master_down_the_reaper_still_reads_the_other_masters_shards(
    tmp_path: Path,
) -> None:
    with LocalCluster(tmp_path / "own-cluster", appendfsync="always") as cluster:
        client = cluster.client()
        store = RedisStore(client)
        run_ids = [f"down-{i}" for i in range(40)]
        for run_id in run_ids:
            store.create_run(
                run_id, task_id="t", env_instance_id="e", scenario=b"s", checkpoint=b"g1"
            )
            assert store.acquire(run_id, owner="w1", ttl_ms=1) is not None
        poll_until(lambda: {r for r, _ in store.expired_entries(limit=1000)} >= set(run_ids))
        shard_port = {
            r: client.get_node_from_key(expiry_shard(r, EXPIRY_SHARDS)).port for r in run_ids
        }
        victim = cluster.servers[0]
        readable = {r for r, port in shard_port.items() if port != victim.port}
        assert readable and readable != set(run_ids)
        victim.kill()
        try:
            seen = {r for r, _ in store.expired_entries(limit=1000)}
            assert seen == readable  # every shard on a live master, none of the dead one's
            assert store.expiry_shards_unreadable > 0
        finally:
            victim.start()
            cluster.wait_ok()
        poll_until(lambda: {r for r, _ in store.expired_entries(limit=1000)} >= set(run_ids))
        assert store.expiry_shards_unreadable == 0
        client.close()
