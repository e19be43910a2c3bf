"""Two Python tools over an outbox file: ``send_invoice`` (a write with a lookup) and
``invoice_status`` (a read).

The outbox stands for a billing service that records the key each invoice was sent with,
as a payments API records an ``Idempotency-Key``: that record is what makes a lookup
possible, and so a crash between the call and ratchet's receipt recoverable without a
person.
"""

from __future__ import annotations

import json
import os
from typing import Any

import ratchet
from ratchet.tools import Found
from ratchet_example_tools.state import state_dir

__all__ = ["invoice_status", "send_invoice"]

OUTBOX = "outbox.jsonl"


def _sent() -> list[dict[str, Any]]:
    path = state_dir() / OUTBOX
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _shown(invoice: dict[str, Any]) -> dict[str, Any]:
    return {k: invoice[k] for k in ("invoice_id", "customer", "amount_cents")}


@ratchet.tool(risk="irreversible_external_write")
def send_invoice(customer: str, amount_cents: int, *, call: ratchet.ToolCall) -> dict[str, Any]:
    """Send an invoice to a customer, for an amount in cents."""
    key = call.idempotency_key or ""
    invoice = {
        "invoice_id": f"inv-{key[-12:]}",
        "customer": customer,
        "amount_cents": amount_cents,
        "key": key,
        "intent": call.intent_digest,
    }
    with (state_dir() / OUTBOX).open("a", encoding="utf-8") as outbox:
        outbox.write(json.dumps(invoice) + "\n")
        outbox.flush()
        os.fsync(outbox.fileno())
    return _shown(invoice)


@send_invoice.lookup
def find_invoice(key: str) -> Found | None:
    """The invoice sent with ``key``, and the intent it was sent for; None: none was."""
    for invoice in _sent():
        if invoice["key"] == key:
            return Found(_shown(invoice), intent_digest=invoice["intent"])
    return None


@ratchet.tool(risk="read_only")
def invoice_status(customer: str) -> dict[str, Any]:
    """Whether a customer was invoiced, and how many times."""
    count = sum(1 for invoice in _sent() if invoice["customer"] == customer)
    return {"customer": customer, "status": "sent" if count else "none", "invoices": count}
