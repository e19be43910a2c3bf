"""ratchet: a runtime for long agent tasks on a fleet of workers, with signed checkpoints,
fenced leases and exactly-once external effects. See README.md and DESIGN notes in docs/.

The tool API is importable from here (``ratchet.tool``, ``ratchet.Tool``,
``ratchet.Toolbox``, ``ratchet.ToolCall``); it loads on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what a type checker sees; at run time __getattr__ loads them on first use
    from ratchet.tools import Tool, Toolbox, ToolCall, tool

__version__ = "0.2.0"

__all__ = ["Tool", "ToolCall", "Toolbox", "__version__", "tool"]

_TOOL_API = frozenset({"Tool", "ToolCall", "Toolbox", "tool"})


def __getattr__(name: str) -> Any:
    if name in _TOOL_API:
        from ratchet import tools  # noqa: PLC0415 - on first use: `import ratchet` stays light

        return getattr(tools, name)
    raise AttributeError(f"module 'ratchet' has no attribute {name!r}")
