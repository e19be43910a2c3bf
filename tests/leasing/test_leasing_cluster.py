"""Every script on a three-master Redis Cluster on loopback, for runs on different slots."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.crc import key_slot

from ratchet.errors import (
    ContractError,
    GenerationMismatchError,
    LeaseLostError,
    NonceReplayError,
)
from ratchet.leasing import RedisStore, run_keys
from ratchet.leasing.keyspace import (
    EXPIRY_INDEX,
    INDEX_SHARDS,
    PHASES,
    RUNS_INDEX,
    IndexLayout,
    expiry_shard,
    phase_index,
)
from ratchet.leasing.scripts import ScriptName, load_script
from ratchet.runtime.ports import Advance, Release, RunKey
from ratchet.testing.cluster import LocalCluster
from ratchet.worker.reaper import Reaper

pytestmark = pytest.mark.cluster

SHARDED = IndexLayout(INDEX_SHARDS)


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


def test_a_reload_after_noscript_goes_to_the_node_that_answered_it_only(
    cluster_store: RedisStore, new_run_id: Any
) -> None:
    """A master that lost its scripts gets the missing one again; the other masters are
    not asked, so a reload never waits on (or fails for) a master that is down."""
    store = cluster_store
    client = store.client
    run_ids = runs_on_every_master(client, new_run_id())
    for run_id in run_ids:
        store.create_run(run_id, task_id="t", env_instance_id="e", scenario=b"s", checkpoint=b"g1")
    client.script_flush()
    assert store.acquire(run_ids[0], owner="w1", ttl_ms=60_000) is not None
    sha = load_script(ScriptName.ACQUIRE_LEASE).sha
    own = client.get_node_from_key(run_keys(run_ids[0]).lease)
    loaded = {
        node.name: client.get_redis_connection(node).script_exists(sha)[0]
        for node in client.get_primaries()
    }
    assert loaded == {node.name: node.name == own.name for node in client.get_primaries()}


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
        run.commit_batch(key, [Advance(3, b"g4")], release=Release(reap=True))
        snap = store.read_run(run_id)
        assert snap.generation == 4 and snap.owner is None
        assert store.expiry.expiry_score(run_id) is not None


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
        run.commit_batch(
            RunKey("t", run_id, "e"),
            [Advance(1, b"g2", phase="running"), Advance(2, b"g3", phase="awaiting_approval")],
            release=Release(),
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
    # Each phase index is sharded: the runs of this test are in three shards' keys.
    for run_id in run_ids:
        assert store.client.zscore(SHARDED.phase_of("running", run_id), run_id) is None or (
            run_id == run_ids[2]
        )
        assert store.client.zscore(phase_index("running"), run_id) is None  # not one key
    # A run whose recorded phase lost its index entry (a crash between the calls), and
    # one listed under a phase it left too, are found and listed under their phase alone.
    store.client.zrem(SHARDED.phase_of("running", run_ids[2]), run_ids[2])
    store.client.zadd(SHARDED.phase_of("failed", run_ids[1]), {run_ids[1]: 1})
    stale = set(store.runs_missing_phase())
    assert {(run_ids[2], "running"), (run_ids[1], "awaiting_approval")} <= stale
    assert store.record_phase(run_ids[2], "running")
    assert store.record_phase(run_ids[1], "awaiting_approval")
    assert store.client.zscore(SHARDED.phase_of("running", run_ids[2]), run_ids[2]) is not None
    assert store.client.zscore(SHARDED.phase_of("failed", run_ids[1]), run_ids[1]) is None
    assert not {r for r, _ in store.runs_missing_phase()} & set(run_ids)


def listed_under(client: Any, run_id: str) -> set[str]:
    return {
        phase
        for phase, key in zip(PHASES, SHARDED.phases_of(run_id), strict=True)
        if client.zscore(key, run_id) is not None
    }


def test_every_index_of_a_run_is_in_one_shard_and_the_shards_spread_over_the_masters(
    cluster_store: RedisStore, new_run_id: Any
) -> None:
    """All of one run's index entries share a slot (one transaction writes them); the
    shards' slots spread over every master."""
    client = cluster_store.client
    run_id = new_run_id()
    assert len({key_slot(k.encode()) for k in SHARDED.keys_of(run_id)}) == 1
    masters = {client.get_node_from_key(k).name for k in SHARDED.runs()}
    assert masters == {node.name for node in client.get_primaries()}
    assert len(SHARDED.keys_of()) == INDEX_SHARDS * (2 + len(PHASES))


