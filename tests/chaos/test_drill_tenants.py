"""The drill's orders server, many tenants behind one port: each request of a kept-alive
connection goes to the tenant its path names."""

from __future__ import annotations

import http.client
from pathlib import Path
from urllib.parse import urlsplit

from ratchet.adapters import HttpAdapter
from ratchet.chaos.drill.services import TenantOrders


def test_every_request_of_a_kept_connection_is_routed_by_its_own_path(tmp_path: Path) -> None:
    orders = TenantOrders(tmp_path / "orders")
    try:
        first, second = orders.add("ta"), orders.add("tb")
        adapter = HttpAdapter(first)
        identity = adapter.observe()
        assert adapter.observe() == identity  # the kept connection's second request
        # One connection, two tenants in turn: each answers with its own identity.
        parts = urlsplit(first)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
        seen = []
        try:
            for url in (first, second, first):
                conn.request("GET", urlsplit(url).path + "/v1/identity")
                response = conn.getresponse()
                seen.append((response.status, response.read()))
        finally:
            conn.close()
        assert [status for status, _ in seen] == [200, 200, 200]
        assert seen[0][1] == seen[2][1] != seen[1][1]
        adapter.close()
    finally:
        orders.stop()
