"""An MCP server's answer is read at most up to the byte cap, while it streams in: a real
misbehaving server (``ratchet.testing.flood``) sending 200 MiB to a read-only tool over
stdio or streamable HTTP (one JSON body, one server-sent event, or a stream of small SSE
comments) is refused with a typed error, and the calling process's peak memory stays far
below what was sent; a write cut off that way waits for a reviewer and is never sent
again."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ratchet.errors import AdapterError, PeerAnswerTooLargeError
from ratchet.runtime import Action, Adapter, Phase, ReviewReason, RunEngine, TraceOutcome
from ratchet.runtime.actions import derive_idempotency_key
from ratchet.runtime.engine import Probe
from ratchet.tools import Toolbox, ToolsAdapter
from ratchet.tools.mcp import MCPConnection, mcp_tools
from tests.adapters.harness import Harness, scenario
from tests.tools.peer_probe import MIB, Flood, probe

LIMIT = 4 * MIB  # the default cap (RATCHET_MAX_PEER_BYTES)
SENT = 200 * MIB  # what a flood server sends (the flood server's default)
HEADROOM = 64 * MIB  # the most the caller's peak may grow while such an answer comes in
SMALL_LIMIT = 256 << 10  # for the in-process tests: a small flood goes past it quickly
FLOOD_SCENARIO = scenario(permissions=["flood_read", "flood_write", "echo", "finish"])


def _connect(flood: Flood, limit: int = SMALL_LIMIT) -> MCPConnection:
    if flood.kind == "mcp-stdio":
        return MCPConnection.stdio(flood.argv(), max_answer_bytes=limit).start()
    return MCPConnection.http(flood.url(), max_answer_bytes=limit).start()


@pytest.mark.parametrize(
    "transport, answer",
    [("mcp-stdio", None), ("mcp-http", "json"), ("mcp-http", "sse"), ("mcp-http", "sse-comments")],
    ids=["stdio", "http-json", "http-sse-event", "http-sse-comments"],
)
def test_a_200_mib_answer_to_a_read_only_tool_is_refused_and_the_callers_peak_stays_flat(
    tmp_path: Path, transport: str, answer: str | None
) -> None:
    args = ("--answer", answer) if answer is not None else ()
    with Flood(tmp_path / "flood", transport, *args) as flood:
        where: dict[str, Any] = (
            {"argv": flood.argv()} if transport == "mcp-stdio" else {"url": flood.url()}
        )
        report = probe("mcp", limit=LIMIT, **where)
        calls = flood.calls()
    assert report.get("error") == "PeerAnswerTooLargeError", report
    context = report["context"]
    assert context["peer"].startswith("MCP server (") and context["retryable"] is False
    assert context["limit_bytes"] == LIMIT
    # Reading stopped within one chunk (64 KiB) past the cap, of the 200 MiB sent.
    assert LIMIT < context["seen_bytes"] <= LIMIT + 256 * 1024
    growth = (report["peak_kib"] - report["baseline_kib"]) * 1024
    assert growth < HEADROOM, f"the caller's peak grew by {growth / MIB:.1f} MiB"
    assert calls == ["echo", "flood_read"]  # asked once, never again


@pytest.mark.parametrize(
    "transport, answer",
    [("mcp-stdio", "json"), ("mcp-http", "json"), ("mcp-http", "sse")],
    ids=["stdio", "http-json", "http-sse-event"],
)
def test_an_answer_under_the_cap_arrives_whole(tmp_path: Path, transport: str, answer: str) -> None:
    size = SMALL_LIMIT - 1024  # the JSON around the text fits in what is left
    with Flood(tmp_path / "flood", transport, "--bytes", str(size), "--answer", answer) as flood:
        conn = _connect(flood)
        try:
            result = conn.call_tool("flood_read", {})
        finally:
            conn.close()
    assert not result.is_error
    text = result.content[0]
    assert getattr(text, "text", "") == "x" * size


def test_a_compressed_answer_is_refused_unread_and_the_connection_serves_on(
    tmp_path: Path,
) -> None:
    with Flood(tmp_path / "flood", "mcp-http", "--answer", "gzip") as flood:
        conn = _connect(flood)
        try:
            with pytest.raises(PeerAnswerTooLargeError) as caught:
                conn.call_tool("flood_read", {})
            after = conn.call_tool("echo", {})
        finally:
            conn.close()
    refusal = caught.value
    assert refusal.encoding == "gzip" and refusal.seen_bytes == 0
    assert refusal.limit_bytes == SMALL_LIMIT
    assert getattr(after.content[0], "text", "") == "ok"


def test_after_a_cut_an_http_connection_serves_on(tmp_path: Path) -> None:
    with Flood(tmp_path / "flood", "mcp-http", "--bytes", str(2 * MIB)) as flood:
        conn = _connect(flood)
        try:
            with pytest.raises(PeerAnswerTooLargeError):
                conn.call_tool("flood_read", {})
            assert getattr(conn.call_tool("echo", {}).content[0], "text", "") == "ok"
        finally:
            conn.close()


def test_after_a_cut_a_stdio_connection_refuses_further_calls_as_retryable(
    tmp_path: Path,
) -> None:
    """A stdio stream cut inside a line has no message boundary left: the session ends
    with the refusal, and a later call is told the connection ended (a new connection,
    a new server process, is the way on)."""
    with Flood(tmp_path / "flood", "mcp-stdio", "--bytes", str(2 * MIB)) as flood:
        conn = _connect(flood)
        try:
            with pytest.raises(PeerAnswerTooLargeError) as caught:
                conn.call_tool("flood_read", {})
            with pytest.raises(AdapterError) as later:
                conn.call_tool("echo", {})
        finally:
            conn.close()
    assert caught.value.seen_bytes > SMALL_LIMIT
    assert not isinstance(later.value, PeerAnswerTooLargeError)
    assert later.value.retryable is True
    assert "past the cap" in later.value.message


# -- through the engine -----------------------------------------------------------------------


@dataclass
class FloodRun(Harness):
    """The adapter harness over the flood server's tools (one connection per opening,
    as a new worker would make)."""

    def ports(self, adapter: Adapter, store: Any, probe: Probe | None = None) -> dict[str, Any]:
        ports = super().ports(adapter, store, probe)
        if isinstance(adapter, ToolsAdapter):
            ports["tools"] = adapter.catalog
        return ports


def _flood_run(flood: Flood, ledger: Path, opened: list[MCPConnection]) -> FloodRun:
    def open_adapter() -> Adapter:
        conn = _connect(flood)
        opened.append(conn)
        return Toolbox(mcp_tools(conn)).environment(FLOOD_SCENARIO, ledger=ledger)

    return FloodRun(open_adapter=open_adapter, effects=lambda: 0, scenario=FLOOD_SCENARIO)


def _tool_action(run: Harness, engine: RunEngine, kind: str, risk: str) -> Action:
    key = derive_idempotency_key(engine.state.run_id, engine.state.plan_cursor)
    return Action.model_validate(
        {
            "action_id": f"a-{engine.state.next_seq}",
            "kind": kind,
            "risk": risk,
            "args": {},
            "idempotency_key": key if risk != "read_only" else None,
            "expected_env_version": engine.state.environment.version,
            "deadline_at": run.clock.now() + 600,
        }
    )


def test_a_write_whose_answer_is_past_the_cap_waits_for_a_reviewer_and_is_never_sent_again(
    tmp_path: Path,
) -> None:
    opened: list[MCPConnection] = []
    with Flood(tmp_path / "flood", "mcp-stdio", "--bytes", str(2 * MIB)) as flood:
        run = _flood_run(flood, tmp_path / "tools.ledger", opened)
        try:
            engine = run.start()
            engine.propose(_tool_action(run, engine, "flood_write", "irreversible_external_write"))
            review = engine.state.review
            event = engine.state.trace[-1]
            # A new owner restores it: the review holds, nothing is sent again.
            resumed = run.resume(lease_version=2)
            resumed.reconcile()
        finally:
            for conn in opened:
                conn.close()
        calls = flood.calls()
    assert engine.state.phase is Phase.NEEDS_REVIEW
    assert review is not None and review.reason is ReviewReason.OUTCOME_UNKNOWN
    assert event.outcome is TraceOutcome.REVIEW_OPENED
    assert "past the cap" in str(event.detail.get("detail"))
    assert resumed.state.phase is Phase.NEEDS_REVIEW
    assert calls == ["flood_write"]  # once: never retried


def test_a_read_whose_answer_is_past_the_cap_is_refused_and_commits_nothing(
    tmp_path: Path,
) -> None:
    opened: list[MCPConnection] = []
    with Flood(tmp_path / "flood", "mcp-http", "--bytes", str(2 * MIB)) as flood:
        run = _flood_run(flood, tmp_path / "tools.ledger", opened)
        try:
            engine = run.start()
            generation = engine.generation
            with pytest.raises(PeerAnswerTooLargeError) as caught:
                engine.propose(_tool_action(run, engine, "flood_read", "read_only"))
        finally:
            for conn in opened:
                conn.close()
        calls = flood.calls()
    assert caught.value.retryable is False
    assert engine.generation == generation  # nothing of the step was committed
    assert engine.state.phase is Phase.RUNNING
    assert calls == ["flood_read"]