def created_and_leased(store: RedisStore, run_id: str) -> Any:
    """A new run, leased by ``w1``."""
    store.create_run(run_id, task_id="t", env_instance_id="e", scenario=b"s", checkpoint=b"g1")
    run = store.acquire(run_id, owner="w1", ttl_ms=60_000)
    assert run is not None
    return run


def test_an_acquire_repairs_a_phase_entry_a_crash_left_stale(
    cluster_store: RedisStore, new_run_id: Any
) -> None:
    """A worker that died between its commit and the index move left the run listed under
    its old phase: the next acquire lists it under the phase its state hash records."""
    store = cluster_store
    client = store.client
    run_id = new_run_id()
    run = created_and_leased(store, run_id)
    run.commit_batch(RunKey("t", run_id, "e"), [Advance(1, b"g2", phase="awaiting_approval")])
    assert listed_under(client, run_id) == {"awaiting_approval"}
    # The crash window, as it would leave the shard: the move never happened.
    client.zrem(SHARDED.phase_of("awaiting_approval", run_id), run_id)
    client.zadd(SHARDED.phase_of("running", run_id), {run_id: 1})
    run.release()
    assert store.list_runs("running", limit=1000).rows  # listed stale meanwhile...
    again = store.acquire(run_id, owner="w2", ttl_ms=60_000)
    assert again is not None
    assert listed_under(client, run_id) == {"awaiting_approval"}  # ...repaired
    assert run_id in {r.run_id for r in store.list_runs("awaiting_approval", limit=1000).rows}
    assert run_id not in {r.run_id for r in store.list_runs("running", limit=1000).rows}


def test_junk_at_a_phase_shard_defers_the_moves_of_its_runs_and_fails_no_commit(
    cluster_store: RedisStore, new_run_id: Any
) -> None:
    """A bad record at one shard's key affects that shard's index entries only: a commit
    that moves a run of it applies, its move waits, and is repaired once the key is
    sound again."""
    store = cluster_store
    client = store.client
    run_id = new_run_id()
    run = created_and_leased(store, run_id)
    junk = SHARDED.phase_of("needs_review", run_id)
    client.set(junk, b"not a sorted set")
    try:
        before = store.index_moves_deferred
        run.commit_batch(RunKey("t", run_id, "e"), [Advance(1, b"g2", phase="needs_review")])
        assert store.read_run(run_id).generation == 2  # applied, and no error raised
        assert store.index_moves_deferred == before + 1
        assert client.zscore(SHARDED.phase_of("running", run_id), run_id) is not None
        assert store.repair_deferred_moves() == 0  # the junk is still there: kept
    finally:
        client.delete(junk)
    assert store.repair_deferred_moves() == 1
    assert listed_under(client, run_id) == {"needs_review"}


def walk(store: RedisStore, phase: str | None, limit: int, oldest_first: bool) -> list[str]:
    seen: list[str] = []
    after = None
    while True:
        page = store.list_runs(phase, limit=limit, after=after, oldest_first=oldest_first)
        seen += [row.run_id for row in page.rows]
        after = page.next_cursor
        if after is None:
            return seen


