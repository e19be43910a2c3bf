"""Checkpoints are stored as zstd frames below the signature; reads take either form, and
a damaged frame fails closed at restore (on a real server, fakeredis and the env server)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import Any

import pytest
import zstandard

from ratchet.errors import CheckpointError
from ratchet.leasing import RedisStore, run_keys
from ratchet.leasing.encoding import (
    COMPRESS_MIN_BYTES,
    ZSTD_MAGIC,
    decode_checkpoint,
    encode_checkpoint,
)
from ratchet.runtime import KeyRing, restore_checkpoint
from ratchet.runtime.signing import seal_envelope

KEYRING = KeyRing.from_secrets({"k": b"encoding-test-key-0123456789abcdef!"}, signing_kid="k")
ENVELOPE = seal_envelope(KEYRING, b'{"state":"' + b"evidence " * 2000 + b'"}')  # ~18 KB


def _stored(store: RedisStore, run_id: str) -> bytes:
    value = store.client.get(run_keys(run_id).ckpt)
    assert isinstance(value, bytes)
    return value


def _history_digests(store: RedisStore, run_id: str) -> list[str]:
    return [
        e.decode().split("|")[5]
        for e in reversed(store.client.lrange(run_keys(run_id).history, 0, -1))
    ]


def test_checkpoints_are_stored_compressed_and_read_back_as_signed(
    store: RedisStore, new_run_id: Callable[[], str]
) -> None:
    run_id = new_run_id()
    store.create_run(run_id, task_id="t", env_instance_id="e", scenario=b"s", checkpoint=ENVELOPE)
    run = store.acquire(run_id, owner="w1", ttl_ms=60_000)
    assert run is not None
    second = seal_envelope(KEYRING, b'{"state":"' + b"more evidence " * 1500 + b'"}')
    run.commit(second)
    stored = _stored(store, run_id)
    assert stored.startswith(ZSTD_MAGIC) and len(stored) < len(second) // 4
    assert store.read_run(run_id, with_checkpoint=True).checkpoint == second
    # Digests (history, already_applied, drill acks) are over the envelope, not the frame.
    assert _history_digests(store, run_id) == [
        hashlib.sha256(ENVELOPE).hexdigest(),
        hashlib.sha256(second).hexdigest(),
    ]


def test_raw_and_compressed_runs_read_the_same_through_either_store(
    redis_client: Any, new_run_id: Callable[[], str]
) -> None:
    raw, packed = (RedisStore(redis_client, compress_checkpoints=False), RedisStore(redis_client))
    raw_run, packed_run = new_run_id(), new_run_id()
    raw.create_run(raw_run, task_id="t", env_instance_id="e", scenario=b"s", checkpoint=ENVELOPE)
    packed.create_run(
        packed_run, task_id="t", env_instance_id="e", scenario=b"s", checkpoint=ENVELOPE
    )
    assert _stored(raw, raw_run) == ENVELOPE
    assert _stored(packed, packed_run).startswith(ZSTD_MAGIC)
    for store in (raw, packed):
        for run_id in (raw_run, packed_run):
            assert store.read_run(run_id, with_checkpoint=True).checkpoint == ENVELOPE
    # A raw store commits on a run that was stored compressed, and the other way round.
    lease = raw.acquire(packed_run, owner="w1", ttl_ms=60_000)
    assert lease is not None
    lease.commit(ENVELOPE + b" ")
    assert packed.read_run(packed_run, with_checkpoint=True).checkpoint == ENVELOPE + b" "


@pytest.mark.parametrize("damage", ["flip", "truncate", "huge"])
def test_a_damaged_frame_is_handed_on_and_restore_refuses_it(
    store: RedisStore, new_run_id: Callable[[], str], damage: str
) -> None:
    run_id = new_run_id()
    store.create_run(run_id, task_id="t", env_instance_id="e", scenario=b"s", checkpoint=ENVELOPE)
    frame = bytearray(_stored(store, run_id))
    if damage == "flip":
        frame[len(frame) // 2] ^= 0x01
    elif damage == "truncate":
        del frame[-8:]
    else:  # a frame that claims more than the cap
        frame = bytearray(zstandard.ZstdCompressor().compress(b"{" * (2 << 20)))
    store.client.set(run_keys(run_id).ckpt, bytes(frame))
    read = store.read_run(run_id, with_checkpoint=True).checkpoint
    assert read == bytes(frame)  # not decoded: passed on exactly as stored
    with pytest.raises(CheckpointError) as err:
        restore_checkpoint(
            read,
            scenario=None,
            keyring=KEYRING,  # type: ignore[arg-type]
            high_water=None,
            observe=lambda _s, _g: None,
        )  # type: ignore[arg-type]
    assert err.value.reason == "malformed"


def test_decoding_passes_anything_that_is_not_a_whole_frame_through_unchanged() -> None:
    assert decode_checkpoint(ENVELOPE, max_bytes=1 << 20) == ENVELOPE
    assert decode_checkpoint(ZSTD_MAGIC, max_bytes=1 << 20) == ZSTD_MAGIC
    frame = encode_checkpoint(ENVELOPE, compress=True)
    assert decode_checkpoint(frame, max_bytes=1 << 20) == ENVELOPE
    assert decode_checkpoint(frame, max_bytes=len(ENVELOPE) - 1) == frame  # over the cap
    unsized = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    streamed = unsized.compress(ENVELOPE) + unsized.flush()
    assert decode_checkpoint(streamed, max_bytes=1 << 20) == streamed  # no recorded size
    assert encode_checkpoint(ENVELOPE, compress=False) == ENVELOPE


def test_small_or_incompressible_checkpoints_are_stored_as_they_are(
    store: RedisStore, new_run_id: Callable[[], str]
) -> None:
    small = seal_envelope(KEYRING, b'{"state":"' + b"x" * 1000 + b'"}')
    noise = seal_envelope(KEYRING, os.urandom(COMPRESS_MIN_BYTES * 2))  # no frame saves
    assert len(small) < COMPRESS_MIN_BYTES <= len(noise)
    for envelope in (small, noise):
        assert encode_checkpoint(envelope, compress=True) == envelope
        run_id = new_run_id()
        store.create_run(
            run_id, task_id="t", env_instance_id="e", scenario=b"s", checkpoint=envelope
        )
        assert _stored(store, run_id) == envelope
        assert store.read_run(run_id, with_checkpoint=True).checkpoint == envelope
