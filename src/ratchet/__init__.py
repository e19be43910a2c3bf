"""ratchet: a runtime for long agent tasks on a fleet of workers, with signed checkpoints,
fenced leases and exactly-once external effects. See README.md and DESIGN notes in docs/.

The names a user writes every day are importable from here, and nothing more:

* declaring tools: ``ratchet.tool``, ``ratchet.Tool``, ``ratchet.ToolCall``,
  ``ratchet.Toolbox`` and the risk labels, ``ratchet.Risk`` (:mod:`ratchet.tools`);
* writing an agent: the protocol ``ratchet.Agent``, what it is shown
  (``ratchet.AgentView``) and what it returns (``ratchet.AgentStep``)
  (:mod:`ratchet.agents`);
* writing an environment adapter: the protocol ``ratchet.Adapter``; the types its
  methods take and return are in :mod:`ratchet.runtime`.

Each loads on first use, so ``import ratchet`` stays light (a command that needs none of
them does not import pydantic models, Redis or an agent's dependencies for them).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what a type checker sees; at run time __getattr__ loads them on first use
    from ratchet.agents import Agent, AgentStep, AgentView
    from ratchet.runtime.actions import Risk
    from ratchet.runtime.ports import Adapter
    from ratchet.tools import Tool, Toolbox, ToolCall, tool

__version__ = "0.2.0"

__all__ = [
    "Adapter",
    "Agent",
    "AgentStep",
    "AgentView",
    "Risk",
    "Tool",
    "ToolCall",
    "Toolbox",
    "__version__",
    "tool",
]

#: Where each name lives: the module that defines it, or its package's public surface.
_LAZY = {
    "Adapter": "ratchet.runtime.ports",
    "Agent": "ratchet.agents",
    "AgentStep": "ratchet.agents",
    "AgentView": "ratchet.agents",
    "Risk": "ratchet.runtime.actions",
    "Tool": "ratchet.tools",
    "ToolCall": "ratchet.tools",
    "Toolbox": "ratchet.tools",
    "tool": "ratchet.tools",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        # On first use: `import ratchet` stays light.
        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module 'ratchet' has no attribute {name!r}")