def test_sharded_listings_merge_the_shards_in_order_with_exact_cursors_on_ties(
    cluster_store: RedisStore,
) -> None:
    """Entries of one phase spread over the shards, many with equal scores: every page
    size, both orders, lists each entry once, in (score, member) order as one key would;
    an entry removed at the cursor's score between pages does not shift the walk."""
    store = cluster_store
    client = store.client
    phase = "cancelled"  # no other test of this module lists runs under it
    members = [f"tie-{i:03d}" for i in range(60)]
    entries = {m: float(1000 + (i % 4)) for i, m in enumerate(members)}  # 15 per score
    for member, score in entries.items():
        client.zadd(SHARDED.phase_of(phase, member), {member: score})
    assert len({SHARDED.phase_of(phase, m) for m in members}) >= 8
    everything = sorted(
        (s, m) for k in SHARDED.phase(phase) for m, s in client.zrange(k, 0, -1, withscores=True)
    )
    oldest = [m.decode() for _, m in everything]
    assert set(members) <= set(oldest)
    for limit in (1, 2, 7, 15, 16, 1000):
        assert walk(store, phase, limit, True) == oldest
        assert walk(store, phase, limit, False) == oldest[::-1]
    # Removing entries at the cursor's score between two pages: the rest, once each.
    page = store.list_runs(phase, limit=5, oldest_first=True)
    assert [r.run_id for r in page.rows] == oldest[:5]
    for gone in (oldest[4], oldest[2], oldest[9]):
        client.zrem(SHARDED.phase_of(phase, gone), gone)
    # ...and adding some at that score behind the cursor (not listed: the walk passed
    # their place) and one ahead of it (listed).
    cursor_member = oldest[4]
    behind = [f"{m}0" for m in oldest[:4]]
    ahead = f"{cursor_member}1"
    for member in [*behind, ahead]:
        assert entries[oldest[0]] == entries[cursor_member]
        client.zadd(SHARDED.phase_of(phase, member), {member: entries[cursor_member]})
    rest: list[str] = []
    after = page.next_cursor
    while after is not None:
        more = store.list_runs(phase, limit=3, after=after, oldest_first=True)
        rest += [r.run_id for r in more.rows]
        after = more.next_cursor
    assert rest == [ahead] + [m for m in oldest[5:] if m != oldest[9]]
    assert store.phase_counts()[phase] == len(oldest) - 3 + 5
    # A single Redis' cursor (one shard) is refused by a sharded store, in one line.
    with pytest.raises(ContractError, match="number of index shards"):
        store.list_runs(phase, after=_one_shard_cursor(), oldest_first=True)
    # A search walks the same merged order, stopping mid-chunk at its limit or budget and
    # going on from its cursor: every match once, in order.
    now = walk(store, phase, 1000, True)
    matches = [m for m in now if m.startswith("tie-01")]
    assert len(matches) >= 5
    for limit, budget in ((1, 1000), (3, 7), (2, 1)):
        found: list[str] = []
        after = None
        for _ in range(200):
            page = store.search_runs(
                "tie-01", phase, limit=limit, after=after, oldest_first=True, budget=budget
            )
            found += [row.run_id for row in page.rows]
            after = page.next_cursor
            if after is None:
                break
        assert found == matches, (limit, budget)


def _one_shard_cursor() -> str:
    import base64

    return base64.urlsafe_b64encode(b"o:1000.0:1:tie-000").rstrip(b"=").decode()


def test_a_finished_run_is_found_by_its_phase_index_shards_and_purged_from_every_index(
    cluster_store: RedisStore, new_run_id: Any
) -> None:
    """Retention on a Cluster: the runs that entered a terminal phase before a time are
    read from every shard, and a purge leaves the run in no shard of any index."""
    store = cluster_store
    client = store.client
    run_ids = [new_run_id() for _ in range(6)]
    for run_id in run_ids:
        store.create_run(run_id, task_id="t", env_instance_id="e", scenario=b"s", checkpoint=b"g1")
        run = store.acquire(run_id, owner="w1", ttl_ms=60_000)
        assert run is not None
        run.commit_batch(
            RunKey("t", run_id, "e"), [Advance(1, b"g2", phase="completed")], release=Release()
        )
    assert len({SHARDED.phase_of("completed", r) for r in run_ids}) > 1
    found = store.entered_before("completed", store.server_time_ms(), limit=100_000)
    assert set(run_ids) <= set(found)
    assert found == sorted(
        found, key=lambda r: (client.zscore(SHARDED.phase_of("completed", r), r), r)
    )
    gone = run_ids[0]
    snap = store.read_run(gone)
    assert (
        store.purge_run(
            gone,
            generation=snap.generation,
            state_version=snap.state_version,
            phase="completed",
            checkpoint_digest="0" * 64,
        )
        == "purged"
    )
    assert all(client.zscore(key, gone) is None for key in SHARDED.keys_of(gone))
    assert gone not in store.entered_before("completed", store.server_time_ms(), limit=100_000)
    assert gone not in store.run_ids(limit=100_000)


