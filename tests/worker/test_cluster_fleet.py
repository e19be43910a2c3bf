"""A fleet whose state is on a three-master Redis Cluster (``redis+cluster://``) and whose
RQ queue is on a Redis of its own: real worker processes, a master killed and restarted
on its folder while runs are in flight."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from ratchet.adapters.workspace import WorkspaceAdapter
from ratchet.demo.examples import RIGHT_GREETING
from ratchet.errors import ConfigurationError
from ratchet.fleet.context import Fleet
from ratchet.fleet.redisurl import parse_cluster_url
from ratchet.fleet.settings import Settings
from ratchet.leasing import RUNS_INDEX, RedisStore, run_keys
from ratchet.ops.reindex import index_phases
from ratchet.redis_server import RedisServer
from ratchet.testing.cluster import LocalCluster
from tests.conftest import test_sandbox_mode
from tests.worker.conftest import CHECKPOINT_KEY_HEX
from tests.worker.fleet_harness import phase, poll, submit_greetings, workers

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path / "cluster", appendfsync="always") as started:
        RedisStore(started.client()).identity.init_epoch()
        yield started


@pytest.fixture
def queue_redis(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "queue") as server:
        yield server


def _url(cluster: LocalCluster) -> str:
    return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in cluster.servers)


def _settings(cluster: LocalCluster, tmp_path: Path) -> Settings:
    return Settings(
        redis_url=SecretStr(_url(cluster)),
        state_dir=tmp_path / "state",
        queue=f"q-{secrets.token_hex(4)}",
        lease_ttl_ms=1500,
        renew_interval_ms=300,
        reaper_interval_ms=200,
        pickup_timeout_ms=3000,
        job_timeout_s=600,
        checkpoint_key=SecretStr(CHECKPOINT_KEY_HEX),
        verifier_sandbox=test_sandbox_mode(),
    )


def test_a_fleet_on_a_cluster_finishes_every_run_across_a_master_killed_and_restarted(
    cluster: LocalCluster,
    queue_redis: RedisServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RATCHET_QUEUE_REDIS_URL", queue_redis.url)
    settings = _settings(cluster, tmp_path)
    fleet = Fleet.connect(settings)
    runs = submit_greetings(fleet, tmp_path, 9, think_ms=60)
    client = cluster.client()
    masters = {client.get_node_from_key(run_keys(r).lease).port for r in runs}
    assert len(masters) >= 2  # the runs' slots are spread over the masters
    # The queue is not on the cluster: RQ's keys are on its own server.
    assert queue_redis.client().keys("rq:*")
    with workers(settings) as pool:
        pool.start(2, env={"RATCHET_QUEUE_REDIS_URL": queue_redis.url})
        poll(
            lambda: any(phase(fleet, r) == "completed" for r in runs),
            deadline_s=90,
            what="a first run completed",
        )
        busiest = max(
            cluster.servers,
            key=lambda s: sum(
                1 for r in runs if client.get_node_from_key(run_keys(r).lease).port == s.port
            ),
        )
        busiest.kill()  # its slots are down: their runs wait, the others go on
        busiest.start()  # on its folder (AOF always): every acknowledged commit is back
        poll(
            lambda: all(_phase_or_none(fleet, r) == "completed" for r in runs),
            deadline_s=180,
            what="every run completed",
        )
    for run_id, root in runs.items():
        with WorkspaceAdapter(root, ["app.py"]) as adapter:
            assert adapter.effects == 1, run_id
        assert (root / "app.py").read_text() == RIGHT_GREETING
    # A commit that moved a run's phase while the master holding its index shard was
    # down applied, but its index move (a separate call on a Cluster) did not: the run
    # stays listed under its old phase alone, never twice or nowhere, until `ratchet
    # store init` lists it under its recorded phase (docs/redis.md, "Redis Cluster").
    counts = fleet.store.phase_counts()
    assert counts["completed"] + counts["running"] == len(runs)
    report = index_phases(fleet)
    assert report.unverifiable == {}
    assert fleet.store.phase_counts()["completed"] == len(runs)
    # The listing merges the index's shards: every run once, a page at a time.
    listed: list[str] = []
    after = None
    while True:
        page = fleet.store.list_runs("completed", limit=2, after=after)
        listed += [row.run_id for row in page.rows]
        assert all(row.phase == "completed" and row.problem is None for row in page.rows)
        after = page.next_cursor
        if after is None:
            break
    assert sorted(listed) == sorted(runs)
    # An entry left in a one-key index by a worker of the version before the shards (a
    # rolling upgrade) is moved into its shard by store init.
    straggler = next(iter(runs))
    client.zadd(RUNS_INDEX, {straggler: 1})
    assert index_phases(fleet).migrated == 1
    assert client.exists(RUNS_INDEX) == 0
    assert fleet.store.run_count() == len(runs)


def _phase_or_none(fleet: Fleet, run_id: str) -> str | None:
    try:
        return phase(fleet, run_id)
    except Exception:
        return None


def test_a_cluster_store_without_a_queue_redis_of_its_own_is_refused(
    cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RATCHET_QUEUE_REDIS_URL", raising=False)
    with pytest.raises(ConfigurationError, match="RQ cannot use a Redis Cluster"):
        Fleet.connect(_settings(cluster, tmp_path))


def test_a_cluster_url_is_parsed_and_a_malformed_one_is_refused_without_its_password() -> None:
    nodes, user, password = parse_cluster_url("redis+cluster://u:pw-9@127.0.0.1:7000,h:7001")
    assert (nodes, user, password) == ([("127.0.0.1", 7000), ("h", 7001)], "u", "pw-9")
    for bad in ("redis+cluster://u:pw-9@127.0.0.1:7000/0", "redis+cluster://u:pw-9@h"):
        with pytest.raises(ConfigurationError) as caught:
            parse_cluster_url(bad)
        assert "pw-9" not in str(caught.value)
