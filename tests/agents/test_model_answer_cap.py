"""The chat-model client reads an answer at most up to the byte cap, while it streams in:
a real HTTP server sending a 200 MiB completion is refused with a typed error, once (never
asked again), and the calling process's peak memory stays far below what was sent."""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ratchet.agents.models import ModelRequest, OpenAIChatModel
from ratchet.errors import ConfigurationError, PeerAnswerTooLargeError
from tests.tools.peer_probe import MIB, Flood, probe

LIMIT = 4 * MIB  # the default cap (RATCHET_MAX_PEER_BYTES)
HEADROOM = 64 * MIB
REQUEST = ModelRequest(messages=[{"role": "user", "content": "hello"}])
CHUNK = 64 << 10


def test_a_200_mib_completion_is_refused_once_and_the_callers_peak_stays_flat(
    tmp_path: Path,
) -> None:
    with Flood(tmp_path / "flood", "service", "--spare", "/spare") as flood:
        report = probe("chat", limit=LIMIT, base_url=flood.url("/v1"), warm_url=flood.url("/spare"))
        calls = flood.calls()
    assert report.get("error") == "PeerAnswerTooLargeError", report
    context = report["context"]
    assert context["peer"] == f"chat model (http://127.0.0.1:{flood.port}/v1)"
    assert context["limit_bytes"] == LIMIT and LIMIT < context["seen_bytes"] <= LIMIT + CHUNK
    growth = (report["peak_kib"] - report["baseline_kib"]) * 1024
    assert growth < HEADROOM, f"the caller's peak grew by {growth / MIB:.1f} MiB"
    # max_retries is 3, yet the refused answer is not asked for again.
    assert calls == ["POST /spare/chat/completions", "POST /v1/chat/completions"]


def _model(handler: httpx.MockTransport, limit: int = 256 << 10) -> OpenAIChatModel:
    return OpenAIChatModel(
        "http://model.test/v1",
        "m",
        transport=handler,
        max_answer_bytes=limit,
        sleep=lambda _: pytest.fail("a refused answer is never retried"),
    )


def test_an_error_body_past_the_cap_is_refused_without_reading_the_rest() -> None:
    pulled: list[int] = []

    def body() -> Iterator[bytes]:
        for _ in range(200 * MIB // CHUNK):  # 200 MiB, should anyone read it all
            pulled.append(CHUNK)
            yield b"x" * CHUNK

    def answer(request: httpx.Request) -> httpx.Response:
        assert request.headers["Accept-Encoding"] == "identity"
        return httpx.Response(503, content=body())

    with pytest.raises(PeerAnswerTooLargeError) as caught:
        _model(httpx.MockTransport(answer))(REQUEST)
    assert caught.value.limit_bytes == 256 << 10
    assert sum(pulled) <= (256 << 10) + CHUNK  # reading stopped at the cap


def test_a_compressed_answer_is_refused_unread() -> None:
    packed = gzip.compress(b'{"choices": [{"message": {"content": "' + b"x" * MIB + b'"}}]}')

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"Content-Encoding": "gzip"}, content=packed)

    with pytest.raises(PeerAnswerTooLargeError) as caught:
        _model(httpx.MockTransport(answer))(REQUEST)
    assert caught.value.encoding == "gzip" and caught.value.seen_bytes == 0


def test_an_answer_under_the_cap_is_read_whole() -> None:
    text = "y" * (100 << 10)

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"choices": [{"message": {"content": text}}]})

    assert _model(httpx.MockTransport(answer))(REQUEST).content == text


@pytest.mark.parametrize("limit", [0, (64 << 10) - 1, (1 << 30) + 1])
def test_a_cap_out_of_range_is_refused_at_construction(limit: int) -> None:
    with pytest.raises(ConfigurationError) as caught:
        OpenAIChatModel("http://model.test/v1", "m", max_answer_bytes=limit)
    assert caught.value.field == "max_answer_bytes"