def test_store_init_moves_a_pre_shard_cluster_stores_index_entries_into_the_shards(
    cluster_store: RedisStore, new_run_id: Any
) -> None:
    """A Cluster store written before the indexes were sharded kept one key per index:
    the migration moves every entry into its run's shard and removes the old keys."""
    store = cluster_store
    client = store.client
    run_ids = [new_run_id() for _ in range(5)]
    for run_id in run_ids:
        store.create_run(run_id, task_id="t", env_instance_id="e", scenario=b"s", checkpoint=b"g1")
        for key in SHARDED.keys_of(run_id):  # as an older store would have it
            client.zrem(key, run_id)
        client.zadd(RUNS_INDEX, {run_id: 7})
        client.zadd(phase_index("running"), {run_id: 8})
        client.zadd(EXPIRY_INDEX, {run_id: 9})
    client.zadd(RUNS_INDEX, {"not a run id{}": 1})
    assert store.migrate_unsharded_indexes(chunk=2) == 15
    for key in (RUNS_INDEX, phase_index("running"), EXPIRY_INDEX):
        assert client.exists(key) == 0
    for run_id in run_ids:
        assert client.zscore(SHARDED.runs_of(run_id), run_id) == 7
        assert client.zscore(SHARDED.phase_of("running", run_id), run_id) == 8
        assert store.expiry.expiry_score(run_id) == 9
    assert store.migrate_unsharded_indexes() == 0  # nothing left: running it again is a no-op
    assert not {r for r, _ in store.runs_missing_phase()} & set(run_ids)


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
    shards = {expiry_shard(r, INDEX_SHARDS) for r in run_ids}
    assert len(shards) >= 8  # spread over the shards...
    masters = {client.get_node_from_key(k).name for k in shards}
    assert len(masters) >= 2  # ...and the shards over the masters
    for run_id in run_ids:
        assert client.zscore(expiry_shard(run_id, INDEX_SHARDS), run_id) is not None
        assert store.expiry.expiry_score(run_id) is not None
        assert client.zscore(EXPIRY_INDEX, run_id) is None  # not the single-Redis key
    poll_until(lambda: {r for r, _ in store.expiry.expired_entries(limit=1000)} >= set(run_ids))
    entries = store.expiry.expired_entries(limit=1000)
    assert [score for _, score in entries] == sorted(score for _, score in entries)
    assert len(store.expiry.expired_entries(limit=5)) == 5
    assert set(run_ids) <= store.expiry.expiry_members()
    # What removes a run for good names its own shard.
    assert expiry_shard(run_ids[0], INDEX_SHARDS) in store.index_keys(run_ids[0])


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
        poll_until(lambda: {r for r, _ in store.expiry.expired_entries(limit=1000)} >= set(run_ids))
        shard_port = {
            r: client.get_node_from_key(expiry_shard(r, INDEX_SHARDS)).port for r in run_ids
        }
        victim = cluster.servers[0]
        readable = {r for r, port in shard_port.items() if port != victim.port}
        assert readable and readable != set(run_ids)
        # A run whose own slot survives but whose index shard is on the dead master.
        moving = next(
            r
            for r in run_ids
            if shard_port[r] == victim.port
            and client.get_node_from_key(run_keys(r).lease).port != victim.port
        )
        run = store.acquire(moving, owner="w1", ttl_ms=60_000)
        assert run is not None
        victim.kill()
        try:
            seen = {r for r, _ in store.expiry.expired_entries(limit=1000)}
            assert seen == readable  # every shard on a live master, none of the dead one's
            assert store.expiry.expiry_shards_unreadable > 0
            # Its commit applies and is acknowledged; the phase move waits for a repair.
            run.commit_batch(
                RunKey("t", moving, "e"), [Advance(1, b"g2", phase="awaiting_approval")]
            )
            assert store.index_moves_deferred == 1
            assert store.repair_deferred_moves() == 0  # its shard is still down: kept
        finally:
            victim.start()
            cluster.wait_ok()
        expired = set(run_ids) - {moving}  # the one acquired again holds a live lease
        poll_until(lambda: {r for r, _ in store.expiry.expired_entries(limit=1000)} >= expired)
        assert store.expiry.expiry_shards_unreadable == 0
        assert store.read_run(moving).generation == 2  # the commit applied
        assert listed_under(client, moving) == {"running"}  # stale until...
        reaper = Reaper(store, lambda _run: None, interval_ms=50).start()
        try:  # ...a reaper tick of the worker that deferred it, with no acquire needed
            poll_until(lambda: listed_under(client, moving) == {"awaiting_approval"})
        finally:
            reaper.stop()
        assert store.repair_deferred_moves() == 0  # nothing is left deferred
        client.close()
