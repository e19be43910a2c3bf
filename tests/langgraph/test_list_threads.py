"""``list(None, ...)``: the checkpoints of every thread, found by one SCAN of the saver's
keys; threads in thread id order, each newest first by its generation; ``filter``,
``limit`` and ``before`` apply across threads, and ``before`` pages on.

A listing across threads verifies every thread it reads and fails closed on one that does
not verify, and other test modules tamper with threads on purpose, so this module runs on a
redis-server of its own (and every listing still filters on its own test's metadata).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ratchet.errors import CheckpointError, ContractError
from ratchet.langgraph import RatchetSaver, thread_keys
from ratchet.redis_server import RedisServer
from ratchet.runtime.signing import KeyRing

from .conftest import Backend
from .helpers import checkpoint, config

Make = Callable[..., RatchetSaver]


@pytest.fixture(scope="module")
def lg_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """This module's own server (it overrides the package's shared one); killed after."""
    server = RedisServer(Path(tmp_path_factory.mktemp("lg-list-redis"))).start()
    try:
        yield server
    finally:
        server.kill()


def _key(item: Any) -> tuple[str, str, str]:
    conf = item.config["configurable"]
    return conf["thread_id"], conf["checkpoint_ns"], conf["checkpoint_id"]


def _seed(saver: RatchetSaver, batch: str) -> list[tuple[str, str, str]]:
    """Three threads (one with an id that is hashed into its key) of two to three
    checkpoints each, written in interleaved order, one in a child namespace; return the
    expected listing order."""
    threads = [f"{batch}-b", f"{batch} {{odd}} ü", f"{batch}-a"]
    assert thread_keys(threads[1]).tag.startswith("h=")
    written: dict[str, list[tuple[str, str]]] = {t: [] for t in threads}
    parents: dict[str, Any] = {t: config(t) for t in threads}
    for step in range(3):
        for n, t in enumerate(threads):
            if step == 2 and n == 2:
                continue
            ckpt = checkpoint({"v": f"{t}/{step}"}, versions={"v": step + 1})
            meta = {"batch": batch, "step": step, "even": step % 2 == 0}
            parents[t] = saver.put(parents[t], ckpt, meta, {"v": step + 1})
            written[t].append(("", ckpt["id"]))
    child = checkpoint()
    saver.put(config(threads[0], ns="child:1"), child, {"batch": batch, "step": 9}, {})
    written[threads[0]].append(("child:1", child["id"]))
    return [(t, ns, cid) for t in sorted(threads) for ns, cid in reversed(written[t])]


def test_listing_without_a_thread_lists_every_thread_in_thread_then_store_order(
    make_saver: Make,
) -> None:
    saver = make_saver()
    batch = f"lt-{uuid.uuid4().hex[:10]}"
    expected = _seed(saver, batch)
    assert len(expected) == 9
    for cfg in (None, {}, {"configurable": {}}, {"configurable": {"thread_id": ""}}):
        assert [_key(x) for x in saver.list(cfg, filter={"batch": batch})] == expected
    reader = make_saver("reader")  # a process that never saw these threads
    items = list(reader.list(None, filter={"batch": batch}))
    assert [_key(x) for x in items] == expected
    assert items[0].checkpoint["channel_values"]  # whole, verified tuples
    odd = [x for x in items if " {odd} " in x.config["configurable"]["thread_id"]]
    assert len(odd) == 3 and odd[0].parent_config is not None


def test_filter_limit_and_namespace_apply_across_threads(make_saver: Make) -> None:
    saver = make_saver()
    batch = f"lt-{uuid.uuid4().hex[:10]}"
    expected = _seed(saver, batch)
    listed = [_key(x) for x in saver.list(None, filter={"batch": batch}, limit=4)]
    assert listed == expected[:4]
    evens = [_key(x) for x in saver.list(None, filter={"batch": batch, "even": True})]
    step = {_key(x): x.metadata["step"] for x in saver.list(None, filter={"batch": batch})}
    assert evens == [k for k in expected if k[1] == "" and step[k] % 2 == 0]
    for ns in ("", "child:1"):
        only = saver.list({"configurable": {"checkpoint_ns": ns}}, filter={"batch": batch})
        assert [_key(x) for x in only] == [k for k in expected if k[1] == ns]


def test_before_pages_through_every_thread(make_saver: Make) -> None:
    saver = make_saver()
    batch = f"lt-{uuid.uuid4().hex[:10]}"
    expected = _seed(saver, batch)
    after_third = list(saver.list(None, filter={"batch": batch}, limit=3))[-1]
    rest = [_key(x) for x in saver.list(None, filter={"batch": batch}, before=after_third.config)]
    assert rest == expected[3:]
    pages: list[list[tuple[str, str, str]]] = []
    cursor: Any = None
    while True:
        page = list(saver.list(None, filter={"batch": batch}, before=cursor, limit=2))
        if not page:
            break
        pages.append([_key(x) for x in page])
        cursor = page[-1].config
    assert [k for page in pages for k in page] == expected
    assert all(len(page) == 2 for page in pages[:-1])


def test_listing_across_threads_refuses_what_names_no_thread(make_saver: Make) -> None:
    saver = make_saver()
    with pytest.raises(ContractError) as no_thread:
        list(saver.list({"configurable": {"checkpoint_id": "some-id"}}))
    assert no_thread.value.field == "thread_id"
    for before in ({"configurable": {"checkpoint_id": "x"}}, {"configurable": {"thread_id": "t"}}):
        with pytest.raises(ContractError) as bad_cursor:
            list(saver.list(None, before=before))
        assert bad_cursor.value.field == "before"


def test_a_meta_hash_that_names_another_thread_is_refused(
    make_saver: Make, backend: Backend
) -> None:
    saver = make_saver()
    batch = f"lt-{uuid.uuid4().hex[:10]}"
    hashed = f"{batch} needs hashing"
    saver.put(config(hashed), checkpoint(), {"batch": batch}, {})
    client = backend.client()
    meta = thread_keys(hashed).meta
    try:
        client.hset(meta, "thread_id", f"{batch}-someone-else")
        with pytest.raises(CheckpointError) as refused:
            list(saver.list(None, filter={"batch": batch}))
        assert refused.value.reason == "binding"
    finally:
        client.hset(meta, "thread_id", hashed)  # the shared server stays listable
    assert len(list(saver.list(None, filter={"batch": batch}))) == 1


@pytest.mark.parametrize("async_client", [True, False], ids=["asyncio-client", "to-thread"])
def test_alist_across_threads_lists_the_same(
    backend: Backend, keyring: KeyRing, async_client: bool
) -> None:
    sync = RatchetSaver(backend.client(), keyring=keyring, owner="w")
    batch = f"lt-{uuid.uuid4().hex[:10]}"
    expected = _seed(sync, batch)

    async def go() -> list[list[tuple[str, str, str]]]:
        aclient = backend.aclient() if async_client else None
        saver = RatchetSaver(backend.client(), aclient=aclient, keyring=keyring, owner="w")
        try:
            full = [_key(x) async for x in saver.alist(None, filter={"batch": batch})]
            first = [x async for x in saver.alist(None, filter={"batch": batch}, limit=5)]
            rest = [
                _key(x)
                async for x in saver.alist(None, filter={"batch": batch}, before=first[-1].config)
            ]
            return [full, [_key(x) for x in first], rest]
        finally:
            if aclient is not None:
                await aclient.aclose()

    full, first, rest = asyncio.run(go())
    assert full == expected
    assert first + rest == expected and len(first) == 5


def test_a_tampered_thread_makes_the_listing_across_threads_fail_closed(
    make_saver: Make, backend: Backend
) -> None:
    saver = make_saver()
    batch = f"lt-{uuid.uuid4().hex[:10]}"
    expected = _seed(saver, batch)
    client = backend.client()
    ckpts = thread_keys(expected[-1][0]).ckpts
    field, value = next(iter(client.hgetall(ckpts).items()))
    try:
        client.hset(ckpts, field, value[:-1] + bytes([value[-1] ^ 0x01]))
        with pytest.raises(CheckpointError) as refused:
            list(saver.list(None, filter={"batch": batch}))
        assert refused.value.reason in ("bad_mac", "checksum")
    finally:
        client.hset(ckpts, field, value)
    assert [_key(x) for x in saver.list(None, filter={"batch": batch})] == expected
