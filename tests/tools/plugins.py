"""A tool package installed the way pip leaves one (a module and its dist-info on
``sys.path``), for the tests of entry-point tools: ``installed`` is the fixture."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["ENTRY_POINTS", "PLUGIN", "installed"]

PLUGIN = '''
import ratchet

LOADED = []

@ratchet.tool(risk="irreversible_external_write", idempotent=True)
def create_refund(order_id: str, amount_cents: int) -> dict:
    """Refund part of an order."""
    return {"order_id": order_id}

@ratchet.tool(risk="read_only")
def order_status(order_id: str) -> dict:
    return {"order_id": order_id}

def misnamed():
    return order_status

def broken():
    raise RuntimeError("secret-token-in-a-message")

def server_down():
    raise ConnectionRefusedError("secret-token-in-a-message")

def server_died():
    raise ExceptionGroup("unhandled errors in a TaskGroup", [EOFError("secret-token")])

DOWN = []

def flaky_status():
    if DOWN:
        raise ConnectionRefusedError("the server is down")
    return order_status_named

@ratchet.tool(risk="read_only", name="flaky_status")
def order_status_named(order_id: str) -> dict:
    return {"order_id": order_id}

def adapter_says():
    from ratchet.errors import AdapterError
    raise AdapterError("MCP server (x) could not be connected", retryable=True)
'''

ENTRY_POINTS = """[ratchet.tools]
create_refund = refund_plugin:create_refund
order_status = refund_plugin:order_status
misnamed = refund_plugin:misnamed
broken = refund_plugin:broken
server_down = refund_plugin:server_down
server_died = refund_plugin:server_died
adapter_says = refund_plugin:adapter_says
flaky_status = refund_plugin:flaky_status
not_importable = refund_plugin_missing:create_refund
"""


@pytest.fixture
def installed(tmp_path: Path) -> Iterator[Path]:
    """A package installed the way pip leaves one: a module and its dist-info."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "refund_plugin.py").write_text(PLUGIN)
    info = site / "refund_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: refund-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    try:
        yield site
    finally:
        sys.path.remove(str(site))
        sys.modules.pop("refund_plugin", None)
        importlib.invalidate_caches()
