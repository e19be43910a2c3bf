"""The transports an MCP connection opens (stdio, streamable HTTP), with a byte cap on
every answer (DESIGN.md §9, :mod:`ratchet.limits`).

The ``mcp`` package's clients read an answer whole before anything looks at its size: the
stdio client joins a line's chunks until a newline comes (with mcp 2.3.0, a line of
100 MiB took about 500 MiB of the worker's memory, and two minutes), and the streamable
HTTP client reads a JSON body with ``Response.aread()``. Where the cap is enforced, while
the bytes stream in:

* **stdio**: :func:`bounded_stdio_client` is the SDK's ``stdio_client`` with a reader of
  its own: it counts each line's bytes as chunks arrive and, past the cap, stops reading
  and ends the session (a line cannot be skipped without knowing which request it
  answered, and a cut line leaves the stream at no message boundary). Every call then
  waiting fails; the connection says why (``on_cut``). Spawning the server and stopping
  it (the spec's shutdown sequence, bounded waits, the process tree) are the SDK's own
  functions, reused as they are.
* **streamable HTTP**: :class:`CappedTransport` wraps the ``httpx2`` transport the SDK's
  client sends through. It asks for an identity encoding (a compressed answer could not
  be bounded before it is inflated; one sent anyway is refused unread) and counts every
  response body's bytes: a JSON body, an event stream (all its events, not each one),
  an error body. Past the cap the body's stream raises an ``httpx2.StreamError``, which
  the SDK turns into a failed request (that request only: the connection lives on). The
  call it belonged to learns the typed error through a context variable: the SDK runs a
  request's HTTP exchange in the context of the task that sent it
  (``mcp.shared._context_streams``), so :func:`watch_answers` set by the caller is what
  the transport sees.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import logging
import sys
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TextIO
from urllib.parse import urlsplit

import anyio
import anyio.lowlevel
import httpx2
import mcp_types
from anyio.abc import ByteReceiveStream, ObjectSendStream
from mcp import StdioServerParameters
from mcp.client._transport import TransportStreams
from mcp.client.stdio import (
    _create_platform_compatible_process,
    _drain_stdout,
    _get_executable_command,
    _stop_server_process,
    get_default_environment,
)
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.message import SessionMessage

from ratchet.errors import PeerAnswerTooLargeError
from ratchet.limits import AnswerBudget

log = logging.getLogger(__name__)

# The SDK's bound on flushing accepted messages before stdin closes (its stdio_client's).
_WRITER_FLUSH_S = 0.5
_IDENTITY = frozenset({"", "identity"})


@dataclass(slots=True)
class AnswerWatch:
    """Where the transport leaves the refusal of an answer to one call."""

    cut: PeerAnswerTooLargeError | None = None


_WATCH: contextvars.ContextVar[AnswerWatch | None] = contextvars.ContextVar(
    "ratchet_mcp_answer_watch", default=None
)


def watch_answers(watch: AnswerWatch) -> None:
    """Leave the refusal of an answer to a request this task sends from now on in
    ``watch`` (call it in the task that sends them)."""
    _WATCH.set(watch)


# -- the transports a connection opens -------------------------------------------------------


@dataclass(frozen=True)
class _Stdio:
    argv: tuple[str, ...]
    env: Mapping[str, str] | None = field(default=None, repr=False)
    cwd: str | None = None
    errlog: TextIO | None = field(default=None, repr=False)

    @property
    def label(self) -> str:
        return f"stdio {Path(self.argv[0]).name}"

    @property
    def identity(self) -> str:
        """A digest of the server's configuration (program, arguments, environment,
        folder): the same server started again has the same one; secrets stay out."""
        made = json.dumps([self.argv, sorted((self.env or {}).items()), self.cwd])
        return hashlib.sha256(made.encode()).hexdigest()

    def secrets(self) -> list[str]:
        return list((self.env or {}).values())

    async def open(
        self, stack: AsyncExitStack, limit: int, on_cut: Callable[[PeerAnswerTooLargeError], None]
    ) -> AbstractAsyncContextManager[Any]:
        params = StdioServerParameters(
            command=self.argv[0],
            args=list(self.argv[1:]),
            env=dict(self.env) if self.env else None,
            cwd=self.cwd,
        )
        return bounded_stdio_client(
            params,
            peer=f"MCP server ({self.label})",
            limit=limit,
            on_cut=on_cut,
            errlog=self.errlog or sys.stderr,
        )


@dataclass(frozen=True)
class _Http:
    url: str = field(repr=False)
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)
    connect_timeout_s: float = 30.0

    @property
    def label(self) -> str:
        # No userinfo, query or fragment: any of them may carry a credential.
        parts = urlsplit(self.url)
        port = f":{parts.port}" if parts.port else ""
        return f"{parts.scheme}://{parts.hostname}{port}{parts.path}"

    def secrets(self) -> list[str]:
        parts = urlsplit(self.url)
        found = [v for v in self.headers.values()]
        return found + [s for s in (parts.password, parts.query) if s]

    async def open(
        self, stack: AsyncExitStack, limit: int, on_cut: Callable[[PeerAnswerTooLargeError], None]
    ) -> AbstractAsyncContextManager[Any]:
        # Every response body is counted against the cap as it streams in
        # (CappedTransport); the SDK's own per-event bound is set to the same.
        capped = CappedTransport(
            httpx2.AsyncHTTPTransport(),
            peer=f"MCP server ({self.label})",
            limit=limit,
            on_cut=on_cut,
        )
        client = httpx2.AsyncClient(
            headers=dict(self.headers),
            timeout=httpx2.Timeout(self.connect_timeout_s, read=300.0),
            transport=capped,
        )
        await stack.enter_async_context(client)
        return streamable_http_client(self.url, http_client=client, max_sse_event_size=limit)


# -- streamable HTTP ------------------------------------------------------------------------


class _AnswerCut(httpx2.StreamError):
    """A response body stopped at the cap (the SDK fails that request on a StreamError)."""


class _CappedStream(httpx2.AsyncByteStream):
    def __init__(
        self,
        inner: httpx2.AsyncByteStream,
        budget: AnswerBudget,
        on_cut: Callable[[PeerAnswerTooLargeError], None],
        encoding: str | None,
    ) -> None:
        self._inner = inner
        self._budget = budget
        self._on_cut = on_cut
        self._encoding = encoding

    def _cut(self, refusal: PeerAnswerTooLargeError) -> NoReturn:
        watch = _WATCH.get()
        if watch is not None and watch.cut is None:
            watch.cut = refusal
        self._on_cut(refusal)
        raise _AnswerCut(refusal.message)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self._encoding is not None:
            self._cut(self._budget.refusal(encoding=self._encoding))
        async for chunk in self._inner:
            try:
                self._budget.take(len(chunk))
            except PeerAnswerTooLargeError as refusal:
                self._cut(refusal)
            yield chunk

    async def aclose(self) -> None:
        # An unread rest makes httpcore drop the connection rather than reuse it.
        await self._inner.aclose()


class CappedTransport(httpx2.AsyncBaseTransport):
    """``inner`` with every response body counted against ``limit`` bytes (see the module
    docstring); ``peer`` names the server in the error, ``on_cut`` hears every refusal."""

    def __init__(
        self,
        inner: httpx2.AsyncBaseTransport,
        *,
        peer: str,
        limit: int,
        on_cut: Callable[[PeerAnswerTooLargeError], None],
    ) -> None:
        self._inner = inner
        self._peer = peer
        self._limit = limit
        self._on_cut = on_cut

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        request.headers["Accept-Encoding"] = "identity"
        response = await self._inner.handle_async_request(request)
        encoding = response.headers.get("Content-Encoding", "").strip().lower()
        stream = response.stream
        if not isinstance(stream, httpx2.AsyncByteStream):  # an async transport's always is
            raise TypeError("an async transport answered with a sync stream")
        capped = _CappedStream(
            stream,
            AnswerBudget(self._peer, self._limit),
            self._on_cut,
            None if encoding in _IDENTITY else encoding,
        )
        return httpx2.Response(
            status_code=response.status_code,
            headers=response.headers,
            stream=capped,
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        await self._inner.aclose()


# -- stdio ----------------------------------------------------------------------------------


def _message(line: bytes) -> SessionMessage | Exception:
    """One stdout line as a message, or the parse error as a value for the session (what
    the SDK's reader does); bytes are parsed as UTF-8 by pydantic, never decoded first."""
    try:
        return SessionMessage(mcp_types.jsonrpc_message_adapter.validate_json(line, by_name=False))
    except ValueError as exc:
        log.warning("MCP server sent a line that is not a JSON-RPC message")
        return exc


@asynccontextmanager
async def bounded_stdio_client(
    server: StdioServerParameters,
    *,
    peer: str,
    limit: int,
    on_cut: Callable[[PeerAnswerTooLargeError], None],
    errlog: TextIO = sys.stderr,
) -> AsyncGenerator[TransportStreams, None]:
    """The SDK's ``stdio_client`` (same spawn, same shutdown) reading at most ``limit``
    bytes of any line; past it the session ends and ``on_cut`` hears why.

    Raises:
        OSError: the server could not be spawned.
    """
    command = await _get_executable_command(server.command)
    process = await _create_platform_compatible_process(
        command=command,
        args=server.args,
        env=get_default_environment() | (server.env or {}),
        errlog=errlog,
        cwd=server.cwd,
    )
    # No await between the spawn and the task group (the SDK's rule): a cancellation there
    # would leak the live process.
    read_writer, read_stream = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write_stream, write_reader = anyio.create_memory_object_stream[SessionMessage](0)
    shutting_down = False
    writer_done = anyio.Event()

    async def stdout_reader() -> None:
        stdout = process.stdout
        if stdout is None:  # spawned with pipes: never
            return
        cut = False
        try:
            async with read_writer:
                try:
                    await _read_lines(stdout, AnswerBudget(peer, limit), read_writer)
                except PeerAnswerTooLargeError as refusal:
                    # Stop here: closing the read stream ends the session, so every call
                    # waiting fails now; the server is stopped when the connection closes.
                    cut = True
                    on_cut(refusal)
                finally:
                    if not cut:
                        await _drain_stdout(process)
        except anyio.ClosedResourceError:
            pass  # our own shutdown closed stdout under the read
        except (anyio.BrokenResourceError, ConnectionError):
            if not shutting_down:
                log.warning("reading the MCP server's stdout failed mid-session")

    async def stdin_writer() -> None:
        stdin = process.stdin
        try:
            async with write_reader:
                async for message in write_reader:
                    text = message.message.model_dump_json(by_alias=True, exclude_unset=True)
                    if stdin is not None:
                        await stdin.send((text + "\n").encode())
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            # The server may still be alive: end the session rather than leave a request
            # waiting forever.
            await read_writer.aclose()
        finally:
            writer_done.set()

    async def shutdown() -> None:
        read_stream.close()
        write_stream.close()
        with anyio.move_on_after(_WRITER_FLUSH_S):
            await writer_done.wait()
        await _stop_server_process(process)
        for stream in (read_stream, write_stream, read_writer, write_reader):
            await stream.aclose()
        await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(stdout_reader)
        tg.start_soon(stdin_writer)
        try:
            yield read_stream, write_stream
        finally:
            shutting_down = True
            with anyio.CancelScope(shield=True):
                await shutdown()
            tg.cancel_scope.cancel()
    await anyio.lowlevel.cancel_shielded_checkpoint()


async def _read_lines(
    stdout: ByteReceiveStream,
    budget: AnswerBudget,
    deliver: ObjectSendStream[SessionMessage | Exception],
) -> None:
    """Deliver each line of ``stdout`` as a message, counting each line's bytes against a
    fresh copy of ``budget`` as they arrive; returns at the end of the stream or when
    the session is gone.

    Raises:
        PeerAnswerTooLargeError: a line went past the cap (nothing more is read).
    """
    pending = bytearray()
    while True:
        try:
            chunk = await stdout.receive()
        except anyio.EndOfStream:
            return
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            budget.take(end - start)
            if pending:
                pending += chunk[start:end]
                line = bytes(pending)
                pending.clear()
            else:
                line = chunk[start:end]
            start = end + 1
            budget = AnswerBudget(budget.peer, budget.limit)
            if not line or line.isspace():
                continue
            try:
                await deliver.send(_message(line))
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                return  # the session is gone
        budget.take(len(chunk) - start)
        pending += chunk[start:]
