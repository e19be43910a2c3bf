"""A TCP proxy that partitions and delays a link, one direction at a time.

A drill puts one :class:`FaultProxy` between a worker and Redis (or between a worker and
the orders service) and cuts it while the worker's other links stay up: the worker ↔
Redis partition the failure model admits, with the adapters still reachable, and the
reverse.

What a cut is. A partitioned network does not reset connections and does not lose bytes
of a stream: TCP retransmits what was not acknowledged, so the peer sees a stall, then
(if the partition heals before either side gives up) the same bytes in the same order.
The proxy models exactly that: a cut direction stops forwarding; the bytes already read
wait, in order, and everything behind them waits in the kernel's buffers (the sender's
writes block once they are full, as they would). :meth:`FaultProxy.heal` lets them
through. A client that gives up first (a socket timeout) closes its side and sees an
error, as it would on a real network; :meth:`FaultProxy.sever` resets every connection
(a link that died rather than stalled).

New connections made during a cut are accepted (the proxy listens on loopback) but
nothing flows through them until it heals: to the client that is a connect that never
completes its first exchange, which is what a lost SYN looks like after its timeout.

``delay`` holds every chunk in a direction for that long before forwarding it (a slow
link, in order). Each direction of each connection is pumped by its own task on one
event loop in a background thread; the controls are thread-safe and in force when they
return. Counters (bytes forwarded per direction, connections) let a drill prove a fault
fired.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Self, TypeVar

from ratchet.errors import ConfigurationError

__all__ = ["Direction", "FaultProxy", "LinkCounters"]

_T = TypeVar("_T")
_CHUNK = 1 << 16
_CONTROL_TIMEOUT_S = 10.0


class Direction(StrEnum):
    """``up``: client to target (requests); ``down``: target to client (replies)."""

    UP = "up"
    DOWN = "down"


BOTH = (Direction.UP, Direction.DOWN)


@dataclass(frozen=True, slots=True)
class LinkCounters:
    """What went through the proxy so far."""

    connections: int
    bytes_up: int
    bytes_down: int
    severed: int


class FaultProxy:
    """Forwards loopback TCP connections to ``target`` with faults on demand.

    ``start()`` binds ``listen`` (port 0: any free port; :attr:`port` says which) and
    returns the proxy; ``stop()`` closes everything. Usable as a context manager.

    Raises (``start``):
        ConfigurationError: the listening address cannot be bound.
    """

    def __init__(
        self, target: tuple[str, int], *, listen: tuple[str, int] = ("127.0.0.1", 0)
    ) -> None:
        self.target = target
        self._listen = listen
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._open: dict[Direction, asyncio.Event] = {}
        self._delay_s: dict[Direction, float] = dict.fromkeys(BOTH, 0.0)
        self._writers: set[asyncio.StreamWriter] = set()
        self._bytes: dict[Direction, int] = dict.fromkeys(BOTH, 0)
        self._connections = 0
        self._severed = 0
        self.port = 0

    def __repr__(self) -> str:
        host, port = self.target
        return f"FaultProxy(127.0.0.1:{self.port} -> {host}:{port}, {self.state()})"

    # -- life -------------------------------------------------------------------------

    def start(self) -> Self:
        if self._loop is not None:
            return self
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._serve, args=(loop, ready), name="fault-proxy", daemon=True
        )
        self._loop = loop
        self._thread.start()
        ready.wait(_CONTROL_TIMEOUT_S)
        try:
            self._server = self._call(self._bind())
        except OSError as exc:
            self.stop()
            raise ConfigurationError(
                f"fault proxy cannot listen on {self._listen[0]}:{self._listen[1]} "
                f"({type(exc).__name__})",
                field="listen",
            ) from None
        sockets = self._server.sockets
        self.port = int(sockets[0].getsockname()[1]) if sockets else 0
        return self

    def _serve(self, loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
        asyncio.set_event_loop(loop)
        self._open = {d: asyncio.Event() for d in BOTH}
        for event in self._open.values():
            event.set()
        loop.call_soon(ready.set)
        loop.run_forever()
        loop.close()

    async def _bind(self) -> asyncio.Server:
        host, port = self._listen
        return await asyncio.start_server(self._accept, host, port)

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        with contextlib.suppress(Exception):
            self._call(self._close_all())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(_CONTROL_TIMEOUT_S)
        self._loop = self._thread = self._server = None

    async def _close_all(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._sever_all()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    # -- controls (thread-safe; in force when they return) ----------------------------

    def partition(self, *directions: Direction) -> None:
        """Stop forwarding in ``directions`` (both when none are named)."""
        self._loop_or_raise()
        for d in directions or BOTH:
            self._run(self._open[d].clear)

    def heal(self, *directions: Direction) -> None:
        """Forward again in ``directions`` (both when none are named): what waited goes
        through first, in order."""
        self._loop_or_raise()
        for d in directions or BOTH:
            self._run(self._open[d].set)

    def delay(self, ms: float, *directions: Direction) -> None:
        """Hold each chunk ``ms`` milliseconds before forwarding it (0: no delay)."""
        if ms < 0:
            raise ConfigurationError("a delay cannot be negative", field="ms")
        for d in directions or BOTH:
            self._delay_s[d] = ms / 1000

    def sever(self) -> int:
        """Reset every open connection (a link that died, not one that stalled); new
        connections are still accepted. Returns how many were severed."""
        return self._call(self._sever_all())

    async def _sever_all(self) -> int:
        writers, self._writers = list(self._writers), set()
        for w in writers:
            transport = w.transport
            sock = transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    # SO_LINGER 0: close sends a reset, not an orderly end of stream.
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()
        self._severed += len(writers)
        return len(writers)

    def state(self) -> str:
        """``up``/``cut`` per direction, and delays, as one short text."""
        parts = []
        for d in BOTH:
            event = self._open.get(d)
            cut = event is not None and not event.is_set()
            delay = self._delay_s[d]
            parts.append(
                f"{d.value}={'cut' if cut else 'open'}" + (f"+{delay:g}s" if delay else "")
            )
        return " ".join(parts)

    def counters(self) -> LinkCounters:
        return LinkCounters(
            self._connections, self._bytes[Direction.UP], self._bytes[Direction.DOWN], self._severed
        )

    # -- plumbing ---------------------------------------------------------------------

    def _loop_or_raise(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise ConfigurationError("the fault proxy is not started", field="proxy")
        return self._loop

    def _call(self, coro: Coroutine[Any, Any, _T]) -> _T:
        loop = self._loop_or_raise()
        return asyncio.run_coroutine_threadsafe(coro, loop).result(_CONTROL_TIMEOUT_S)

    def _run(self, fn: Callable[[], None]) -> None:
        async def call() -> None:
            fn()

        self._call(call())

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections += 1
        self._writers.add(writer)
        host, port = self.target
        try:
            up_reader, up_writer = await asyncio.open_connection(host, port)
        except OSError:
            self._writers.discard(writer)
            writer.close()
            return
        self._writers.add(up_writer)
        pumps = [
            asyncio.create_task(self._pump(reader, up_writer, Direction.UP)),
            asyncio.create_task(self._pump(up_reader, writer, Direction.DOWN)),
        ]
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for task in pumps:
            task.cancel()
        for w in (writer, up_writer):
            self._writers.discard(w)
            with contextlib.suppress(Exception):
                w.close()

    async def _pump(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, direction: Direction
    ) -> None:
        gate = self._open[direction]
        with contextlib.suppress(OSError, asyncio.IncompleteReadError, ConnectionError):
            while True:
                chunk = await src.read(_CHUNK)
                if not chunk:
                    return
                await gate.wait()
                delay = self._delay_s[direction]
                if delay:
                    await asyncio.sleep(delay)
                    await gate.wait()  # cut while it was held: it waits for the heal
                dst.write(chunk)
                await dst.drain()
                self._bytes[direction] += len(chunk)
