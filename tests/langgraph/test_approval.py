"""The human-in-the-loop example: an interrupt resumed only by an exact, signed approval."""

from __future__ import annotations

import importlib.util
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from ratchet.errors import ApprovalError, NonceReplayError
from ratchet.langgraph import RatchetSaver
from ratchet.langgraph.approval import ApprovalGate
from ratchet.runtime.evidence import TrustRoots
from ratchet.runtime.signing import KeyRing

from .conftest import Backend

_PATH = Path(__file__).resolve().parents[2] / "examples" / "langgraph_approval.py"


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("langgraph_approval_example", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class World:
    def __init__(self, backend: Backend, keyring: KeyRing) -> None:
        self.ex = _example()
        self.approver = Ed25519PrivateKey.generate()
        self.intruder = Ed25519PrivateKey.generate()
        trust = TrustRoots.from_public_bytes(
            "approver",
            {"alice": self.approver.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)},
        )
        self.saver = RatchetSaver(backend.client(), keyring=keyring, owner="worker")
        self.gate = ApprovalGate(trust, backend.client())
        self.service = self.ex.PaymentService()
        self.graph = self.ex.build_graph(self.saver, self.gate, self.service)
        self.thread = f"invoice-{uuid.uuid4().hex[:8]}"
        self.config = self.saver.claim(self.thread).config()
        self.now = int(time.time())
        self.nonce = f"n-{uuid.uuid4().hex[:12]}"  # the real server is shared, never flushed

    def start(self, amount: str = "120.00") -> dict[str, Any]:
        self.graph.invoke({"amount": amount, "payee": "ACME"}, self.config, durability="sync")
        value: dict[str, Any] = self.graph.get_state(self.config).interrupts[0].value
        return value

    def approval(
        self,
        request: dict[str, Any],
        *,
        key: Any = None,
        nonce: str | None = None,
        expires_in: int = 600,
    ) -> dict[str, Any]:
        result: dict[str, Any] = self.ex.approve(
            key or self.approver,
            request,
            nonce=nonce or self.nonce,
            expires_at=self.now + expires_in,
        )
        return result

    def resume(self, value: Any) -> Any:
        return self.gate.resume(self.graph, self.config, value, now=self.now, durability="sync")


@pytest.fixture
def world(backend: Backend, keyring: KeyRing) -> World:
    return World(backend, keyring)


def test_an_exact_signed_approval_resumes_the_graph_and_pays_once(world: World) -> None:
    request = world.start()
    result = world.resume(world.approval(request))
    assert result["receipt"] == "receipt-1"
    assert len(world.service.receipts) == 1


def test_an_approval_of_another_amount_is_refused_before_it_is_stored(world: World) -> None:
    request = world.start("120.00")
    other = world.ex.request_for(
        world.thread, world.ex.payment_action(world.thread, {"amount": "999.00", "payee": "ACME"})
    )
    with pytest.raises(ApprovalError) as refused:
        world.resume(world.approval(other))
    assert refused.value.reason == "binding" and refused.value.field == "intent_digest"
    assert world.service.receipts == {}
    tup = world.saver.get_tuple(world.config)
    assert tup is not None and not [w for w in tup.pending_writes or [] if w[1] == "__resume__"]
    assert world.graph.get_state(world.config).interrupts[0].value == request


@pytest.mark.parametrize("case", ["untrusted_key", "expired", "malformed"])
def test_forged_expired_or_malformed_approvals_are_refused(world: World, case: str) -> None:
    request = world.start()
    if case == "untrusted_key":
        value: Any = world.approval(request, key=world.intruder)
        reason = "bad_signature"
    elif case == "expired":
        value = world.approval(request, expires_in=-1)
        reason = "expired"
    else:
        value = {"approve": True}
        reason = "malformed"
    with pytest.raises(ApprovalError) as refused:
        world.resume(value)
    assert refused.value.reason == reason
    assert world.service.receipts == {}


def test_a_nonce_is_consumed_once(world: World, backend: Backend, keyring: KeyRing) -> None:
    world.resume(world.approval(world.start()))
    again = World(backend, keyring)
    request = again.start()
    with pytest.raises(NonceReplayError):
        again.resume(again.approval(request, nonce=world.nonce))
    assert again.service.receipts == {}


def test_a_resume_value_written_around_the_gate_is_refused_by_the_node(world: World) -> None:
    from langgraph.types import Command

    request = world.start()
    value = world.approval(request, nonce=f"n-{uuid.uuid4().hex[:8]}")
    with pytest.raises(NonceReplayError):
        world.graph.invoke(Command(resume=value), world.config, durability="sync")
    assert world.service.receipts == {}
