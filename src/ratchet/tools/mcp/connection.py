"""A synchronous connection to one MCP server (stdio or streamable HTTP), running the
``mcp`` package's async client on an event loop of its own in a background thread; every
call has a deadline (see the package docstring). The handshake is chosen by
:mod:`ratchet.tools.mcp.handshake`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version
from pathlib import Path
from typing import Any, TextIO, TypeVar
from urllib.parse import urlsplit

import anyio
import mcp_types
from mcp import Client, MCPError
from mcp_types import CONNECTION_CLOSED

from ratchet.errors import (
    AdapterError,
    ConfigurationError,
    FenceRejectedError,
    PeerAnswerTooLargeError,
)
from ratchet.limits import peer_cap
from ratchet.runtime.ports import Fence
from ratchet.tools.mcp.errtail import ErrTail
from ratchet.tools.mcp.handshake import (
    PROTOCOLS,
    first_mode,
    handshake_refusal,
    remember_modern,
)
from ratchet.tools.mcp.transports import AnswerWatch, _Http, _Stdio, watch_answers
from ratchet.tools.mcp.wire import (
    _REFUSED_CODES,
    EXTENSION_CAPABILITY,
    LOOKUP_TOOL,
    META_ERROR,
    RAISE_FENCE_TOOL,
    SEP3182_CAPABILITY,
    _joined_text,
    _kept,
    _marked,
    _marked_error,
    _what_failed,
    fence_payload,
)

log = logging.getLogger(__name__)


def _client_info() -> mcp_types.Implementation:
    try:
        found = _version("ratchet")
    except PackageNotFoundError:  # a source tree that is not installed
        found = "unknown"
    return mcp_types.Implementation(name="ratchet", version=found)


_CLIENT_INFO = _client_info()
_GRACE_S = 2.0  # the caller's wait beyond a call's own deadline
_CLOSE_S = 10.0  # how long close() waits for the transport to wind down
_MAX_PAGES = 100  # tools/list pages before a listing that never ends is refused
_EXCERPT = 200  # characters of a server's error text kept in an error message
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class RatchetExtensions:
    """The ratchet extensions a server advertised (``experimental.ratchet``)."""

    fences: bool = False
    lookup: bool = False


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.wait(pending, timeout=_CLOSE_S))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


class _CallToolParams(mcp_types.CallToolRequestParams):
    """``tools/call`` params with SEP-3182's ``idempotencyKey`` beside ``arguments``."""

    idempotency_key: str | None = None


class _CallToolRequest(mcp_types.CallToolRequest):
    params: _CallToolParams


