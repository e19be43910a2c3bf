"""A stdio MCP server's stderr: forwarded to the worker's log line by line and its last
lines kept, so a server that cannot start is reported with what it said (one line,
scrubbed of the connection's secrets), never with a bare exception type."""

from __future__ import annotations

import collections
import logging
import os
import threading
from typing import BinaryIO, TextIO

__all__ = ["ErrTail"]

log = logging.getLogger("ratchet.tools.mcp.stderr")

#: Lines kept for an error message, and the most characters kept of one line.
_KEPT_LINES = 8
_LINE_CHARS = 300
#: The most one read takes (a line longer than this is cut, never buffered whole).
_READ = 4096


class ErrTail:
    """A pipe whose write end is the server's stderr (:attr:`errlog`); a daemon thread
    reads it, logs each line at INFO on ``ratchet.tools.mcp.stderr`` (prefixed with the
    server's label, every one of ``secrets`` replaced by ``***``) and keeps the last few.
    :meth:`close` closes the write end; the thread ends when the server's copy closes
    too."""

    def __init__(self, label: str, secrets: list[str] | None = None) -> None:
        read_fd, write_fd = os.pipe()
        self._label = label
        self._secrets = [s for s in (secrets or []) if len(s) >= 4]
        self._reader: BinaryIO = os.fdopen(read_fd, "rb", buffering=0)
        self.errlog: TextIO = os.fdopen(write_fd, "w", encoding="utf-8", errors="replace")
        self._lines: collections.deque[str] = collections.deque(maxlen=_KEPT_LINES)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._pump, name="ratchet-mcp-stderr", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        pending = b""
        try:
            while True:
                chunk = self._reader.read(_READ)
                if not chunk:
                    break
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    self._keep(line)
                if len(pending) > _READ:  # a line that never ends: cut, not buffered
                    self._keep(pending)
                    pending = b""
            if pending:
                self._keep(pending)
        except OSError:
            return
        finally:
            self._reader.close()

    def _keep(self, raw: bytes) -> None:
        text = raw.decode("utf-8", "replace").rstrip("\r")
        for secret in self._secrets:
            text = text.replace(secret, "***")
        text = text[:_LINE_CHARS]
        if not text.strip():
            return
        with self._lock:
            self._lines.append(text)
        log.info("MCP server (%s): %s", self._label, text)

    def tail(self, *, wait_s: float = 0.5) -> str:
        """The last lines the server wrote, joined on one line (``" | "``); waits up to
        ``wait_s`` for the reader to drain what a server that just exited left."""
        self._thread.join(wait_s)
        with self._lock:
            return " | ".join(self._lines)

    def close(self) -> None:
        """Close this process's write end (the server's own copy closes as it exits)."""
        if not self.errlog.closed:
            self.errlog.close()
