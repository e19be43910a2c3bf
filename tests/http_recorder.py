"""A real HTTP listener on loopback that records every request it gets (method, path,
headers) and answers each with 503: what a test points a URL at to prove that nothing,
or nothing carrying a secret, was sent there."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any


@dataclass(frozen=True, slots=True)
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class Recorder:
    """``with Recorder() as listener: ... listener.url ... listener.requests``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: list[Recorded] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def _record(self) -> None:
                size = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(min(size, 1 << 20)) if size else b""
                with recorder._lock:
                    recorder._requests.append(
                        Recorded(self.command, self.path, dict(self.headers.items()), body)
                    )
                self.send_response(503)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_GET(self) -> None:
                self._record()

            def do_POST(self) -> None:
                self._record()

            def do_PUT(self) -> None:
                self._record()

            def do_DELETE(self) -> None:
                self._record()

            def log_message(self, format: str, *args: Any) -> None:
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        """The listener's base URL (``http://127.0.0.1:PORT``)."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def requests(self) -> list[Recorded]:
        with self._lock:
            return list(self._requests)

    def carrying(self, secret: str) -> list[Recorded]:
        """The requests that carried ``secret`` anywhere: path, a header, the body."""
        return [
            r
            for r in self.requests
            if secret in r.path
            or any(secret in v for v in r.headers.values())
            or secret.encode() in r.body
        ]

    def __enter__(self) -> Recorder:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
