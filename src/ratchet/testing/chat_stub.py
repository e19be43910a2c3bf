"""A local stand-in for an OpenAI-compatible chat server (tests, demos).

:class:`ChatStub` serves ``POST /v1/chat/completions`` on a free loopback port from a
thread (the standard library's HTTP server), answering with canned replies in order (or
from a function of the request body), and records every request it got. It can be told
to fail the next requests (500, 429 with ``Retry-After``), and, given an expected API
key, refuses any other ``Authorization`` header with 401 the way OpenAI does: quoting the
key it was sent, which is what a client must never copy into its own errors. ``usage``
(prompt and completion tokens) is what every completion reports (none: zeros).

    with ChatStub([{"tool_calls": [{"id": "c1", "name": "read_file",
                                    "arguments": '{"path": "app.py"}'}]},
                   {"content": "done"}], api_key="sk-test") as stub:
        model = OpenAIChatModel(stub.base_url, "stub", api_key=SecretStr("sk-test"))
        ...
        stub.requests[0].body["tools"]   # what the model was offered
"""

from __future__ import annotations

import hmac
import json
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

from ratchet.agents.models import ModelReply

__all__ = ["ChatStub", "StubRequest"]

StubReplies = Sequence[ModelReply | Mapping[str, Any]] | Callable[[dict[str, Any]], Any]


@dataclass(frozen=True, slots=True)
class StubRequest:
    """One request the stub got: its path, its JSON body (None when it was not JSON) and
    whether its ``Authorization`` header was the expected one (None: none expected). The
    header itself is not kept."""

    path: str
    body: dict[str, Any] | None
    authorized: bool | None
    status: int = 0


@dataclass
class _Failures:
    count: int = 0
    status: int = 500
    retry_after: int | None = None


@dataclass
class _Book:
    requests: list[StubRequest] = field(default_factory=list)
    served: int = 0
    failures: _Failures = field(default_factory=_Failures)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _completion(
    reply: ModelReply, model: str, number: int, usage: tuple[int, int]
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        message["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in reply.tool_calls
        ]
    return {
        "id": f"chatcmpl-stub-{number}",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": "tool_calls" if reply.tool_calls else "stop",
            }
        ],
        "usage": {
            "prompt_tokens": usage[0],
            "completion_tokens": usage[1],
            "total_tokens": usage[0] + usage[1],
        },
    }


class ChatStub:
    """The stub server (see the module docstring). Start it with :meth:`start` or as a
    context manager; :attr:`base_url` is what a client is given (``.../v1``)."""

    def __init__(
        self,
        replies: StubReplies = (),
        *,
        api_key: str | None = None,
        usage: tuple[int, int] = (0, 0),
    ) -> None:
        self._function: Callable[[dict[str, Any]], Any] | None = None
        self._replies: list[ModelReply] = []
        if callable(replies):
            self._function = replies
        else:
            self._replies = [
                r if isinstance(r, ModelReply) else ModelReply.model_validate(r) for r in replies
            ]
        self._api_key = api_key
        self._usage = usage
        self._book = _Book()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"ChatStub(port={self.port}, served={self._book.served})"

    # -- control --------------------------------------------------------------------------

    @property
    def port(self) -> int:
        return 0 if self._server is None else int(self._server.server_address[1])

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def requests(self) -> list[StubRequest]:
        """Every request so far, oldest first (a copy)."""
        with self._book.lock:
            return list(self._book.requests)

    @property
    def served(self) -> int:
        """How many canned replies were served."""
        return self._book.served

    def add_replies(self, *replies: ModelReply | Mapping[str, Any]) -> None:
        """Append replies to the list (served after the ones already there)."""
        with self._book.lock:
            self._replies += [
                r if isinstance(r, ModelReply) else ModelReply.model_validate(r) for r in replies
            ]

    def fail_next(self, count: int, *, status: int = 500, retry_after: int | None = None) -> None:
        """Answer the next ``count`` requests with ``status`` (and ``Retry-After``)."""
        with self._book.lock:
            self._book.failures = _Failures(count, status, retry_after)

    def start(self) -> ChatStub:
        if self._server is not None:
            return self
        server = _Server(("127.0.0.1", 0), _handler(self))
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, name="chat-stub", kwargs={"poll_interval": 0.05}
        )
        self._thread.daemon = True
        self._thread.start()
        return self

    def close(self) -> None:
        server, thread = self._server, self._thread
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout=10)
        self._server = self._thread = None

    def __enter__(self) -> ChatStub:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- answering (called on the server's threads) ------------------------------------------

    def _authorized(self, header: str | None) -> bool | None:
        if self._api_key is None:
            return None
        expected = f"Bearer {self._api_key}".encode()
        return header is not None and hmac.compare_digest(header.encode(), expected)

    def _answer(
        self, path: str, raw: bytes, authorization: str | None
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = None
        body = parsed if isinstance(parsed, dict) else None
        authorized = self._authorized(authorization)
        status, payload, headers = self._decide(path, body, authorized, authorization)
        with self._book.lock:
            self._book.requests.append(StubRequest(path, body, authorized, status))
        return status, payload, headers

    def _decide(
        self,
        path: str,
        body: dict[str, Any] | None,
        authorized: bool | None,
        authorization: str | None,
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        if path.rstrip("/") not in ("/v1/chat/completions", "/chat/completions"):
            return 404, {"error": {"message": "not found", "code": "not_found"}}, {}
        if authorized is False:
            given = (authorization or "").removeprefix("Bearer ")
            message = f"Incorrect API key provided: {given}"
            return 401, {"error": {"message": message, "code": "invalid_api_key"}}, {}
        with self._book.lock:
            failures = self._book.failures
            if failures.count > 0:
                failures.count -= 1
                headers = {}
                if failures.retry_after is not None:
                    headers["Retry-After"] = str(failures.retry_after)
                error = {"message": "the stub was told to fail", "code": "stub_failure"}
                return failures.status, {"error": error}, headers
        if body is None or not isinstance(body.get("messages"), list):
            return 400, {"error": {"message": "a chat request needs messages"}}, {}
        served = self._next_reply(body)
        if served is None:
            error = {"message": "the stub has no reply left", "code": "stub_exhausted"}
            return 400, {"error": error}, {}
        reply, number = served
        return 200, _completion(reply, str(body.get("model", "stub")), number, self._usage), {}

    def _next_reply(self, body: dict[str, Any]) -> tuple[ModelReply, int] | None:
        """The next reply and its number (1 for the first), or None: none left."""
        made: ModelReply | None = None
        if self._function is not None:
            value = self._function(body)
            made = value if isinstance(value, ModelReply) else ModelReply.model_validate(value)
        with self._book.lock:
            if made is None:
                if self._book.served >= len(self._replies):
                    return None
                made = self._replies[self._book.served]
            self._book.served += 1
            return made, self._book.served


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that gave up on a request (its timeout) closed the connection the
        # answer goes to: that is the client's doing, not an error of the stub's.
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


def _handler(stub: ChatStub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            status, payload, headers = stub._answer(
                self.path, raw, self.headers.get("Authorization")
            )
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            return  # quiet: the stub's record is stub.requests

    return Handler
