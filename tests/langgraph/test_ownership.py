"""Write ownership (LangGraph's proposed ``write_ownership`` convention, issue #8796) on
the saver's thread leases: a claim returns a writer bound to one lease version, a
superseded writer's writes raise an exception marked ``is_stale_write_owner_error`` and
store nothing, and the ``check_write_ownership`` barrier says the same without writing.

Every clause runs in three modes: the sync methods, the async methods on an asyncio
client, and the async methods on a sync client only (run in a worker thread).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypedDict

import pytest
from langgraph.graph import END, START, StateGraph

from ratchet.errors import ContractError, LeaseHeldElsewhereError, LeaseLostError
from ratchet.langgraph import RatchetSaver, admin
from ratchet.langgraph.writer import ThreadWriter
from ratchet.runtime.signing import KeyRing

from .conftest import Backend, wait_until_free
from .helpers import checkpoint, config, ids

MODES = ["sync", "asyncio-client", "to-thread"]
Make = Callable[..., RatchetSaver]


def _thread() -> str:
    return f"own-{uuid.uuid4().hex[:12]}"


class Api:
    """The same calls, sync or async; every method is awaited by the scenarios."""

    def __init__(self, mode: str) -> None:
        self.sync = mode == "sync"

    async def claim(self, saver: RatchetSaver, thread_id: str, **kw: Any) -> ThreadWriter:
        if self.sync:
            return saver.claim_write_ownership(thread_id, **kw)
        return await saver.aclaim_write_ownership(thread_id, **kw)

    async def put(self, writer: Any, cfg: Any, **values: Any) -> Any:
        ckpt = checkpoint(values, versions=dict.fromkeys(values, 1))
        if self.sync:
            return writer.put(cfg, ckpt, {"step": 1}, dict.fromkeys(values, 1))
        return await writer.aput(cfg, ckpt, {"step": 1}, dict.fromkeys(values, 1))

    async def put_writes(self, writer: Any, cfg: Any, writes: Any, task_id: str) -> None:
        if self.sync:
            writer.put_writes(cfg, writes, task_id)
        else:
            await writer.aput_writes(cfg, writes, task_id)

    async def delete(self, writer: ThreadWriter, thread_id: str) -> None:
        if self.sync:
            writer.delete_thread(thread_id)
        else:
            await writer.adelete_thread(thread_id)

    async def prune(self, writer: ThreadWriter, thread_id: str, strategy: str) -> None:
        if self.sync:
            writer.prune([thread_id], strategy=strategy)
        else:
            await writer.aprune([thread_id], strategy=strategy)

    async def check(self, writer: ThreadWriter) -> None:
        if self.sync:
            writer.check_write_ownership()
        else:
            await writer.acheck_write_ownership()

    async def release(self, writer: ThreadWriter) -> None:
        if self.sync:
            writer.release()
        else:
            await writer.arelease()


Scenario = Callable[[Api, Make], Coroutine[Any, Any, None]]


def _run(mode: str, backend: Backend, keyring: KeyRing, scenario: Scenario) -> None:
    async def go() -> None:
        aclients: list[Any] = []

        def make(owner: str, **kw: Any) -> RatchetSaver:
            aclient = backend.aclient() if mode == "asyncio-client" else None
            if aclient is not None:
                aclients.append(aclient)
            return RatchetSaver(
                backend.client(), aclient=aclient, keyring=keyring, owner=owner, **kw
            )

        try:
            await scenario(Api(mode), make)
        finally:
            for aclient in aclients:
                await aclient.aclose()

    asyncio.run(go())


async def _stale(call: Awaitable[Any]) -> LeaseLostError:
    """Await a write of a superseded writer: it must raise the marked stale-owner error."""
    with pytest.raises(LeaseLostError) as refused:
        await call
    assert type(refused.value).is_stale_write_owner_error is True
    return refused.value


def _pending(saver: RatchetSaver, thread_id: str, checkpoint_id: str) -> list[Any]:
    found = saver.get_tuple(config(thread_id, parent=checkpoint_id))
    assert found is not None
    return [(channel, value) for _, channel, value in found.pending_writes or []]


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_a_claim_on_a_free_thread_succeeds_and_its_writes_land(
    mode: str, backend: Backend, keyring: KeyRing
) -> None:
    async def scenario(api: Api, make: Make) -> None:
        a, reader = make("worker-a"), make("reader")
        t = _thread()
        writer = await api.claim(a, t)
        assert writer.thread_id == t and writer.lease.owner == "worker-a"
        assert reader.lease_info(t).lease_version == writer.lease.lease_version
        stored = await api.put(writer, config(t), x=1)
        await api.put_writes(writer, stored, [("x", "owned")], "task-1")
        cid = stored["configurable"]["checkpoint_id"]
        head = reader.get_tuple(config(t))
        assert head is not None and head.checkpoint["id"] == cid
        assert head.checkpoint["channel_values"] == {"x": 1}
        assert _pending(reader, t, cid) == [("x", "owned")]
        await api.check(writer)  # the current owner passes the barrier

    _run(mode, backend, keyring, scenario)


def test_a_second_claim_while_the_first_owners_lease_is_live_is_refused_unless_taken_over(
    mode: str, backend: Backend, keyring: KeyRing
) -> None:
    async def scenario(api: Api, make: Make) -> None:
        a, b = make("worker-a"), make("worker-b")
        t = _thread()
        first = await api.claim(a, t)
        with pytest.raises(LeaseHeldElsewhereError) as held:
            await api.claim(b, t)
        assert held.value.owner == "worker-a"
        assert getattr(held.value, "is_stale_write_owner_error", False) is False
        with pytest.raises(ContractError) as no_reason:
            await api.claim(b, t, takeover=True)
        assert no_reason.value.field == "reason"
        with pytest.raises(ContractError):
            await api.claim(b, t, reason="not a takeover")
        stored = await api.put(first, config(t), x=1)  # the refusals changed nothing
        assert b.takeovers(t) == []

        second = await api.claim(b, t, takeover=True, reason="node wedged on a dead socket")
        assert second.lease.lease_version > first.lease.lease_version
        record = second.takeover
        assert record is not None
        assert (record.owner, record.previous_owner, record.previous_live) == (
            "worker-b",
            "worker-a",
            True,
        )
        assert record.previous_lease_version == first.lease.lease_version
        assert b.takeovers(t) == [record]  # recorded in the store, newest first
        assert a.takeovers(t) == [record]
        await _stale(api.put(first, stored, x=2))
        await api.put(second, stored, x=3)
        assert len(ids(a, t)) == 2

    _run(mode, backend, keyring, scenario)


def test_a_new_claim_of_the_same_owner_supersedes_its_earlier_writer(
    mode: str, backend: Backend, keyring: KeyRing
) -> None:
    async def scenario(api: Api, make: Make) -> None:
        a = make("worker-a")
        t = _thread()
        old = await api.claim(a, t)
        stored = await api.put(old, config(t), x=1)
        new = await api.claim(a, t)  # the same owner id: a new lease version, no takeover
        assert new.lease.lease_version > old.lease.lease_version and new.takeover is None
        await _stale(api.put(old, stored, x=2))
        await api.put(new, stored, x=3)
        assert len(ids(a, t)) == 2

    _run(mode, backend, keyring, scenario)


def test_once_the_first_owners_lease_expired_a_new_claim_supersedes_it(
    mode: str, backend: Backend, keyring: KeyRing
) -> None:
    async def scenario(api: Api, make: Make) -> None:
        # Long enough for the first put to land under a busy machine's scheduling (the
        # expiry is then waited for by the store's clock, not assumed).
        a, b = make("worker-a", lease_ttl_ms=1000), make("worker-b")
        t = _thread()
        first = await api.claim(a, t)
        stored = await api.put(first, config(t), x=1)
        wait_until_free(b, t)  # expired by the store's clock
        second = await api.claim(b, t)
        assert second.takeover is None and b.takeovers(t) == []
        refused = await _stale(api.put(first, stored, x=2))
        assert refused.reason == "lease_lost" and refused.current_owner == "worker-b"
        kept = await api.put(second, stored, x=3)
        head = b.get_tuple(config(t))
        assert head is not None
        assert head.checkpoint["id"] == kept["configurable"]["checkpoint_id"]

    _run(mode, backend, keyring, scenario)


def test_a_superseded_writers_writes_raise_the_stale_owner_error_and_store_nothing(
    mode: str, backend: Backend, keyring: KeyRing
) -> None:
    async def scenario(api: Api, make: Make) -> None:
        a, b = make("worker-a"), make("worker-b")
        t = _thread()
        stale = await api.claim(a, t)
        first = await api.put(stale, config(t), x=1)
        cid = first["configurable"]["checkpoint_id"]
        await api.put_writes(stale, first, [("x", "before")], "task-0")
        current = await api.claim(b, t, takeover=True, reason="drill")
        # The same slot from both: the current owner writes first; the config it is given
        # carries the stale lease, and the writer writes under its own lease regardless.
        await api.put_writes(current, first, [("__resume__", "current")], "task-1")
        generation = b.lease_info(t).generation

        await _stale(api.put(stale, first, x=2))
        await _stale(api.put_writes(stale, first, [("__resume__", "stale")], "task-1"))
        await _stale(api.put_writes(stale, first, [("x", "stale")], "task-2"))
        await _stale(api.delete(stale, t))
        await _stale(api.prune(stale, t, "keep_latest"))
        await _stale(api.prune(stale, t, "delete"))
        await _stale(api.put(stale, first, x=4))  # and it stays superseded
        assert stale.lost is not None

        assert ids(b, t) == [cid]
        assert sorted(_pending(b, t, cid)) == [("__resume__", "current"), ("x", "before")]
        info = b.lease_info(t)
        assert info.generation == generation  # no delete, no prune
        assert (info.owner, info.lease_version) == ("worker-b", current.lease.lease_version)

    _run(mode, backend, keyring, scenario)


@pytest.mark.parametrize("kind", ["put", "put_writes", "delete", "prune", "check"])
def test_a_superseded_writer_that_was_not_told_is_refused_by_the_store_first(
    mode: str, backend: Backend, keyring: KeyRing, kind: str
) -> None:
    """The writer has not seen anything yet (no latch): the refusal is the store's."""

    async def scenario(api: Api, make: Make) -> None:
        a, b = make("worker-a"), make("worker-b")
        t = _thread()
        stale = await api.claim(a, t)
        first = await api.put(stale, config(t), x=1)
        second = await api.put(stale, first, x=2)
        await api.claim(b, t, takeover=True, reason="drill")
        before = (ids(b, t), b.lease_info(t).generation)
        assert stale.lost is None
        calls = {
            "put": lambda: api.put(stale, second, x=3),
            "put_writes": lambda: api.put_writes(stale, second, [("x", "stale")], "task-9"),
            "delete": lambda: api.delete(stale, t),
            "prune": lambda: api.prune(stale, t, "keep_latest"),
            "check": lambda: api.check(stale),
        }
        refused = await _stale(calls[kind]())
        assert refused.reason == "lease_lost" and refused.current_owner == "worker-b"
        assert stale.lost is not None
        assert (ids(b, t), b.lease_info(t).generation) == before
        assert _pending(b, t, second["configurable"]["checkpoint_id"]) == []

    _run(mode, backend, keyring, scenario)


