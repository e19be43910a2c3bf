"""Fixtures for the LangGraph saver: a real redis-server of this package's own (AOF on,
killed at the end) and fakeredis[lua], a key ring, and saver factories.

The whole package is skipped when LangGraph is not installed (``pip install
'ratchet[langgraph]'``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("langgraph.checkpoint.base")
pytest.importorskip("langgraph.graph")

import fakeredis
import redis.asyncio

from ratchet.langgraph import RatchetSaver
from ratchet.redis_server import RedisServer
from ratchet.runtime.signing import KeyRing

BACKENDS = ["redis-server", "fakeredis"]


@pytest.fixture(scope="session")
def lg_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One real server for the package; killed in teardown."""
    server = RedisServer(Path(tmp_path_factory.mktemp("lg-redis"))).start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def keyring() -> KeyRing:
    return KeyRing.from_secrets({"k1": b"k" * 32, "k0": b"o" * 32}, signing_kid="k1")


class Backend:
    """Makes sync and async clients on one Redis (real or fake)."""

    def __init__(self, name: str, server: RedisServer | None) -> None:
        self.name = name
        self._server = server
        self._fake = fakeredis.FakeServer() if server is None else None
        self._clients: list[Any] = []

    def client(self) -> Any:
        if self._server is not None:
            c: Any = self._server.client()
        else:
            c = fakeredis.FakeRedis(server=self._fake)
        self._clients.append(c)
        return c

    def aclient(self) -> Any:
        """A new asyncio client; make it inside the event loop that uses it."""
        if self._server is not None:
            return redis.asyncio.Redis.from_url(self._server.url, decode_responses=False)
        return fakeredis.FakeAsyncRedis(server=self._fake)

    def close(self) -> None:
        for c in self._clients:
            c.close()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    server = request.getfixturevalue("lg_server") if request.param == "redis-server" else None
    b = Backend(request.param, server)
    yield b
    b.close()


@pytest.fixture
def make_saver(backend: Backend, keyring: KeyRing) -> Callable[..., RatchetSaver]:
    """A sync saver on the backend; ``owner`` and other keywords pass through."""

    def make(owner: str = "worker-a", **kwargs: Any) -> RatchetSaver:
        kwargs.setdefault("keyring", keyring)
        return RatchetSaver(backend.client(), owner=owner, **kwargs)

    return make


def wait_until_free(saver: RatchetSaver, thread_id: str, *, deadline_s: float = 10.0) -> None:
    """Poll Redis (its own clock) until the thread's lease reads as not live, or fail."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if not saver.lease_info(thread_id).live:
            return
        time.sleep(0.002)
    raise AssertionError(f"lease of {thread_id} still live after {deadline_s}s")
