"""The handshake an MCP connection chooses by itself (``protocol="auto"``), against the
project's tickets server (``mcp`` 2.x, both protocol eras): over stdio ``initialize``
first, which a 2.x server takes as a 1.x one does (the reference servers' stderr:
test_reference_servers.py), with every feature ratchet reads from a server still there;
a server that refuses ``initialize`` (``--modern-only``) asked with ``server/discover``
and remembered; a server that dies in the handshake started once and reported with what
it said; over HTTP the newest protocol, the server logging nothing."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from ratchet.errors import AdapterError
from ratchet.runtime import Fence
from ratchet.tools import ToolCall
from ratchet.tools.mcp import MCPConnection, MCPTool, mcp_tools
from tests.tools.conftest import Tickets

HANDSHAKE = "2025-11-25"  # the newest revision of the initialize handshake
MODERN = "2026-07-28"  # the newest revision, asked with server/discover


def twice_with_one_key(conn: MCPConnection) -> None:
    """``create_ticket`` twice under one key, as a retry after a crash sends it."""
    (create,) = [t for t in mcp_tools(conn) if t.spec.name == "create_ticket"]
    assert isinstance(create, MCPTool)
    fence = Fence(run_id="run-h", lease_version=1, state_version=1)
    call = ToolCall(run_id="run-h", tool="create_ticket", idempotency_key="key-h", fence=fence)
    args = create.parse_args({"title": "printer on fire", "body": "third floor"})
    assert create.run(args, call) == create.run(args, call)


def test_the_default_handshake_is_initialize_and_sep3182_keys_still_dedupe(
    tickets: Tickets, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="ratchet.tools.mcp"):
        conn = tickets.connect("--sep3182")
        assert conn.client.protocol_version == HANDSHAKE
        assert conn.supports_idempotency_key  # read from the initialize answer
        twice_with_one_key(conn)
        tickets.kill(conn)
    seen = tickets.stats()
    assert (seen.effects, seen.replays, seen.keys_beside_arguments) == (1, 1, 2)
    assert not [r for r in caplog.records if r.name == "ratchet.tools.mcp.stderr"]
    assert not [r for r in caplog.records if "refused the initialize" in r.getMessage()]


def test_a_server_that_refuses_initialize_is_asked_with_discover_and_remembered(
    tickets: Tickets, caplog: pytest.LogCaptureFixture
) -> None:
    argv = tickets.argv("--modern-only", "--sep3182")  # one configuration, started twice

    def connect() -> MCPConnection:
        return tickets.adopt(MCPConnection.stdio(argv)).start()

    with caplog.at_level(logging.INFO, logger="ratchet.tools.mcp.connection"):
        first = connect()
        assert first.client.protocol_version == MODERN
        twice_with_one_key(first)
        refusals = [r for r in caplog.records if "refused the initialize" in r.getMessage()]
        assert len(refusals) == 1 and "code -32022" in refusals[0].getMessage()
        first.close()
        caplog.clear()
        again = connect()  # the same server, started again: asked with discovery first
        assert again.client.protocol_version == MODERN
    assert not [r for r in caplog.records if "refused the initialize" in r.getMessage()]
    seen = tickets.stats()
    assert (seen.effects, seen.replays, seen.keys_beside_arguments) == (1, 1, 2)


def test_legacy_is_initialize_only_and_says_in_one_line_why_a_server_refused_it(
    tickets: Tickets,
) -> None:
    with pytest.raises(AdapterError) as caught:
        tickets.connect("--modern-only", protocol="legacy")
    message = str(caught.value)
    assert "could not be connected (code -32022)" in message and "\n" not in message
    assert caught.value.retryable is True


def test_a_server_that_dies_in_the_handshake_is_started_once_and_reported_with_its_tail(
    tmp_path: Path,
) -> None:
    """A server that exits is not a server that refused initialize: no second start."""
    starts = tmp_path / "starts"
    dies = (
        "import sys; open(sys.argv[1], 'a').write('started\\n'); "
        "print('RuntimeError: no database at /srv/tickets', file=sys.stderr); sys.exit(3)"
    )
    conn = MCPConnection.stdio([sys.executable, "-c", dies, str(starts)], connect_timeout_s=20)
    with pytest.raises(AdapterError) as caught:
        conn.start()
    message = str(caught.value)
    assert "could not be connected" in message and "no database at /srv/tickets" in message
    assert "\n" not in message
    assert starts.read_text() == "started\n"


def test_over_http_the_default_is_the_newest_protocol_and_the_server_logs_nothing(
    tickets: Tickets,
) -> None:
    url = tickets.serve_http("--sep3182")
    conn = tickets.adopt(MCPConnection.http(url)).start()
    assert conn.client.protocol_version == MODERN
    twice_with_one_key(conn)
    conn.close()
    assert (tickets.stats().effects, tickets.stats().replays) == (1, 1)
    port = urlsplit(url).port
    assert (tickets.root / f"http-{port}.log").read_text() == ""