def test_the_rewrite_script_fences_a_delete_and_a_prune_under_an_old_lease(
    make_saver: Make,
) -> None:
    """The barrier a writer's prune runs first is not the fence: the script is."""
    a, b = make_saver("worker-a"), make_saver("worker-b")
    t = _thread()
    old = a.claim_write_ownership(t)
    first = old.put(config(t), checkpoint(), {}, {})
    old.put(first, checkpoint(), {}, {})
    b.claim_write_ownership(t, takeover=True, reason="drill")
    pair = (old.lease.owner, old.lease.lease_version)
    generation = b.lease_info(t).generation
    for op in (
        admin.prune(a._protocol, [t], "keep_latest", pair),
        admin.delete_thread(a._protocol, t, pair),
    ):
        with pytest.raises(LeaseLostError) as refused:
            a._drive(op)
        assert refused.value.reason == "lease_lost"
    assert len(ids(b, t)) == 2 and b.lease_info(t).generation == generation


def test_ownership_is_per_thread_and_a_repeated_write_of_the_owner_is_no_refusal(
    mode: str, backend: Backend, keyring: KeyRing
) -> None:
    async def scenario(api: Api, make: Make) -> None:
        a, b = make("worker-a"), make("worker-b")
        t, u = _thread(), _thread()
        mine = await api.claim(a, t)
        await api.claim(b, u)  # another thread's claim supersedes nothing here
        await api.claim(a, u, takeover=True, reason="drill")  # nor does a takeover there
        stored = await api.put(mine, config(t), x=1)
        await api.put_writes(mine, stored, [("x", "v")], "task-1")
        await api.put_writes(mine, stored, [("x", "v")], "task-1")  # a retry: absorbed
        await api.check(mine)
        assert _pending(b, t, stored["configurable"]["checkpoint_id"]) == [("x", "v")]

    _run(mode, backend, keyring, scenario)


