"""The tools of the framework integrations: a declared ratchet tool that calls a
framework's tool function, and how that function reads the call it runs for."""

from __future__ import annotations

import asyncio
import contextvars
import inspect
from typing import Any

from ratchet.tools import FunctionTool, ToolCall

__all__ = ["JournaledTool", "complete", "current_call"]

_CURRENT: contextvars.ContextVar[ToolCall | None] = contextvars.ContextVar(
    "ratchet_integration_call", default=None
)


def current_call() -> ToolCall | None:
    """The ratchet call a tool function is running for (its idempotency key, fence,
    run), or None when the function runs outside ratchet (a plain framework run, a
    test)."""
    return _CURRENT.get()


class JournaledTool(FunctionTool[..., Any]):
    """A ratchet tool that runs a framework's tool function. While the function runs,
    :func:`current_call` returns the call; an ``async`` function is run to completion.
    ``lookup`` and ``fence`` are the decorators of :class:`ratchet.tools.FunctionTool`."""

    def run(self, args: Any, call: ToolCall) -> Any:
        token = _CURRENT.set(call)
        try:
            output = super().run(args, call)
            if inspect.isawaitable(output):
                output = complete(output)
            return output
        finally:
            _CURRENT.reset(token)


def complete(awaitable: Any) -> Any:
    """Run ``awaitable`` to completion on a loop of its own, closed after, leaving the
    thread's current event loop (if any) as it was."""

    async def wait() -> Any:
        return await awaitable

    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(wait())
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
