"""Every script on a three-master Redis Cluster on loopback, for runs on different slots."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.crc import key_slot

from ratchet.errors import GenerationMismatchError, LeaseLostError, NonceReplayError
from ratchet.leasing import EXPIRY_INDEX, RedisStore, run_keys
from ratchet.leasing.keys import phase_index
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
        assert store.client.zscore(EXPIRY_INDEX, run_id) is not None


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
