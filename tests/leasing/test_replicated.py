"""The acknowledgement rule (``RATCHET_MIN_REPLICAS_ACK``) and Sentinel failover, on a real
primary, replica and Sentinel (:class:`ratchet.testing.sentinel.LocalReplicated`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from redis.cluster import RedisCluster

from ratchet.errors import (
    CommitOutcomeUnknownError,
    ConfigurationError,
    ReplicationUnconfirmedError,
)
from ratchet.fleet.redisurl import parse_sentinel_url, redis_client
from ratchet.leasing import RedisStore
from ratchet.testing.sentinel import LocalReplicated
from tests.leasing.conftest import commit_one


@pytest.fixture
def topology(tmp_path: Path) -> Iterator[LocalReplicated]:
    with LocalReplicated(tmp_path / "replicated") as topo:
        yield topo


def _store(topo: LocalReplicated, **kw: object) -> RedisStore:
    client = redis_client(topo.url, socket_timeout=5, socket_connect_timeout=2)
    return RedisStore(client, **kw)  # type: ignore[arg-type]


def _started(store: RedisStore, run_id: str) -> object:
    store.create_run(run_id, task_id="t", env_instance_id="e", scenario=b"s", checkpoint=b"g1")
    run = store.acquire(run_id, owner="w1", ttl_ms=600_000)
    assert run is not None
    return run


def test_a_commit_counts_only_once_the_replica_confirms_it_and_the_replica_has_it(
    topology: LocalReplicated, new_run_id: Callable[[], str]
) -> None:
    store = _store(topology, min_replicas_ack=1, replicas_ack_timeout_ms=2000)
    run = _started(store, new_run_id())
    result = run.commit(b"g2")  # type: ignore[attr-defined]
    assert (result.generation, result.already_applied) == (2, False)
    # WAIT confirmed it, so the replica holds it now (not some time later).
    (replica,) = topology.replicas
    snap = RedisStore(replica.client()).read_run(result.run_id, with_checkpoint=True)
    assert (snap.generation, snap.checkpoint) == (2, b"g2")


def test_a_commit_no_replica_confirms_raises_unconfirmed_with_the_counts(
    topology: LocalReplicated, new_run_id: Callable[[], str]
) -> None:
    store = _store(topology, min_replicas_ack=1, replicas_ack_timeout_ms=200)
    run_id = new_run_id()
    run = _started(store, run_id)
    (replica,) = topology.replicas
    replica.pause()  # SIGSTOP: connected, but it confirms nothing
    try:
        with pytest.raises(ReplicationUnconfirmedError) as caught:
            run.commit(b"g2")  # type: ignore[attr-defined]
    finally:
        replica.resume()
    err = caught.value
    assert isinstance(err, CommitOutcomeUnknownError)  # callers that only know that one
    assert (err.replicas_acked, err.replicas_required) == (0, 1)
    assert (err.run_id, err.generation) == (run_id, 2)
    # Applied on the primary all the same: it is unconfirmed, not refused.
    assert store.read_run(run_id).generation == 2


def test_a_retry_that_finds_its_commit_applied_is_unconfirmed_whatever_wait_counts(
    topology: LocalReplicated, new_run_id: Callable[[], str]
) -> None:
    """WAIT counts the writes of its own connection: a retry that wrote nothing (the
    commit applied by the call whose reply was lost) proves nothing by its count."""
    store = _store(topology, min_replicas_ack=1, replicas_ack_timeout_ms=2000)
    run = _started(store, new_run_id())
    dropped: list[str] = []

    def drop_first(_run_id: str, commit_id: str) -> bool:
        if dropped:
            return False
        dropped.append(commit_id)
        return True

    store.reply_hook = drop_first
    with pytest.raises(ReplicationUnconfirmedError) as caught:
        run.commit(b"g2")  # type: ignore[attr-defined]
    assert caught.value.replicas_acked == 0
    assert "earlier call" in caught.value.message


def test_without_the_rule_the_same_paused_replica_does_not_hold_a_commit_up(
    topology: LocalReplicated, new_run_id: Callable[[], str]
) -> None:
    store = _store(topology)
    run = _started(store, new_run_id())
    (replica,) = topology.replicas
    replica.pause()
    try:
        assert run.commit(b"g2").generation == 2  # type: ignore[attr-defined]
    finally:
        replica.resume()


def test_a_lease_no_replica_confirms_is_unconfirmed_and_a_held_one_writes_nothing(
    topology: LocalReplicated, new_run_id: Callable[[], str]
) -> None:
    """An acquire confirmed by the replicas also confirms the checkpoint it restores (one
    ordered stream); one that is not must not be used."""
    store = _store(topology, min_replicas_ack=1, replicas_ack_timeout_ms=200)
    run_id = new_run_id()
    store.create_run(run_id, task_id="t", env_instance_id="e", scenario=b"s", checkpoint=b"g1")
    (replica,) = topology.replicas
    replica.pause()
    try:
        with pytest.raises(ReplicationUnconfirmedError) as caught:
            store.acquire(run_id, owner="w1", ttl_ms=600_000)
        # Held (on the primary) by w1 now: another worker's try writes nothing, so it is
        # answered as held, not as unconfirmed.
        assert store.acquire(run_id, owner="w2", ttl_ms=600_000) is None
    finally:
        replica.resume()
    assert caught.value.lease_version > 0


def test_a_create_no_replica_confirms_is_unconfirmed_too(
    topology: LocalReplicated, new_run_id: Callable[[], str]
) -> None:
    store = _store(topology, min_replicas_ack=1, replicas_ack_timeout_ms=200)
    (replica,) = topology.replicas
    replica.pause()
    try:
        with pytest.raises(ReplicationUnconfirmedError):
            store.create_run(
                new_run_id(), task_id="t", env_instance_id="e", scenario=b"s", checkpoint=b"g1"
            )
    finally:
        replica.resume()


@pytest.mark.slow
def test_commits_the_replica_confirmed_survive_the_primary_killed_and_a_failover(
    topology: LocalReplicated, new_run_id: Callable[[], str]
) -> None:
    store = _store(topology, min_replicas_ack=1, replicas_ack_timeout_ms=2000)
    run_id = new_run_id()
    run = _started(store, run_id)
    for gen in range(2, 22):
        run.commit(b"ckpt-%d" % gen)  # type: ignore[attr-defined]
    old = topology.kill_primary()
    promoted = topology.wait_failover(old)
    assert promoted is not old
    # The same client follows Sentinel to the promoted replica: every confirmed commit
    # is there, and the lease still fences (the run's owner goes on from 21).
    snap = store.read_run(run_id, with_checkpoint=True)
    assert (snap.generation, snap.checkpoint) == (21, b"ckpt-21")
    # No replica is left to confirm anything: the next commit is applied, unconfirmed.
    with pytest.raises(ReplicationUnconfirmedError):
        run.commit(b"ckpt-22")  # type: ignore[attr-defined]
    # The old primary comes back on its folder as the new one's replica.
    topology.rejoin(old)
    assert old in topology.replicas
    # As for any unknown outcome: re-read, then go on from what the store holds.
    now = store.read_run(run_id)
    assert now.generation == 22
    result = commit_one(
        store,
        run.lease,  # type: ignore[attr-defined]
        generation=23,
        expected_state_version=now.state_version,
        checkpoint=b"ckpt-23",
    )
    assert result.generation == 23
    snap = RedisStore(old.client()).read_run(run_id, with_checkpoint=True)
    assert (snap.generation, snap.checkpoint) == (23, b"ckpt-23")


def test_a_sentinel_url_is_parsed_and_a_malformed_one_is_refused_without_its_password() -> None:
    target = parse_sentinel_url("redis+sentinel://u:s3cret@127.0.0.1:26379,[::1]:26380/svc/2")
    assert target.sentinels == [("127.0.0.1", 26379), ("::1", 26380)]
    assert (target.service, target.db, target.username, target.password) == (
        "svc",
        2,
        "u",
        "s3cret",
    )
    assert "s3cret" not in repr(target)
    for bad in (
        "redis+sentinel://u:s3cret@127.0.0.1/svc",
        "redis+sentinel://u:s3cret@127.0.0.1:26379/",
        "redis+sentinel://u:s3cret@127.0.0.1:26379/svc/x",
        "redis+sentinel://u:s3cret@127.0.0.1:99999/svc",
    ):
        with pytest.raises(ConfigurationError) as caught:
            parse_sentinel_url(bad)
        assert "s3cret" not in str(caught.value) and "s3cret" not in repr(caught.value)


def test_the_rule_is_refused_on_a_cluster_client_and_for_bad_counts() -> None:
    with pytest.raises(ConfigurationError):
        RedisStore(redis_client("redis://127.0.0.1:1/0"), min_replicas_ack=-1)
    with pytest.raises(ConfigurationError):
        RedisStore(
            redis_client("redis://127.0.0.1:1/0"), min_replicas_ack=1, replicas_ack_timeout_ms=0
        )
    # The check looks at the client's type only (no cluster has to run for it).
    with pytest.raises(ConfigurationError, match="Cluster"):
        RedisStore(object.__new__(RedisCluster), min_replicas_ack=1)
