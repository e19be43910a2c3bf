"""Which handshake an MCP connection starts with, so that no server logs an error for it
whichever ``mcp`` it runs on (``protocol="auto"``, the default):

* **stdio**: ``initialize`` first. A server on ``mcp`` 1.x knows only that; a server on
  ``mcp`` 2.x speaks both protocol eras and takes the era of the client's first request
  for the process's life (its answer to ``initialize`` says nothing of the newer one, so
  there is nothing to upgrade on: ratchet reads the same capabilities either way). The
  SDK's own default, ``server/discover`` first, is what a 1.x server answers with a page
  of validation errors on its stderr. A server that refuses ``initialize`` with a JSON-RPC
  error (a server of the 2026-07-28 protocol only, which names the versions it speaks) is
  started again and asked with ``server/discover``; this process remembers that server
  (by a digest of its program, arguments, environment and folder) and asks it with
  ``server/discover`` first from then on, as the specification advises ("cache the
  result for the lifetime of the server process ... MAY persist it across restarts of
  the same server configuration").
* **streamable HTTP**: ``server/discover`` first, then ``initialize`` (the SDK's default,
  and the specification's way over HTTP): a 1.x server answers the discovery with an
  HTTP 400 and logs no error, and a 2.x server is served statelessly.

``protocol="legacy"`` is ``initialize`` only, on either transport.

A server that dies during the handshake, or does not answer it in time, did not refuse
it: nothing is tried again (the caller gets the connect error, with the server's stderr
tail).
"""

from __future__ import annotations

import threading

from mcp import MCPError
from mcp_types import CONNECTION_CLOSED

__all__ = ["PROTOCOLS", "first_mode", "handshake_refusal", "remember_modern"]

#: The handshakes a connection may be told to use.
PROTOCOLS = ("auto", "legacy")

# Stdio servers that refused initialize in this process, by configuration digest.
_modern_only: set[str] = set()
_lock = threading.Lock()


def first_mode(protocol: str, stdio: str | None) -> str:
    """The SDK client's ``mode`` for a connection's first handshake: ``"legacy"`` is
    ``initialize``, ``"auto"`` is ``server/discover`` falling back to it. ``stdio`` is a
    stdio server's configuration digest (None: streamable HTTP)."""
    if protocol == "legacy":
        return "legacy"
    if stdio is None:
        return "auto"
    with _lock:
        return "auto" if stdio in _modern_only else "legacy"


def remember_modern(stdio: str) -> None:
    """The stdio server ``stdio`` (its configuration digest) refused initialize and was
    served after ``server/discover``: later connections to it start with that."""
    with _lock:
        _modern_only.add(stdio)


def handshake_refusal(exc: BaseException) -> MCPError | None:
    """The JSON-RPC error a server answered the handshake with (looked for inside the
    exception groups the transport raises), or None: the transport failed, the server
    died or did not answer in time."""
    if isinstance(exc, MCPError):
        return None if exc.code == CONNECTION_CLOSED else exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = handshake_refusal(inner)
            if found is not None:
                return found
    return None