def test_the_current_writer_deletes_and_prunes_its_thread(
    mode: str, backend: Backend, keyring: KeyRing
) -> None:
    async def scenario(api: Api, make: Make) -> None:
        a = make("worker-a")
        t = _thread()
        writer = await api.claim(a, t)
        first = await api.put(writer, config(t), x=1)
        await api.put(writer, first, x=2)
        await api.prune(writer, t, "keep_latest")
        assert len(ids(a, t)) == 1
        with pytest.raises(ContractError):
            await api.prune(writer, _thread(), "keep_latest")
        await api.delete(writer, t)
        assert ids(a, t) == []
        assert a.lease_info(t).owner is None  # the delete ended the lease
        refused = await _stale(api.put(writer, config(t), x=3))
        assert refused.reason == "deleted"
        assert ids(a, t) == []

    _run(mode, backend, keyring, scenario)


def test_the_barrier_returns_for_the_current_writer_and_raises_for_a_superseded_one(
    mode: str, backend: Backend, keyring: KeyRing
) -> None:
    async def scenario(api: Api, make: Make) -> None:
        a, b = make("worker-a"), make("worker-b")
        t = _thread()
        first = await api.claim(a, t)
        await api.check(first)
        second = await api.claim(b, t, takeover=True, reason="drill")
        generation = b.lease_info(t).generation
        refused = await _stale(api.check(first))
        assert refused.reason == "lease_lost" and refused.current_owner == "worker-b"
        await _stale(api.check(first))  # still superseded
        await api.check(second)
        info = b.lease_info(t)
        assert info.generation == generation and info.owner == "worker-b"  # nothing written

        short = make("worker-c", lease_ttl_ms=50)
        u = _thread()
        lapsed = await api.claim(short, u)
        wait_until_free(short, u)
        expired = await _stale(api.check(lapsed))
        assert expired.reason == "lease_expired"

    _run(mode, backend, keyring, scenario)


