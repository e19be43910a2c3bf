"""The writer's heartbeat, on a real redis-server: a node that runs three TTLs keeps its
thread lease with it and loses it without; a renewal that finds the lease taken over stops
the heartbeat and the next write raises the stale-owner error.

The TTLs are small (the lease expires by the store's clock); waits poll the store's clock or
wait on the heartbeat's own event, each bounded by a deadline.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypedDict

import pytest
import redis.asyncio
from langgraph.graph import END, START, StateGraph

from ratchet.errors import ConfigurationError, LeaseLostError
from ratchet.langgraph import RatchetSaver
from ratchet.langgraph.writer import ThreadWriter
from ratchet.redis_server import RedisServer
from ratchet.runtime.signing import KeyRing

from .helpers import checkpoint, config, ids, wait_store_ms

TTL_MS = 450  # renewals every 150 ms
DEADLINE_S = 30.0


def _thread() -> str:
    return f"beat-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def make(lg_server: RedisServer, keyring: KeyRing) -> Iterator[Callable[..., RatchetSaver]]:
    clients: list[Any] = []

    def factory(owner: str, **kw: Any) -> RatchetSaver:
        client = lg_server.client()
        clients.append(client)
        kw.setdefault("lease_ttl_ms", TTL_MS)
        return RatchetSaver(client, keyring=keyring, owner=owner, **kw)

    yield factory
    for client in clients:
        client.close()


class State(TypedDict):
    log: list[str]


def _long_graph(writer: ThreadWriter, observer: RatchetSaver, ran: list[str]) -> Any:
    """start -> long (runs until the store's clock is 3 TTLs past the claim) -> after."""
    claimed_at = writer.lease.now_ms

    def long(state: State) -> dict[str, Any]:
        ran.append("long")
        wait_store_ms(observer, writer.thread_id, claimed_at + 3 * TTL_MS, deadline_s=DEADLINE_S)
        return {"log": [*state["log"], "long"]}

    def after(state: State) -> dict[str, Any]:
        ran.append("after")
        return {"log": [*state["log"], "after"]}

    builder = StateGraph(State)
    builder.add_node("long", long)
    builder.add_node("after", after)
    builder.add_edge(START, "long")
    builder.add_edge("long", "after")
    builder.add_edge("after", END)
    return builder.compile(checkpointer=writer)


def test_a_node_that_runs_three_ttls_keeps_its_lease_with_the_heartbeat(
    make: Callable[..., RatchetSaver],
) -> None:
    saver, observer = make("worker-a"), make("observer")
    t = _thread()
    ran: list[str] = []
    with saver.claim_write_ownership(t, heartbeat=True) as writer:
        heartbeat = writer.heartbeat
        assert heartbeat is not None and heartbeat.interval_s == pytest.approx(TTL_MS / 3000)
        result = _long_graph(writer, observer, ran).invoke(
            {"log": []}, {"configurable": {"thread_id": t}}, durability="sync"
        )
        assert result["log"] == ["long", "after"]
        assert heartbeat.renewals >= 3 and heartbeat.lost is None and writer.lost is None
        assert observer.lease_info(t).lease_version == writer.lease.lease_version
    assert ran == ["long", "after"]
    assert not heartbeat.running  # released: the heartbeat stopped first
    info = observer.lease_info(t)
    assert info.owner is None and not info.live
    assert [tup.metadata.get("step") for tup in observer.list(config(t))] == [2, 1, 0, -1]


def test_the_same_node_without_the_heartbeat_loses_its_lease(
    make: Callable[..., RatchetSaver],
) -> None:
    saver, observer = make("worker-a"), make("observer")
    t = _thread()
    ran: list[str] = []
    writer = saver.claim_write_ownership(t)
    assert writer.heartbeat is None
    with pytest.raises(LeaseLostError) as refused:
        _long_graph(writer, observer, ran).invoke(
            {"log": []}, {"configurable": {"thread_id": t}}, durability="sync"
        )
    assert type(refused.value).is_stale_write_owner_error is True
    assert refused.value.reason == "lease_expired"
    assert ran == ["long"]  # stopped at its next checkpoint
    assert [tup.metadata.get("step") for tup in observer.list(config(t))] == [0, -1]


def test_a_renewal_that_finds_the_lease_taken_over_stops_and_the_next_write_raises(
    make: Callable[..., RatchetSaver],
) -> None:
    saver, operator = make("worker-a"), make("operator")
    t = _thread()
    writer = saver.claim_write_ownership(t, heartbeat=True)
    first = writer.put(config(t), checkpoint(), {}, {})
    heartbeat = writer.heartbeat
    assert heartbeat is not None
    operator.claim_write_ownership(t, takeover=True, reason="drill: wedged node")
    assert heartbeat.wait_stopped(DEADLINE_S)  # the next renewal is refused
    assert heartbeat.lost is not None and heartbeat.lost.reason == "lease_lost"
    assert writer.lost is not None
    renewals = heartbeat.renewals
    with pytest.raises(LeaseLostError) as refused:
        writer.put(first, checkpoint(), {}, {})
    assert type(refused.value).is_stale_write_owner_error is True
    assert refused.value.current_owner == "operator"
    assert ids(operator, t) == [first["configurable"]["checkpoint_id"]]
    # Stopped for good: the store's clock moves on a whole TTL, no renewal comes.
    wait_store_ms(operator, t, operator.lease_info(t).now_ms + TTL_MS, deadline_s=DEADLINE_S)
    assert heartbeat.renewals == renewals and not heartbeat.running
    with pytest.raises(LeaseLostError):
        writer.release()


def test_the_async_claim_renews_from_the_same_background_thread(
    lg_server: RedisServer, keyring: KeyRing
) -> None:
    t = _thread()

    async def go() -> None:
        aclient = redis.asyncio.Redis.from_url(lg_server.url, decode_responses=False)
        client = lg_server.client()
        saver = RatchetSaver(
            client, aclient=aclient, keyring=keyring, owner="worker-a", lease_ttl_ms=TTL_MS
        )
        try:
            async with await saver.aclaim_write_ownership(t, heartbeat=True) as writer:
                target = writer.lease.now_ms + 3 * TTL_MS
                while (await saver.alease_info(t)).now_ms < target:
                    await asyncio.sleep(0.005)  # a long node, by the store's clock
                await writer.aput(config(t), checkpoint(), {}, {})
                await writer.acheck_write_ownership()
                heartbeat = writer.heartbeat
                assert heartbeat is not None and heartbeat.renewals >= 3
            assert not heartbeat.running
            assert len(ids(saver, t)) == 1
        finally:
            await aclient.aclose()
            client.close()

    asyncio.run(asyncio.wait_for(go(), DEADLINE_S))


def test_a_heartbeat_needs_a_sync_client_and_nothing_is_claimed_without_one(
    lg_server: RedisServer, keyring: KeyRing
) -> None:
    t = _thread()

    async def go() -> None:
        aclient = redis.asyncio.Redis.from_url(lg_server.url, decode_responses=False)
        saver = RatchetSaver(aclient=aclient, keyring=keyring, owner="worker-a")
        try:
            with pytest.raises(ConfigurationError) as refused:
                await saver.aclaim_write_ownership(t, heartbeat=True)
            assert refused.value.field == "heartbeat"
            assert (await saver.alease_info(t)).owner is None
        finally:
            await aclient.aclose()

    asyncio.run(go())
