"""Unsigned, tampered, moved, rolled-back or replayed state is refused."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

from ratchet.errors import CheckpointError, ConfigurationError, ContractError
from ratchet.langgraph import RatchetSaver, thread_keys
from ratchet.langgraph.codec import RecordCodec
from ratchet.runtime.signing import KeyRing

from .conftest import Backend
from .helpers import checkpoint, config

Make = Callable[..., RatchetSaver]


def _thread(prefix: str = "thread") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def _flip(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0x01])


def _seed(saver: RatchetSaver, t: str) -> tuple[dict[str, Any], dict[str, Any]]:
    c1 = checkpoint({"msg": "hello"})
    stored = saver.put(config(t), c1, {"step": 1}, {"msg": 1})
    saver.put_writes(stored, [("msg", "pending")], "task-1")
    return c1, stored


@pytest.mark.parametrize("key", ["ckpts", "blobs", "writes"])
def test_a_tampered_checkpoint_blob_or_write_is_refused(
    make_saver: Make, backend: Backend, key: str
) -> None:
    saver = make_saver()
    t = _thread()
    _, stored = _seed(saver, t)
    client = backend.client()
    name = getattr(thread_keys(t), key)
    field, value = next(iter(client.hgetall(name).items()))
    client.hset(name, field, _flip(value))
    with pytest.raises(CheckpointError) as refused:
        saver.get_tuple(stored)
    assert refused.value.reason in ("bad_mac", "checksum")
    with pytest.raises(CheckpointError):
        list(saver.list(config(t)))


def test_a_record_signed_for_another_thread_is_refused(make_saver: Make, backend: Backend) -> None:
    saver = make_saver()
    t1, t2 = _thread(), _thread()
    _seed(saver, t1)
    saver.put(config(t2), checkpoint({"msg": "other"}), {}, {"msg": 1})
    client = backend.client()
    other = client.hgetall(thread_keys(t2).ckpts)
    field = next(iter(other))
    client.hset(
        thread_keys(t2).ckpts, field, next(iter(client.hgetall(thread_keys(t1).ckpts).values()))
    )
    with pytest.raises(CheckpointError) as refused:
        saver.get_tuple(config(t2))
    assert refused.value.reason == "binding"


def test_a_dropped_channel_value_is_refused_not_read_as_empty(
    make_saver: Make, backend: Backend
) -> None:
    saver = make_saver()
    t = _thread()
    _, stored = _seed(saver, t)
    client = backend.client()
    client.hset(thread_keys(t).refs, next(iter(client.hkeys(thread_keys(t).refs))), b"")
    with pytest.raises(CheckpointError) as refused:
        saver.get_tuple(stored)
    assert refused.value.reason == "missing_blob"


def test_a_head_rolled_back_in_redis_is_refused(make_saver: Make, backend: Backend) -> None:
    saver = make_saver()
    t = _thread()
    c1 = checkpoint({"n": 1})
    saver.put(config(t), c1, {}, {"n": 1})
    client = backend.client()
    meta = thread_keys(t).meta
    old_head, old_gen = client.hget(meta, "head"), client.hget(meta, "generation")
    old_heads = client.hgetall(thread_keys(t).heads)
    saver.put(config(t, parent=c1["id"]), checkpoint({"n": 2}, versions={"n": 2}), {}, {"n": 2})

    # The head record alone rolled back: its generation is not the high-water mark.
    client.hset(meta, "head", old_head)
    with pytest.raises(CheckpointError) as refused:
        make_saver("fresh-reader").get_tuple(config(t))
    assert refused.value.reason == "stale_generation"

    # Head, heads and generation rolled back together: a process that saw the newer
    # generation refuses the older one.
    client.hset(meta, "generation", old_gen)
    client.hset(thread_keys(t).heads, mapping=old_heads)
    with pytest.raises(CheckpointError) as rolled:
        saver.get_tuple(config(t))
    assert rolled.value.reason == "rolled_back"

    # The plain heads hash pointing elsewhere than the signed head record.
    client.hset(meta, "generation", int(old_gen) + 1)
    client.hset(meta, "head", old_head)
    with pytest.raises(CheckpointError):
        saver.get_tuple(config(t))


def test_a_snapshot_replayed_after_delete_thread_is_refused(
    make_saver: Make, backend: Backend
) -> None:
    saver = make_saver()
    t = _thread()
    c1 = checkpoint({"n": 1})
    saver.put(config(t), c1, {}, {"n": 1})
    client = backend.client()
    keys = thread_keys(t)
    names = [keys.heads, keys.ckpts, keys.refs, keys.gens, keys.blobs]
    snapshot = {name: client.hgetall(name) for name in names}
    index = client.zrange(keys.index, 0, -1)
    old_head = client.hget(keys.meta, "head")
    saver.delete_thread(t)
    assert saver.get_tuple(config(t)) is None

    for name, fields in snapshot.items():
        client.hset(name, mapping=fields)
    client.zadd(keys.index, dict.fromkeys(index, 0))
    with pytest.raises(CheckpointError) as refused:
        make_saver("fresh-reader").get_tuple(config(t))
    assert refused.value.reason == "head_mismatch"
    client.hset(keys.meta, "head", old_head)
    with pytest.raises(CheckpointError) as stale:
        make_saver("fresh-reader").get_tuple(config(t))
    assert stale.value.reason == "stale_generation"


def test_prune_moves_the_head_forward_so_the_pre_prune_head_is_stale(
    make_saver: Make, backend: Backend
) -> None:
    saver = make_saver()
    t = _thread()
    c1 = checkpoint()
    saver.put(config(t), c1, {}, {})
    saver.put(config(t, parent=c1["id"]), checkpoint(), {}, {})
    client = backend.client()
    old_head = client.hget(thread_keys(t).meta, "head")
    saver.prune([t])
    client.hset(thread_keys(t).meta, "head", old_head)
    with pytest.raises(CheckpointError):
        make_saver("fresh-reader").get_tuple(config(t))


def test_a_record_signed_with_another_key_is_refused(make_saver: Make) -> None:
    t = _thread()
    writer = make_saver("writer", keyring=KeyRing.from_secrets({"k9": b"z" * 32}, signing_kid="k9"))
    writer.put(config(t), checkpoint({"n": 1}), {}, {"n": 1})
    with pytest.raises(CheckpointError) as refused:
        make_saver("reader").get_tuple(config(t))
    assert refused.value.reason == "unknown_kid"


class _PickleSerde(JsonPlusSerializer):
    def dumps_typed(self, obj: Any) -> tuple[str, bytes]:
        return "pickle", b"not really pickle"


def test_pickle_is_refused_when_writing_and_when_reading(
    make_saver: Make, keyring: KeyRing
) -> None:
    with pytest.raises(ConfigurationError):
        make_saver(serde=JsonPlusSerializer(pickle_fallback=True))
    codec = RecordCodec(keyring, _PickleSerde())
    with pytest.raises(ContractError):
        codec.seal(
            {"kind": "blob", "thread_id": "t", "ns": "", "channel": "c", "version": "i:1"}, object()
        )
    # A record that says "pickle", correctly signed, is still never unpickled.
    from ratchet.langgraph import codec
    from ratchet.runtime.canonical import canonical_json
    from ratchet.runtime.signing import seal_envelope

    binding = {"kind": "blob", "thread_id": "t", "ns": "", "channel": "c", "version": "i:1"}
    payload = b"ratchet/langgraph/v1\x00" + canonical_json(binding) + b"\npickle\n" + b"\x80\x04N."
    with pytest.raises(CheckpointError) as refused:
        codec.RecordCodec(keyring, JsonPlusSerializer()).open(
            seal_envelope(keyring, payload), {"kind": "blob"}
        )
    assert refused.value.reason == "serde_type"


def test_thread_ids_that_would_break_a_hash_tag_are_hashed() -> None:
    plain = thread_keys("c0ffee-42")
    assert plain.meta == "ratchet:lg:{t=c0ffee-42}:meta"
    for odd in ("a}b", "{x}", "with space", "line\nbreak", "ü", "x" * 300):
        keys = thread_keys(odd)
        tag = keys.tag
        assert tag.startswith("h=") and len(tag) == 34
        assert keys.meta == f"ratchet:lg:{{{tag}}}:meta"
    assert thread_keys("h=abc").tag == "t=h=abc"


def test_odd_thread_ids_round_trip(make_saver: Make) -> None:
    saver = make_saver()
    t = "user {42}: résumé"
    c1 = checkpoint({"k": "v"})
    saver.put(config(t), c1, {}, {"k": 1})
    found = saver.get_tuple(config(t))
    assert found is not None and found.config["configurable"]["thread_id"] == t


def test_the_public_surface_is_pinned() -> None:
    import ratchet.langgraph

    assert ratchet.langgraph.__all__ == [
        "DEFAULT_LEASE_TTL_MS",
        "LEASE_KEY",
        "LeaseInfo",
        "RatchetSaver",
        "Takeover",
        "ThreadKeys",
        "ThreadLease",
        "ThreadWriter",
        "default_serde",
        "thread_keys",
        "thread_tag",
    ]
