"""Key material never appears in a checkpoint, a trace, a repr or an error message."""

from __future__ import annotations

import pickle

import pytest
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
)

from ratchet.errors import CheckpointError, ConfigurationError
from ratchet.runtime import KeyRing, SecretKey
from tests.runtime.world import CHECKPOINT_SECRET, OTHER_SECRET, World


def forms(secret: bytes) -> list[bytes]:
    import base64

    return [
        secret,
        secret.hex().encode(),
        base64.b64encode(secret),
        secret.decode("latin-1").encode("unicode_escape"),
    ]


def private_bytes(world: World) -> list[bytes]:
    out = []
    for key in (world.approver_key, world.reviewer_key):
        raw = key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        out += forms(raw)
    return out


def test_no_key_material_in_checkpoints_traces_reprs_or_errors(world: World) -> None:
    engine = world.start()
    engine.propose(world.order(engine))
    engine.refresh_pending_approval(world.approve(engine))
    engine.propose(world.write(engine))
    texts = [
        engine.checkpoint,
        repr(engine).encode(),
        repr(engine.state).encode(),
        repr(engine.state.trace).encode(),
        repr(world.keyring).encode(),
        str(world.keyring).encode(),
        repr(world.keyring.keys).encode(),
        repr(world.approvers).encode(),
    ]
    wrong = KeyRing.from_secrets({"k1": OTHER_SECRET}, signing_kid="k1")
    with pytest.raises(CheckpointError) as err:
        from ratchet.runtime import restore_checkpoint

        restore_checkpoint(
            engine.checkpoint,
            scenario=world.scenario,
            keyring=wrong,
            high_water=world.store.high_water,
            observe=lambda *_: world.adapter.observe(),
        )
    texts += [str(err.value).encode(), repr(err.value).encode()]
    with pytest.raises(ConfigurationError) as short:
        SecretKey(b"too-short-" + CHECKPOINT_SECRET[:5])
    texts += [str(short.value).encode(), repr(short.value).encode()]
    needles = forms(CHECKPOINT_SECRET) + forms(OTHER_SECRET) + private_bytes(world)
    for text in texts:
        for needle in needles:
            assert needle not in text
    assert b"CANARY" not in b"".join(texts)


def test_secret_keys_refuse_to_be_pickled() -> None:
    with pytest.raises(TypeError):
        pickle.dumps(SecretKey(CHECKPOINT_SECRET))


def test_keys_shorter_than_32_bytes_are_refused() -> None:
    with pytest.raises(ConfigurationError):
        KeyRing.from_secrets({"k1": b"x" * 31}, signing_kid="k1")
