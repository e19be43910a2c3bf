"""The commit script's own connection (``ScriptRunner.run(..., hot=True)``): commits of a
plain ``redis.Redis`` client go over one connection of the pool's making, which survives
being killed, never crosses a fork, and is not used for any other client."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import fakeredis
import pytest
import redis

from ratchet.errors import GenerationMismatchError
from ratchet.leasing import RedisStore, run_keys
from ratchet.leasing.scripts import ScriptName
from ratchet.redis_server import RedisServer
from ratchet.runtime.ports import Advance, RunKey
from tests.leasing.conftest import commit_one


def _run(store: RedisStore, run_id: str) -> tuple[Any, RunKey]:
    store.create_run(run_id, task_id="t", env_instance_id="e", scenario=b"s", checkpoint=b"g1")
    run = store.acquire(run_id, owner="w1", ttl_ms=60_000)
    assert run is not None
    return run, RunKey("t", run_id, "e")


@pytest.fixture
def line_store(shared_redis_server: RedisServer) -> Iterator[RedisStore]:
    """A store on a plain client of the session's server; its connections closed after."""
    client = shared_redis_server.client()
    store = RedisStore(client)
    yield store
    store._runner.close()
    client.close()


def _commit_clients(client: Any) -> set[int]:
    """Ids of the server's connections that last ran EVALSHA."""
    return {c["id"] for c in client.client_list() if c.get("cmd") == "evalsha"}


def test_commits_share_one_connection_of_their_own(
    real_redis_url: str, new_run_id: Callable[[], str]
) -> None:
    client = redis.Redis.from_url(real_redis_url)
    store = RedisStore(client)
    run, key = _run(store, new_run_id())
    before = client.connection_pool._created_connections
    for generation in range(1, 6):
        run.commit_batch(
            key, [Advance(expected_generation=generation, blob=b"g%d" % (generation + 1))]
        )
    # The pool made exactly one connection more (the line), and kept it.
    assert client.connection_pool._created_connections == before + 1
    assert store.read_run(key.run_id, with_checkpoint=True).checkpoint == b"g6"
    # A refusal over the line is decoded like any other.
    with pytest.raises(GenerationMismatchError):
        run.commit_batch(key, [Advance(expected_generation=1, blob=b"old")])
    store._runner.close()
    client.close()


def test_a_killed_commit_connection_is_reopened_by_the_next_commit(
    line_store: RedisStore, new_run_id: Callable[[], str], shared_redis_server: RedisServer
) -> None:
    store = line_store
    run, key = _run(store, new_run_id())
    run.commit_batch(key, [Advance(expected_generation=1, blob=b"g2")])
    line = _commit_clients(store.client)
    admin = shared_redis_server.client()
    for client_id in line:
        admin.client_kill_filter(_id=client_id)
    run.commit_batch(
        key, [Advance(expected_generation=2, blob=b"g3")]
    )  # reconnects on the retry policy
    assert store.read_run(key.run_id).generation == 3
    assert not (_commit_clients(admin) & line)
    admin.close()


def test_a_forked_child_commits_on_a_connection_of_its_own(
    line_store: RedisStore, new_run_id: Callable[[], str]
) -> None:
    store = line_store
    run, key = _run(store, new_run_id())
    run.commit_batch(key, [Advance(expected_generation=1, blob=b"g2")])  # the parent's line is open
    child_run_id = new_run_id()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: commit to a run of its own, report, leave at once
        code = 1
        try:
            child, child_key = _run(store, child_run_id)
            child.commit_batch(child_key, [Advance(expected_generation=1, blob=b"c2")])
            os.write(write, b"ok")
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0 and os.read(read, 16) == b"ok"
    os.close(read)
    os.close(write)
    # The parent's connection was not touched: its next reply is its own.
    run.commit_batch(key, [Advance(expected_generation=2, blob=b"g3")])
    assert store.read_run(key.run_id).generation == 3
    assert store.read_run(child_run_id).generation == 2


def test_other_clients_commit_through_the_client_itself() -> None:
    fake = RedisStore(fakeredis.FakeRedis(server=fakeredis.FakeServer()))
    single = RedisStore(redis.Redis(port=1, single_connection_client=False))
    assert fake._runner._line is None
    assert single._runner._line is not None
    pinned = redis.Redis(port=1)
    pinned.connection = object()  # what single_connection_client=True sets up
    assert RedisStore(pinned)._runner._line is None


def test_the_commit_connection_packs_ints_and_text_alike(
    line_store: RedisStore, new_run_id: Callable[[], str]
) -> None:
    """Commit arguments travel as text; an int (any caller of the runner may pass one)
    is packed by redis-py's packer instead, with the same reply."""
    store = line_store
    run, key = _run(store, new_run_id())
    keys = run_keys(key.run_id)
    argv = [
        "w1",
        run.lease_version,
        1,
        64,
        1,
        "",
        key.run_id,
        2,
        b"g2",
        "c-int",
        "d" * 64,
        b"",
        b"",
        0,
        "",
        0,
    ]
    reply = store._runner.run(
        ScriptName.COMMIT,
        [
            keys.lease,
            keys.state,
            keys.ckpt,
            keys.history,
            keys.commits,
            keys.nonces,
            keys.archive,
            keys.keys,
        ],
        argv,
        hot=True,
    )
    assert reply[0][:3] == [b"committed", 2, 2]
    commit_one(store, run.lease, generation=3, expected_state_version=2, checkpoint=b"g3")
    assert store.read_run(key.run_id, with_checkpoint=True).checkpoint == b"g3"
