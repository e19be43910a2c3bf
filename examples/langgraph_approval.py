"""Human-in-the-loop with LangGraph's ``interrupt()`` and a signed, exact approval.

A graph proposes an irreversible external call (a payment), interrupts with an approval
request bound to the call's intent digest, and executes it only after an approver's
Ed25519 approval of exactly that call passed ratchet's checks. State lives in Redis through
``RatchetSaver`` (signed, fenced); the approval is checked before LangGraph stores it.

Run it (it starts its own redis-server in a temporary folder)::

    pip install 'ratchet[langgraph]'
    python examples/langgraph_approval.py
"""

from __future__ import annotations

import json
import tempfile
import time
from typing import Any, TypedDict

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from langchain_core.runnables import RunnableConfig
from langgraph.graph import END, START, StateGraph
from langgraph.types import interrupt

from ratchet.langgraph import RatchetSaver
from ratchet.langgraph.approval import ApprovalGate, approval_request
from ratchet.redis_server import RedisServer
from ratchet.runtime.actions import Action, derive_idempotency_key
from ratchet.runtime.canonical import Domain, digest
from ratchet.runtime.evidence import ApprovalClaims, TrustRoots, sign_approval
from ratchet.runtime.signing import KeyRing


class PaymentState(TypedDict, total=False):
    amount: str
    payee: str
    receipt: str


class PaymentService:
    """Stands for an external API with authoritative, idempotent receipts."""

    def __init__(self) -> None:
        self.receipts: dict[str, str] = {}

    def pay(self, idempotency_key: str, body: str) -> str:
        return self.receipts.setdefault(idempotency_key, f"receipt-{len(self.receipts) + 1}")


def payment_action(thread_id: str, state: PaymentState) -> Action:
    body = json.dumps({"amount": state["amount"], "payee": state["payee"]}, sort_keys=True)
    return Action(
        action_id="pay-1",
        kind="external_call",
        risk="irreversible_external_write",
        args={"operation": "payments.create", "body": body},
        idempotency_key=derive_idempotency_key(thread_id, 1),
        expected_env_version=0,
        deadline_at=2**62,
    )


def request_for(thread_id: str, action: Action) -> dict[str, Any]:
    return approval_request(
        task_id="pay-invoice",
        run_id=thread_id,
        policy_id="payments",
        policy_version="v1",
        action_id=action.action_id,
        idempotency_key=action.idempotency_key,
        intent_digest=action.intent_digest,
        env_instance_id="payments-prod",
        env_fingerprint=digest(Domain.ENVIRONMENT, {"service": "payments-prod"}),
        env_version=0,
        generation=0,
    )


def build_graph(saver: RatchetSaver, gate: ApprovalGate, service: PaymentService) -> Any:
    def pay(state: PaymentState, config: RunnableConfig) -> PaymentState:
        thread_id = config["configurable"]["thread_id"]
        action = payment_action(thread_id, state)
        request = request_for(thread_id, action)
        # On resume the node runs again from its start: everything above is recomputed
        # and must give the same request; the payment below is idempotent by its key.
        approval = interrupt(request)
        gate.confirm(approval, request, thread_id=thread_id)
        receipt = service.pay(action.idempotency_key or "", action.args["body"])
        return {"receipt": receipt}

    builder = StateGraph(PaymentState)
    builder.add_node("pay", pay)
    builder.add_edge(START, "pay")
    builder.add_edge("pay", END)
    return builder.compile(checkpointer=saver)


def approve(
    private_key: Ed25519PrivateKey, request: dict[str, Any], *, nonce: str, expires_at: int
) -> dict[str, Any]:
    """The approver's side: sign exactly the request shown to them."""
    claims = ApprovalClaims(
        **{k: v for k, v in request.items() if k != "kind"},
        nonce=nonce,
        expires_at=expires_at,
        max_proposals=1,
    )
    return sign_approval(private_key, "alice", claims).model_dump(mode="json")


def main() -> None:
    with tempfile.TemporaryDirectory() as folder, RedisServer(folder) as server:
        keyring = KeyRing.from_secrets(
            {"k1": b"example-key-material-32-bytes!!!"}, signing_kid="k1"
        )
        approver = Ed25519PrivateKey.generate()
        trust = TrustRoots.from_public_bytes(
            "approver",
            {"alice": approver.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)},
        )
        saver = RatchetSaver(server.client(), keyring=keyring, owner="example-worker")
        gate = ApprovalGate(trust, server.client())
        service = PaymentService()
        graph = build_graph(saver, gate, service)

        lease = saver.claim("invoice-42")
        config = lease.config()
        graph.invoke({"amount": "120.00", "payee": "ACME"}, config, durability="sync")
        pending = graph.get_state(config).interrupts[0].value
        print("waiting for approval of intent", pending["intent_digest"][:16])

        now = int(time.time())
        approval = approve(approver, pending, nonce="n-0001", expires_at=now + 600)
        result = gate.resume(graph, config, approval, now=now, durability="sync")
        print("paid:", result["receipt"], "receipts at the service:", service.receipts)


if __name__ == "__main__":
    main()
