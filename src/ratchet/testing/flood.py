"""Peers that answer with far more than anyone should read, for the tests of
:mod:`ratchet.limits` (DESIGN.md §9: no unbounded read of a network answer)::

    python -m ratchet.testing.flood mcp-stdio [--bytes N] [--calls FILE]
    python -m ratchet.testing.flood mcp-http --port-file FILE [--answer json|sse|sse-comments|gzip]
        [--bytes N] [--calls FILE]
    python -m ratchet.testing.flood service --port-file FILE [--spare PATH ...] [--bytes N]
        [--calls FILE]

``mcp-stdio`` and ``mcp-http`` are MCP servers written by hand (JSON-RPC over stdio lines,
or streamable HTTP at ``/mcp``), so that an answer can be streamed without ever being
built: the ``mcp`` package's server would hold it in memory, several times over. They
offer ``flood_read`` (``readOnlyHint``) and ``flood_write`` (``destructiveHint``), which
answer with a text content of ``--bytes`` bytes (default 200 MiB), and ``echo``
(``readOnlyHint``), which answers ``ok``. Over HTTP the flood is one JSON body (``json``),
one server-sent event (``sse``), a stream of SSE comment lines (each small; ``--bytes`` of
them in all) before a small result (``sse-comments``), or a gzip body that inflates to
``--bytes`` (``gzip``, a few hundred KiB on the wire).

``service`` answers every request at any path but the ``--spare`` ones with a JSON body of
``--bytes`` bytes (shaped like a chat completion); ``GET /v1/identity`` at a spared path
answers a small identity, as the reference orders service would.

Each flood is written in 64 KiB chunks of one constant block: the server's memory stays
flat whatever ``--bytes`` says. A reader that stops early makes the write fail; the server
drops that connection and goes on. ``--calls FILE`` appends one line per tool call (its
name) or request (``METHOD PATH``), so a test can count what reached the server.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import zlib
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, BinaryIO

__all__ = ["FLOOD_TOOLS", "main"]

_CHUNK = b"x" * (64 << 10)
_DEFAULT_BYTES = 200 << 20
#: The tools an MCP flood server offers, with their annotations.
FLOOD_TOOLS: dict[str, dict[str, bool]] = {
    "flood_read": {"readOnlyHint": True},
    "flood_write": {"readOnlyHint": False, "destructiveHint": True},
    "echo": {"readOnlyHint": True},
}


def _padding(size: int) -> Iterator[bytes]:
    """``size`` bytes of ``x``, in chunks of one constant block."""
    left = size
    while left > 0:
        piece = _CHUNK if left >= len(_CHUNK) else _CHUNK[:left]
        left -= len(piece)
        yield piece


def _flood_result(request_id: Any, size: int) -> tuple[bytes, Iterator[bytes], bytes]:
    """A ``tools/call`` result whose one text content holds ``size`` bytes: (prefix, the
    padding, suffix), never joined."""
    head = b'{"jsonrpc":"2.0","id":' + json.dumps(request_id).encode()
    head += b',"result":{"content":[{"type":"text","text":"'
    return head, _padding(size), b'"}],"isError":false}}'


def _small(request_id: Any, result: dict[str, Any]) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": request_id, "result": result}).encode()


def _error(request_id: Any, code: int, message: str) -> bytes:
    answer = {"jsonrpc": "2.0", "id": request_id, "error": {"code": code, "message": message}}
    return json.dumps(answer).encode()


class _Calls:
    """Appends one line per call to a file (or nowhere)."""

    def __init__(self, path: str | None) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600) if path else -1

    def record(self, what: str) -> None:
        if self._fd >= 0:
            os.write(self._fd, what.encode() + b"\n")


def _answer(message: dict[str, Any], calls: _Calls) -> bytes | str | None:
    """What the server answers ``message``: a small JSON-RPC answer, the name of a flood
    tool (its answer is streamed), or None (a notification: no answer)."""
    request_id = message.get("id")
    method = message.get("method")
    if request_id is None:
        return None
    params = message.get("params") or {}
    if method == "initialize":
        return _small(
            request_id,
            {
                "protocolVersion": params.get("protocolVersion", "2025-06-18"),
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "flood", "version": "1"},
            },
        )
    if method == "ping":
        return _small(request_id, {})
    if method == "tools/list":
        tools = [
            {
                "name": name,
                "description": f"{name} (a flood server's tool)",
                "inputSchema": {"type": "object", "properties": {}},
                "annotations": hints,
            }
            for name, hints in FLOOD_TOOLS.items()
        ]
        return _small(request_id, {"tools": tools})
    if method == "tools/call":
        name = str(params.get("name", ""))
        calls.record(name)
        if name == "echo":
            return _small(request_id, {"content": [{"type": "text", "text": "ok"}]})
        if name in FLOOD_TOOLS:
            return name
        return _error(request_id, -32602, f"no tool {name}")
    return _error(request_id, -32601, f"method {method} not found")


# -- stdio -------------------------------------------------------------------------------------


def _serve_stdio(size: int, calls: _Calls) -> None:
    out: BinaryIO = sys.stdout.buffer
    for line in sys.stdin.buffer:
        try:
            message = json.loads(line)
        except ValueError:
            continue
        answer = _answer(message, calls) if isinstance(message, dict) else None
        try:
            if isinstance(answer, bytes):
                out.write(answer + b"\n")
            elif isinstance(answer, str):
                head, body, tail = _flood_result(message["id"], size)
                out.write(head)
                for chunk in body:
                    out.write(chunk)
                out.write(tail + b"\n")
            out.flush()
        except (BrokenPipeError, ConnectionError):
            return  # the client stopped reading and closed the pipe


# -- HTTP --------------------------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _FloodServer

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: a test reads the calls file, not a log."""

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(min(length, 1 << 20))

    def _send(
        self,
        status: int,
        content_type: str,
        chunks: Iterator[bytes],
        length: int | None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        if length is not None:
            self.send_header("Content-Length", str(length))
        else:
            self.send_header("Connection", "close")
            self.close_connection = True
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        try:
            for chunk in chunks:
                self.wfile.write(chunk)
            self.wfile.flush()
        except (BrokenPipeError, ConnectionError):
            self.close_connection = True  # the reader stopped early: that is the point

    def _small(self, body: bytes, status: int = 200) -> None:
        self._send(status, "application/json", iter([body]), len(body))

    def do_GET(self) -> None:
        self.server.calls.record(f"GET {self.path}")
        self.server.get(self)

    def do_POST(self) -> None:
        body = self._body()
        self.server.post(self, body)

    def do_DELETE(self) -> None:
        self._small(b"", 405)


class _FloodServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, size: int, calls: _Calls, answer: str, spare: tuple[str, ...]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.size = size
        self.calls = calls
        self.answer = answer
        self.spare = spare
        self.get: Callable[[_Handler], None] = self._refuse_get
        self.post: Callable[[_Handler, bytes], None] = self._mcp

    @staticmethod
    def _refuse_get(handler: _Handler) -> None:
        handler._small(b"", 405)

    def _mcp(self, handler: _Handler, body: bytes) -> None:
        try:
            message = json.loads(body)
        except ValueError:
            handler._small(_error(None, -32700, "not JSON"), 400)
            return
        answer = _answer(message, self.calls) if isinstance(message, dict) else None
        if answer is None:
            handler._small(b"", 202)
        elif isinstance(answer, bytes):
            handler._small(answer)
        else:
            self._flood(handler, message["id"])

    def _flood(self, handler: _Handler, request_id: Any) -> None:
        head, body, tail = _flood_result(request_id, self.size)
        if self.answer == "json":
            length = len(head) + self.size + len(tail)
            handler._send(200, "application/json", _joined(head, body, tail), length)
        elif self.answer == "gzip":
            gzipped = _gzipped(_joined(head, body, tail))
            handler._send(200, "application/json", gzipped, None, {"Content-Encoding": "gzip"})
        elif self.answer == "sse":
            event = _joined(b"event: message\ndata: " + head, body, tail + b"\n\n")
            handler._send(200, "text/event-stream", event, None)
        else:  # sse-comments: many small comment lines, then a small result
            result = _small(request_id, {"content": [{"type": "text", "text": "late"}]})
            last = b"event: message\ndata: " + result + b"\n\n"
            handler._send(
                200, "text/event-stream", _joined(b"", _comment_lines(self.size), last), None
            )

    def _service(self, handler: _Handler, body: bytes) -> None:
        self.calls.record(f"POST {handler.path}")
        self._service_answer(handler)

    def _service_get(self, handler: _Handler) -> None:
        self._service_answer(handler)

    def _service_answer(self, handler: _Handler) -> None:
        if any(handler.path.startswith(p) for p in self.spare):
            if handler.path.startswith("/v1/identity"):
                identity = {"service_id": "flood", "namespace": "orders-api", "revision": 1}
                handler._small(json.dumps(identity).encode())
            else:
                handler._small(b"{}", 404)
            return
        head = b'{"choices":[{"message":{"content":"'
        tail = b'"}}]}'
        length = len(head) + self.size + len(tail)
        handler._send(200, "application/json", _joined(head, _padding(self.size), tail), length)


def _joined(head: bytes, body: Iterator[bytes], tail: bytes) -> Iterator[bytes]:
    yield head
    yield from body
    yield tail


def _comment_lines(size: int) -> Iterator[bytes]:
    """About ``size`` bytes of SSE comment lines (1 KiB each), which a reader skips."""
    line = b": " + b"x" * 1021 + b"\n"
    block = line * 64
    for _ in range(max(size // len(block), 1)):
        yield block


def _gzipped(chunks: Iterator[bytes]) -> Iterator[bytes]:
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)  # 31: a gzip header and trailer
    for chunk in chunks:
        packed = packer.compress(chunk)
        if packed:
            yield packed
    yield packer.flush()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ratchet.testing.flood")
    parser.add_argument("kind", choices=["mcp-stdio", "mcp-http", "service"])
    parser.add_argument("--bytes", type=int, default=_DEFAULT_BYTES)
    parser.add_argument("--calls")
    parser.add_argument("--port-file")
    parser.add_argument("--answer", choices=["json", "sse", "sse-comments", "gzip"], default="json")
    parser.add_argument("--spare", action="append", default=[])
    args = parser.parse_args(argv)
    calls = _Calls(args.calls)
    if args.kind == "mcp-stdio":
        _serve_stdio(args.bytes, calls)
        return
    server = _FloodServer(args.bytes, calls, args.answer, tuple(args.spare))
    if args.kind == "service":
        server.post, server.get = server._service, server._service_get
    port_file = Path(args.port_file or "flood.port")
    partial = port_file.with_name(port_file.name + ".partial")
    partial.write_text(str(server.server_address[1]))
    partial.replace(port_file)  # whole or absent: a reader never sees half a number
    try:
        server.serve_forever()
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
