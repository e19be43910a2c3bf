"""The fault proxy on a real Redis: a cut stalls a direction without losing or reordering
bytes, a severed link resets, a delay holds; and a worker partitioned from Redis while
its lease expires cannot land its late commit after another worker took the run over."""

from __future__ import annotations

import secrets
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ratchet.adapters import WorkspaceAdapter
from ratchet.adapters.workspace import SystemClock
from ratchet.chaos.drill.services import _scenario
from ratchet.chaos.netfault import Direction, FaultProxy
from ratchet.errors import ConfigurationError, LeaseLostError, StoreError
from ratchet.leasing import RedisStore
from ratchet.redis_server import RedisServer
from ratchet.runtime import KeyRing, RunEngine
from ratchet.worker.executor import Executor


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    s = RedisServer(Path(tmp_path_factory.mktemp("netfault-redis"))).start()
    try:
        yield s
    finally:
        s.kill()


@pytest.fixture
def proxy(server: RedisServer) -> Iterator[FaultProxy]:
    with FaultProxy((server.host, server.port)) as p:
        yield p


def _client(proxy: FaultProxy, timeout_s: float = 0.3) -> redis.Redis:
    return redis.Redis(
        host="127.0.0.1",
        port=proxy.port,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),  # a timeout is the fault under test: never retried
    )


def _until(predicate: object, deadline_s: float = 5.0) -> None:
    end = time.monotonic() + deadline_s
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > end:
            raise AssertionError("condition not reached before the deadline")
        time.sleep(0.01)


def test_an_open_proxy_forwards_and_counts(proxy: FaultProxy) -> None:
    c = _client(proxy)
    c.set("nf:a", "1")
    assert c.get("nf:a") == b"1"
    counters = proxy.counters()
    assert counters.connections >= 1
    assert counters.bytes_up > 0 and counters.bytes_down > 0


def test_a_cut_request_direction_stalls_then_delivers_in_order(
    proxy: FaultProxy, server: RedisServer
) -> None:
    c = _client(proxy)
    c.delete("nf:list")  # connected before the cut
    proxy.partition(Direction.UP)
    assert "up=cut" in proxy.state()
    with pytest.raises(redis.TimeoutError):
        c.rpush("nf:list", "first")
    direct = server.client()
    assert direct.lrange("nf:list", 0, -1) == []  # nothing reached Redis
    proxy.heal(Direction.UP)
    # The stalled request was not lost: TCP would retransmit it, the proxy lets it through.
    _until(lambda: direct.lrange("nf:list", 0, -1) == [b"first"])


def test_a_cut_reply_direction_runs_the_command_and_loses_its_reply(
    proxy: FaultProxy, server: RedisServer
) -> None:
    c = _client(proxy)
    direct = server.client()
    direct.set("nf:n", 0)
    assert c.ping()  # connected (and its handshake answered) before the cut
    proxy.partition(Direction.DOWN)
    with pytest.raises(redis.TimeoutError):
        c.incr("nf:n")
    assert direct.get("nf:n") == b"1"  # it ran; the client cannot know
    proxy.heal()
    c2 = _client(proxy)
    assert c2.incr("nf:n") == 2


def test_sever_resets_every_connection(proxy: FaultProxy) -> None:
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=2) as sock:
        sock.sendall(b"PING\r\n")
        assert sock.recv(64) == b"+PONG\r\n"
        assert proxy.sever() >= 1
        try:
            rest = sock.recv(64)
        except ConnectionResetError:
            rest = b""
        assert rest == b""  # the link is gone: reset or end of stream, never a reply
    assert proxy.counters().severed >= 1
    assert _client(proxy).ping()  # new connections still go through


def test_a_delay_holds_every_chunk(proxy: FaultProxy) -> None:
    c = _client(proxy, timeout_s=0.2)
    proxy.delay(600, Direction.DOWN)
    with pytest.raises(redis.TimeoutError):
        c.ping()
    proxy.delay(0)
    assert _client(proxy).ping()


def test_bad_controls_are_refused_in_one_line(server: RedisServer) -> None:
    p = FaultProxy((server.host, server.port))
    with pytest.raises(ConfigurationError, match="not started"):
        p.partition()
    with pytest.raises(ConfigurationError, match="negative"):
        p.delay(-1)
    with (
        FaultProxy((server.host, server.port)) as taken,
        pytest.raises(ConfigurationError, match="cannot listen"),
    ):
        FaultProxy((server.host, server.port), listen=("127.0.0.1", taken.port)).start()


def test_a_partitioned_worker_cannot_land_a_late_commit_after_a_takeover(
    proxy: FaultProxy, server: RedisServer
) -> None:
    """Worker A reaches Redis only through the proxy. Its lease request goes out, then
    the link is cut in both directions and its lease expires; worker B (direct) takes the
    run over. When the link heals, A's renewal that waited in the cut arrives late and
    must be refused by the store's clock, never extend a lease B holds."""
    run_id = f"nf-{secrets.token_hex(4)}"
    direct = RedisStore(server.client())
    direct.load_scripts()
    a_store = RedisStore(_client(proxy, timeout_s=2))
    a_store.load_scripts()
    _create_bare_run(direct, run_id)
    a = a_store.acquire(run_id, owner="worker-a", ttl_ms=300)
    assert a is not None
    proxy.partition()
    outcome: dict[str, str] = {}

    def late_renewal() -> None:
        try:
            a.renew(ttl_ms=5_000)
            outcome["result"] = "renewed"
        except (LeaseLostError, StoreError, redis.RedisError) as exc:
            outcome["result"] = type(exc).__name__

    t = threading.Thread(target=late_renewal)
    t.start()
    _until(lambda: not direct.read_run(run_id).lease_live, deadline_s=5)
    b = direct.acquire(run_id, owner="worker-b", ttl_ms=10_000)
    assert b is not None and b.lease_version > a.lease_version
    proxy.heal()
    t.join(10)
    assert not t.is_alive()
    snap = direct.read_run(run_id)
    assert snap.is_held_by("worker-b", b.lease_version)  # A's late renewal changed nothing
    assert outcome["result"] == "LeaseLostError"


def _create_bare_run(store: RedisStore, run_id: str) -> None:
    """A run with a first checkpoint, as RunEngine.start makes one."""
    root = Path(tempfile.mkdtemp(prefix="nf-ws-"))
    (root / "note.txt").write_text("x")
    keys = KeyRing.from_secrets({"k": secrets.token_bytes(32)}, signing_kid="k")
    RunEngine.start(
        run_id,
        scenario=_scenario(0),
        keyring=keys,
        executor=Executor(WorkspaceAdapter(root, ["note.txt"]), store.creator(b"{}")),
        clock=SystemClock(),
    )