class MCPConnection:
    """One MCP server, used synchronously. Make it with :meth:`stdio` or :meth:`http`;
    :meth:`start` connects (``mcp_tools`` does it when needed), :meth:`close` ends it.

    ``timeout_s`` bounds every call, ``connect_timeout_s`` the connection and the
    handshake. ``max_answer_bytes`` caps what one answer may carry (None: the process's
    cap, ``RATCHET_MAX_PEER_BYTES``, read when the connection starts); past it the call
    fails with :class:`~ratchet.errors.PeerAnswerTooLargeError` (see
    :mod:`ratchet.tools.mcp.transports`; over stdio the connection ends with it). Header and
    environment values are secrets: they appear in no repr, log line or error (a
    server's error text is scrubbed of them too).
    """

    def __init__(
        self,
        transport: _Stdio | _Http,
        *,
        timeout_s: float = 30.0,
        connect_timeout_s: float = 30.0,
        max_answer_bytes: int | None = None,
        protocol: str = "auto",
    ) -> None:
        if not (timeout_s > 0 and connect_timeout_s > 0):
            raise ConfigurationError("MCP timeouts must be positive", field="timeout_s")
        if max_answer_bytes is not None:
            peer_cap(max_answer_bytes)  # refused now, not at the first call
        self._max_answer_bytes = max_answer_bytes
        if protocol not in PROTOCOLS:
            raise ConfigurationError(
                "an MCP connection's protocol is 'auto' (the handshake no server logs an "
                "error for) or 'legacy' (the initialize handshake only)",
                field="protocol",
            )
        self._protocol = protocol
        self._fell_forward = False  # initialize was refused: server/discover was used
        self._errtail: ErrTail | None = None  # a stdio server's stderr, when ratchet keeps it
        self._listed: tuple[mcp_types.Tool, ...] | None = None  # the tools, once listed
        self._broken = False  # its server went away under a call: never reused
        self._limit = 0  # the cap in force, fixed when the connection starts
        self._cut: PeerAnswerTooLargeError | None = None  # the answer that ended it
        self._handshake = AnswerWatch()
        self._transport = transport
        self._timeout = float(timeout_s)
        self._connect_timeout = float(connect_timeout_s)
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._serving: concurrent.futures.Future[None] | None = None
        self._stop = asyncio.Event()
        self._client: Client | None = None
        self._capabilities: mcp_types.ServerCapabilities | None = None
        self._closed = False
        self._raised: set[tuple[Any, ...]] = set()

    @classmethod
    def stdio(
        cls,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        errlog: TextIO | None = None,
        timeout_s: float = 30.0,
        connect_timeout_s: float = 30.0,
        max_answer_bytes: int | None = None,
        protocol: str = "auto",
    ) -> MCPConnection:
        """A server ratchet starts: ``argv`` (program first), extra ``env`` (over a
        minimal default environment), ``cwd``; its stderr goes to ``errlog``.
        ``protocol``: ``"auto"`` starts with the initialize handshake and asks with
        ``server/discover`` only a server that refuses it
        (:mod:`ratchet.tools.mcp.handshake`);
        ``"legacy"`` is the initialize handshake only.

        Raises:
            ConfigurationError: an empty ``argv``, a bad timeout or cap.
        """
        if not argv or not argv[0]:
            raise ConfigurationError("an MCP stdio server needs a program to run", field="argv")
        # Without an errlog of the caller's, the server's stderr goes to the worker's log
        # line by line, and its last lines into the error of a server that cannot start.
        secrets = list((env or {}).values())
        tail = ErrTail(f"stdio {Path(argv[0]).name}", secrets) if errlog is None else None
        transport = _Stdio(
            argv=tuple(argv),
            env=dict(env) if env is not None else None,
            cwd=str(cwd) if cwd is not None else None,
            errlog=errlog if tail is None else tail.errlog,
        )
        made = cls(
            transport,
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
            max_answer_bytes=max_answer_bytes,
            protocol=protocol,
        )
        made._errtail = tail
        return made

    @classmethod
    def http(
        cls,
        url: str,
        *,
        headers: Mapping[str, str] | None = None,
        timeout_s: float = 30.0,
        connect_timeout_s: float = 30.0,
        max_answer_bytes: int | None = None,
    ) -> MCPConnection:
        """A server at ``url`` (streamable HTTP), sent ``headers`` on every request.

        Raises:
            ConfigurationError: not an http(s) URL, a bad timeout or cap.
        """
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigurationError("an MCP server URL must be http(s)://host/...", field="url")
        transport = _Http(url=url, headers=dict(headers or {}), connect_timeout_s=connect_timeout_s)
        return cls(
            transport,
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
            max_answer_bytes=max_answer_bytes,
        )

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("connected" if self._client else "idle")
        return f"MCPConnection({self._transport.label!r}, {state})"

    def __enter__(self) -> MCPConnection:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def scrub(self, text: str) -> str:
        """``text`` with every secret of this connection replaced by ``***``."""
        for secret in self._transport.secrets():
            if len(secret) >= 4:
                text = text.replace(secret, "***")
        return text

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> MCPConnection:
        """Connect and negotiate (once; later calls return at once).

        Raises:
            AdapterError: the server could not be started or reached, or did not finish
                the handshake in time (retryable=True); the connection was closed
                (retryable=False).
        """
        with self._lock:
            if self._closed:
                raise AdapterError("this MCP connection is closed", retryable=False)
            if self._loop is not None:
                return self
            self._limit = peer_cap(self._max_answer_bytes)
            loop = asyncio.new_event_loop()
            thread = threading.Thread(
                target=_run_loop, args=(loop,), name="ratchet-mcp", daemon=True
            )
            thread.start()
            ready: concurrent.futures.Future[None] = concurrent.futures.Future()
            self._loop, self._thread = loop, thread
            self._serving = asyncio.run_coroutine_threadsafe(self._serve(ready), loop)
        try:
            ready.result(self._connect_timeout + _GRACE_S)
            client = self.client
        except (Exception, asyncio.CancelledError) as exc:
            self.close()
            refused = self._refused(self._handshake)
            if refused is not None:
                raise refused from None
            said = self._errtail.tail() if self._errtail is not None else ""
            raise AdapterError(
                f"MCP server ({self._transport.label}) could not be connected "
                f"({_what_failed(exc)})" + (f"; it said: {self.scrub(said)}" if said else ""),
                retryable=True,
            ) from None
        except BaseException:
            self.close()
            raise
        if self._fell_forward and isinstance(self._transport, _Stdio):
            remember_modern(self._transport.identity)
        # Fixed for the connection's life, and readable after the server died.
        self._capabilities = client.server_capabilities
        log.info(
            "connected to MCP server %s (protocol %s)",
            self._transport.label,
            client.protocol_version,
        )
        return self

    async def _serve(self, ready: concurrent.futures.Future[None]) -> None:
        """The connection's life, in one task (the SDK's contexts must be entered and
        left in the same task): connect, handshake, wait for close(), wind down."""
        stdio = self._transport.identity if isinstance(self._transport, _Stdio) else None
        mode = first_mode(self._protocol, stdio)
        try:
            while True:
                try:
                    await self._session(mode, ready)
                    return
                except Exception as exc:
                    refused = handshake_refusal(exc)
                    # Timeline: initialize sent -> the server answered it with an error
                    # (nothing else was sent; its process is gone with the session) ->
                    # a new session asks with server/discover, once.
                    if ready.done() or refused is None or self._protocol != "auto":
                        raise
                    if mode != "legacy" or self._fell_forward:
                        raise
                    log.info(
                        "MCP server %s refused the initialize handshake (code %d); asking it "
                        "with server/discover",
                        self._transport.label,
                        refused.code,
                    )
                    self._fell_forward = True
                    mode = "auto"
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            elif isinstance(exc, Exception):
                log.warning(
                    "MCP server %s: the connection ended (%s)",
                    self._transport.label,
                    type(exc).__name__,
                )
            if not isinstance(exc, Exception):
                raise
        finally:
            self._client = None

    async def _session(self, mode: str, ready: concurrent.futures.Future[None]) -> None:
        """One session: open the transport, shake hands in ``mode``, serve until close()."""
        async with AsyncExitStack() as stack:
            watch_answers(self._handshake)  # the handshake is sent from this task
            transport = await self._transport.open(stack, self._limit, self._heard_cut)
            client = Client(
                transport,
                mode=mode,
                cache=None,
                read_timeout_seconds=self._timeout,
                client_info=_CLIENT_INFO,
            )
            await stack.enter_async_context(client)
            self._client = client
            ready.set_result(None)
            await self._stop.wait()

    def close(self) -> None:
        """Disconnect (a stdio server is stopped). Idempotent; waits a bounded time."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            loop, thread, serving = self._loop, self._thread, self._serving
        if loop is None or thread is None:
            if self._errtail is not None:
                self._errtail.close()
            return
        if serving is not None and self._client is not None:
            # Connected: let the serving task leave the SDK's contexts (a stdio server
            # is asked to exit, then killed) within a bound.
            loop.call_soon_threadsafe(self._stop.set)
            try:
                serving.result(_CLOSE_S)
            except BaseException as exc:
                log.debug("MCP server %s: close: %s", self._transport.label, type(exc).__name__)
        if serving is not None:
            serving.cancel()  # still connecting, or would not wind down
        # The loop cancels what is left and gives it a bounded time to unwind.
        loop.call_soon_threadsafe(loop.stop)
        thread.join(2 * _CLOSE_S)
        if self._errtail is not None:
            self._errtail.close()

    @property
    def alive(self) -> bool:
        """Whether the connection is up: started, not closed, and its server has not
        gone (the serving task is still running)."""
        serving = self._serving
        return (
            not self._closed
            and not self._broken
            and self._client is not None
            and serving is not None
            and not serving.done()
        )

    @property
    def client(self) -> Client:
        """The connected SDK client (for what this class does not wrap).

        Raises:
            AdapterError: not connected (retryable=True).
        """
        client = self._client
        if client is None or self._closed:
            raise AdapterError(
                f"MCP server ({self._transport.label}) is not connected", retryable=True
            )
        if self._cut is not None:
            raise AdapterError(
                f"MCP server ({self._transport.label}): the connection ended on an answer past "
                f"the cap of {self._limit} bytes",
                retryable=True,
            )
        return client

    def _heard_cut(self, refusal: PeerAnswerTooLargeError) -> None:
        """The transport stopped reading an answer at the cap (on its event loop)."""
        log.warning(
            "MCP server %s: an answer went past the cap of %d bytes; reading stopped",
            self._transport.label,
            self._limit,
        )
        if isinstance(self._transport, _Stdio):
            self._cut = refusal  # the session ended with it: every waiting call fails

    def _refused(self, watch: AnswerWatch) -> PeerAnswerTooLargeError | None:
        """The refusal of an answer a failed call was waiting for (a copy of its own), if
        the cap is why it failed."""
        found = watch.cut or self._cut
        if found is None:
            return None
        return PeerAnswerTooLargeError(
            found.message,
            peer=found.peer,
            limit_bytes=found.limit_bytes,
            seen_bytes=found.seen_bytes,
            encoding=found.encoding,
        )

    # -- what the server offers -------------------------------------------------------------

    @property
    def capabilities(self) -> mcp_types.ServerCapabilities:
        """What the server advertised when the connection started.

        Raises:
            AdapterError: never started (retryable=True).
        """
        if self._capabilities is None:
            raise AdapterError(
                f"MCP server ({self._transport.label}) is not connected", retryable=True
            )
        return self._capabilities

    @property
    def supports_idempotency_key(self) -> bool:
        """The server advertised SEP-3182 (experimental ``idempotencyKey``)."""
        return SEP3182_CAPABILITY in (self.capabilities.experimental or {})

    @property
    def extensions(self) -> RatchetExtensions:
        """The ratchet extensions the server advertised."""
        found = (self.capabilities.experimental or {}).get(EXTENSION_CAPABILITY) or {}
        return RatchetExtensions(
            fences=found.get("fences") is True, lookup=found.get("lookup") is True
        )

    # -- calls ------------------------------------------------------------------------------

    def _run(self, make: Callable[[Client], Awaitable[_T]], timeout: float, what: str) -> _T:
        """Run ``make(client)`` on the connection's loop, within ``timeout`` seconds.

        Raises:
            PeerAnswerTooLargeError: the answer went past the cap (reading stopped).
            MCPError: the server answered with a JSON-RPC error.
            AdapterError: no answer in time, or the transport failed (retryable=True).
        """
        client = self.client
        loop = self._loop
        if loop is None:
            raise AdapterError(
                f"MCP server ({self._transport.label}) is not connected", retryable=True
            )
        watch = AnswerWatch()

        async def bounded() -> _T:
            watch_answers(watch)  # this task sends the request: its answer is watched
            with anyio.fail_after(timeout):
                return await make(client)

        future = asyncio.run_coroutine_threadsafe(bounded(), loop)
        try:
            return future.result(timeout + _GRACE_S)
        except Exception as exc:
            # The transport records a refusal before the request fails with it.
            refused = self._refused(watch)
            if refused is not None:
                future.cancel()
                raise refused from None
            if isinstance(exc, TimeoutError):
                future.cancel()
                raise AdapterError(
                    f"MCP server ({self._transport.label}): {what} had no answer within "
                    f"{timeout:g}s",
                    retryable=True,
                ) from None
            if isinstance(exc, MCPError) and exc.code == CONNECTION_CLOSED:
                self._broken = True  # the server is gone: this connection is never reused
            if isinstance(exc, MCPError | AdapterError):
                raise
            self._broken = True  # the transport failed under the call
            raise AdapterError(
                f"MCP server ({self._transport.label}): {what} failed ({type(exc).__name__})",
                retryable=True,
            ) from None

    def probe(self, timeout_s: float = 5.0) -> bool:
        """Whether the server answers within ``timeout_s`` (the first page of
        ``tools/list``, which every server serves: ``ping`` is gone from the newest
        protocol). A connection that does not is marked broken: :attr:`alive` is then
        False."""

        async def probe(client: Client) -> None:
            await client.list_tools()

        try:
            self._run(probe, timeout_s, "probe")
        except (AdapterError, MCPError):
            self._broken = True
            return False
        return True

    def list_tools(self) -> list[mcp_types.Tool]:
        """Every tool the server lists (all pages), asked once per connection: a server's
        tools are taken as fixed for the connection's life (a new connection asks again).

        Raises:
            AdapterError: the listing failed or never ended (retryable=True).
        """
        listed = self._listed
        if listed is not None:
            return list(listed)

        async def walk(client: Client) -> list[mcp_types.Tool]:
            tools: list[mcp_types.Tool] = []
            cursor: str | None = None
            for _ in range(_MAX_PAGES):
                page = await client.list_tools(cursor=cursor)
                tools.extend(page.tools)
                cursor = page.next_cursor
                if cursor is None:
                    return tools
            raise AdapterError("tools/list did not end", retryable=True)

        try:
            tools = self._run(walk, self._timeout, "tools/list")
        except MCPError as exc:
            raise AdapterError(
                f"MCP server ({self._transport.label}): tools/list refused (code {exc.code})",
                retryable=True,
            ) from None
        self._listed = tuple(tools)
        return tools

    def call_tool(
        self,
        name: str,
        arguments: Mapping[str, Any],
        *,
        meta: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
        timeout_s: float | None = None,
    ) -> mcp_types.CallToolResult:
        """One ``tools/call``: ``idempotency_key`` goes beside ``arguments`` (SEP-3182),
        ``meta`` into the request's ``_meta``. The result is returned as the server sent
        it, ``isError`` included (the caller judges it).

        Raises:
            FenceRejectedError, IdempotencyConflictError: a JSON-RPC error so marked.
            AdapterError: a refused request (retryable=False), or an outcome unknown: a
                timeout, a lost connection, another server error (retryable=True).
        """
        request = _CallToolRequest.model_validate(
            {
                "method": "tools/call",
                "params": {
                    "name": name,
                    "arguments": dict(arguments),
                    "idempotencyKey": idempotency_key,
                    "_meta": dict(meta) if meta else None,
                },
            }
        )
        timeout = self._timeout if timeout_s is None else float(timeout_s)

        async def send(client: Client) -> mcp_types.CallToolResult:
            return await client.session.send_request(
                request, mcp_types.CallToolResult, request_read_timeout_seconds=timeout
            )

        try:
            return self._run(send, timeout, f"tools/call {name}")
        except MCPError as exc:
            raise self._rpc_error(name, exc) from None

    def _rpc_error(self, tool: str, exc: MCPError) -> AdapterError:
        data = exc.data
        marked = _marked(data.get(META_ERROR) if isinstance(data, dict) else None)
        text = self._excerpt(exc.message)
        if marked is not None:
            return _marked_error(marked, tool, text)
        if exc.code in _REFUSED_CODES:
            return AdapterError(
                f"tool {tool}: the MCP server refused the call (code {exc.code}): {text}",
                retryable=False,
                tool=tool,
            )
        return AdapterError(
            f"tool {tool}: the MCP server failed the call (code {exc.code}); its outcome is "
            "settled by recovery",
            retryable=True,
            tool=tool,
        )

    def _excerpt(self, text: str) -> str:
        return self.scrub(" ".join(text.split()))[:_EXCERPT]

    def tool_error(self, tool: str, result: mcp_types.CallToolResult) -> AdapterError:
        """What an ``isError`` result of ``tool`` means (see the module docstring)."""
        marked = _marked((result.meta or {}).get(META_ERROR))
        if marked is None and isinstance(result.structured_content, dict):
            marked = _marked(result.structured_content.get(META_ERROR))
        text = self._excerpt(_joined_text(result))
        if marked is not None:
            return _marked_error(marked, tool, text)
        return AdapterError(
            f"tool {tool}: the MCP server reported an error: {text}", retryable=False, tool=tool
        )

    # -- the ratchet extensions -------------------------------------------------------------

    def raise_fence(self, fence: Fence) -> None:
        """Raise ``fence`` at the server (``ratchet_raise_fence``); once per fence.

        Raises:
            FenceRejectedError: the server has seen a newer fence for the run.
            AdapterError: the server does not offer fences, or the call failed
                (retryable=True).
        """
        if not self.extensions.fences:
            raise AdapterError("this MCP server does not check fences", retryable=False)
        seen = (fence.run_id, fence.lease_version, fence.state_version, fence.store_epoch)
        with self._lock:
            if seen in self._raised:
                return
        result = self.call_tool(RAISE_FENCE_TOOL, fence_payload(fence))
        if result.is_error:
            refused = self.tool_error(RAISE_FENCE_TOOL, result)
            if isinstance(refused, FenceRejectedError):
                raise refused
            raise AdapterError(refused.message, retryable=True, tool=RAISE_FENCE_TOOL)
        with self._lock:
            self._raised.add(seen)

    def lookup(self, tool: str, key: str) -> Any | None:
        """The output stored for ``key`` (a call of ``tool``), or None: no such call.

        Raises:
            AdapterError: the server does not offer lookups, the lookup failed or its
                answer is malformed (retryable=True).
        """
        if not self.extensions.lookup:
            raise AdapterError("this MCP server offers no lookup", retryable=False)
        result = self.call_tool(LOOKUP_TOOL, {"key": key, "tool": tool})
        answer = result.structured_content
        if result.is_error or not isinstance(answer, dict):
            raise AdapterError(f"tool {tool}: the server's lookup failed", retryable=True)
        found = answer.get("found")
        if found is False:
            return None
        output = answer.get("output")
        if found is not True or output is None:
            # A found call always has an output (the client never keeps null): anything
            # else cannot be told from "not found", and guessing could send twice.
            raise AdapterError(f"tool {tool}: the server's lookup is malformed", retryable=True)
        return _kept(output)
