"""The sync and async methods store and refuse exactly the same things."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from ratchet.errors import LeaseHeldElsewhereError, LeaseLostError
from ratchet.langgraph import RatchetSaver
from ratchet.runtime.signing import KeyRing

from .conftest import Backend
from .helpers import checkpoint, config


def _script(t: str) -> list[tuple[str, tuple[Any, ...]]]:
    c1 = checkpoint({"a": "x", "b": [1, 2]})
    c2 = checkpoint({"a": "y", "b": [1, 2]}, versions={"a": 2, "b": 1})
    return [
        ("put", (config(t), c1, {"step": 0, "run_id": "r1"}, {"a": 1, "b": 1})),
        ("put_writes", (config(t, parent=c1["id"]), [("a", "w"), ("__error__", "e")], "t1")),
        ("put", (config(t, parent=c1["id"]), c2, {"step": 1, "run_id": "r2"}, {"a": 2})),
        ("put_writes", (config(t, parent=c2["id"]), [("b", [3])], "t2", "p:1")),
    ]


def _shape(item: Any) -> Any:
    if item is None:
        return None
    conf = item.config["configurable"]
    return (
        conf["checkpoint_id"],
        item.checkpoint["channel_values"],
        item.metadata,
        item.pending_writes,
        item.parent_config and item.parent_config["configurable"]["checkpoint_id"],
    )


def _sync_run(saver: RatchetSaver, t: str) -> list[Any]:
    for name, args in _script(t):
        getattr(saver, name)(*args)
    out = [_shape(saver.get_tuple(config(t)))]
    out += [_shape(x) for x in saver.list(config(t))]
    out += [_shape(x) for x in saver.list(config(t), filter={"run_id": "r1"})]
    saver.prune([t])
    out += [_shape(x) for x in saver.list(config(t))]
    return out


async def _async_run(saver: RatchetSaver, t: str) -> list[Any]:
    for name, args in _script(t):
        await getattr(saver, "a" + name)(*args)
    out = [_shape(await saver.aget_tuple(config(t)))]
    out += [_shape(x) async for x in saver.alist(config(t))]
    out += [_shape(x) async for x in saver.alist(config(t), filter={"run_id": "r1"})]
    await saver.aprune([t])
    out += [_shape(x) async for x in saver.alist(config(t))]
    return out


@pytest.mark.parametrize("async_client", [True, False], ids=["asyncio-client", "to-thread"])
def test_sync_and_async_methods_behave_the_same(
    backend: Backend, keyring: KeyRing, async_client: bool
) -> None:
    t_sync, t_async = f"s-{uuid.uuid4().hex[:8]}", f"a-{uuid.uuid4().hex[:8]}"
    sync_rows = _sync_run(RatchetSaver(backend.client(), keyring=keyring, owner="w"), t_sync)

    async def go() -> list[Any]:
        aclient = backend.aclient() if async_client else None
        saver = RatchetSaver(backend.client(), aclient=aclient, keyring=keyring, owner="w")
        try:
            return await _async_run(saver, t_async)
        finally:
            if aclient is not None:
                await aclient.aclose()

    async_rows = asyncio.run(go())
    # Same shapes, values, metadata, writes and order; only the checkpoint ids differ.
    assert len(sync_rows) == len(async_rows) == 5
    for s, a in zip(sync_rows, async_rows, strict=True):
        assert s[1:4] == a[1:4]
    assert [r[4] is None for r in sync_rows] == [r[4] is None for r in async_rows]


def test_sync_and_async_refuse_a_stale_writer_alike(backend: Backend, keyring: KeyRing) -> None:
    t = f"r-{uuid.uuid4().hex[:8]}"
    a = RatchetSaver(backend.client(), keyring=keyring, owner="a", lease_ttl_ms=60_000)
    b = RatchetSaver(backend.client(), keyring=keyring, owner="b")
    a.put(config(t), checkpoint(), {}, {})
    with pytest.raises(LeaseHeldElsewhereError):
        b.put(config(t), checkpoint(), {}, {})

    async def go() -> None:
        aclient = backend.aclient()
        ab = RatchetSaver(aclient=aclient, keyring=keyring, owner="b")
        try:
            with pytest.raises(LeaseHeldElsewhereError):
                await ab.aput(config(t), checkpoint(), {}, {})
            lease = a.claim(t)  # a new version fences the lease the first write claimed
            stale = {
                "configurable": {
                    **config(t)["configurable"],
                    "ratchet_lease": {"owner": "a", "version": lease.lease_version - 1},
                }
            }
            with pytest.raises(LeaseLostError):
                await ab.aput(stale, checkpoint(), {}, {})
            with pytest.raises(LeaseLostError):
                a.put(stale, checkpoint(), {}, {})
        finally:
            await aclient.aclose()

    asyncio.run(go())
