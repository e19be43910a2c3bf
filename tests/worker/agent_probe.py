"""An agent module that records being imported: a test that it must never load proves
nothing of a refused document was loaded (the marker file must stay absent)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from ratchet.agents import GreetingAgent

_MARKER = os.environ.get("RATCHET_PROBE_AGENT_MARKER")
if _MARKER:
    Path(_MARKER).write_text("imported\n")


def make(config: dict[str, Any]) -> GreetingAgent:
    return GreetingAgent.from_config(config)


class _Broken:
    plans_ahead = False

    def next_step(self, view: object) -> object:
        raise TypeError("this agent is broken")


def broken(config: dict[str, Any]) -> _Broken:
    """An agent whose every step raises (a poison run)."""
    return _Broken()


class _Reader:
    """Reads ``app.py`` step after step, thinking a little each time: a run a worker is
    busy stepping, for tests that act on a run while its lease is held."""

    plans_ahead = False

    def next_step(self, view: Any) -> Any:
        from ratchet.agents import AgentStep, make_action

        time.sleep(0.02)  # stands in for a model's latency
        return AgentStep(make_action(view, 0, "read_file", {"path": "app.py"}), {})


def reader(config: dict[str, Any]) -> _Reader:
    return _Reader()