def test_a_writer_refuses_a_config_of_another_thread(
    mode: str, backend: Backend, keyring: KeyRing
) -> None:
    async def scenario(api: Api, make: Make) -> None:
        a = make("worker-a")
        t, other = _thread(), _thread()
        writer = await api.claim(a, t)
        with pytest.raises(ContractError) as refused:
            await api.put(writer, config(other), x=1)
        assert refused.value.field == "thread_id"
        assert ids(a, other) == []
        assert writer.lost is None  # a contract error is not a lost lease

    _run(mode, backend, keyring, scenario)


def test_a_released_writer_writes_no_more_and_release_is_reported_once(
    mode: str, backend: Backend, keyring: KeyRing
) -> None:
    async def scenario(api: Api, make: Make) -> None:
        a, b = make("worker-a"), make("worker-b")
        t = _thread()
        writer = await api.claim(a, t)
        stored = await api.put(writer, config(t), x=1)
        await api.release(writer)
        await api.release(writer)  # again: nothing to give up
        assert not a.lease_info(t).live
        refused = await _stale(api.put(writer, stored, x=2))
        assert refused.reason == "released"
        successor = await api.claim(b, t)  # free again without a takeover
        assert successor.takeover is None
        assert len(ids(a, t)) == 1

    _run(mode, backend, keyring, scenario)


def test_the_writer_as_a_context_manager_releases_and_reports_a_lost_lease(
    make_saver: Make,
) -> None:
    a, b = make_saver("worker-a"), make_saver("worker-b")
    t = _thread()
    with a.claim_write_ownership(t) as writer:
        writer.put(config(t), checkpoint(), {}, {})
    assert not a.lease_info(t).live
    with pytest.raises(LeaseLostError), a.claim_write_ownership(t):
        b.claim_write_ownership(t, takeover=True, reason="drill")
    assert b.lease_info(t).owner == "worker-b"

    async def go() -> None:
        async with await a.aclaim_write_ownership(_thread()) as w:
            await w.acheck_write_ownership()
        assert not a.lease_info(w.thread_id).live

    asyncio.run(go())


class State(TypedDict):
    log: list[str]


def test_a_graph_on_a_writer_stops_at_its_next_checkpoint_once_superseded(
    make_saver: Make,
) -> None:
    a, b = make_saver("worker-a"), make_saver("worker-b")
    t = _thread()
    writer = a.claim_write_ownership(t)
    ran: list[str] = []

    def first(state: State) -> dict[str, Any]:
        ran.append("first")
        b.claim_write_ownership(t, takeover=True, reason="operator moved the thread")
        return {"log": [*state["log"], "first"]}

    def second(state: State) -> dict[str, Any]:
        ran.append("second")
        return {"log": [*state["log"], "second"]}

    builder = StateGraph(State)
    builder.add_node("first", first)
    builder.add_node("second", second)
    builder.add_edge(START, "first")
    builder.add_edge("first", "second")
    builder.add_edge("second", END)
    graph = builder.compile(checkpointer=writer)
    with pytest.raises(LeaseLostError) as refused:
        graph.invoke({"log": []}, {"configurable": {"thread_id": t}}, durability="sync")
    assert type(refused.value).is_stale_write_owner_error is True
    assert ran == ["first"]
    assert [tup.metadata.get("step") for tup in b.list(config(t))] == [0, -1]
