"""The HTTP adapter reads a reply at most up to the byte cap, while it streams in: a real
service sending 200 MiB is refused with a typed error, and the calling process's peak
memory stays far below what was sent; a write whose reply is past the cap looks its key
up and, with no receipt to read, is an outcome unknown (review), never sent again."""

from __future__ import annotations

from pathlib import Path

import pytest

from ratchet.adapters.http import HttpAdapter
from ratchet.errors import OutcomeUnknownError, PeerAnswerTooLargeError
from ratchet.runtime import Fence
from tests.adapters.harness import order
from tests.tools.peer_probe import MIB, Flood, probe

LIMIT = 4 * MIB  # the default cap (RATCHET_MAX_PEER_BYTES)
HEADROOM = 64 * MIB
SMALL_LIMIT = 256 << 10


def test_a_200_mib_reply_is_refused_and_the_callers_peak_stays_flat(tmp_path: Path) -> None:
    with Flood(tmp_path / "flood", "service", "--spare", "/spare") as flood:
        report = probe(
            "http-adapter", limit=LIMIT, base_url=flood.url(""), warm_url=flood.url("/spare")
        )
        calls = flood.calls()
    assert report.get("error") == "PeerAnswerTooLargeError", report
    context = report["context"]
    assert context["peer"] == f"HTTP service (http://127.0.0.1:{flood.port})"
    assert context["limit_bytes"] == LIMIT and LIMIT < context["seen_bytes"] <= LIMIT + (64 << 10)
    growth = (report["peak_kib"] - report["baseline_kib"]) * 1024
    assert growth < HEADROOM, f"the caller's peak grew by {growth / MIB:.1f} MiB"
    assert calls == ["GET /spare/v1/identity", "GET /v1/identity"]  # never asked again


@pytest.mark.parametrize("receipts", ["flooded", "none"])
def test_a_write_whose_reply_is_past_the_cap_is_an_outcome_unknown_never_sent_again(
    tmp_path: Path, receipts: str
) -> None:
    spare = ("--spare", "/v1/receipts") if receipts == "none" else ()
    with Flood(tmp_path / "flood", "service", "--bytes", str(2 * MIB), *spare) as flood:
        adapter = HttpAdapter(flood.url(""), max_reply_bytes=SMALL_LIMIT)
        action = order("order-1")
        fence = Fence(run_id="run-1", lease_version=1, state_version=1)
        try:
            with pytest.raises(OutcomeUnknownError) as caught:
                adapter.execute(action, action.intent_digest, fence, None)
        finally:
            adapter.close()
        calls = flood.calls()
    unknown = caught.value
    assert isinstance(unknown.__cause__, PeerAnswerTooLargeError)
    assert unknown.context["limit_bytes"] == SMALL_LIMIT
    assert unknown.context["seen_bytes"] > SMALL_LIMIT
    assert unknown.context["idempotency_key"] == "order-1"
    # Sent once; its key looked up once (the receipt's reply was cut too, or there was none).
    assert calls == ["POST /v1/orders", "GET /v1/receipts/order-1"]
