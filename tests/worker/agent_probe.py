"""An agent module that records being imported: a test that it must never load proves
nothing of a refused document was loaded (the marker file must stay absent)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ratchet.worker.agents import GreetingAgent

_MARKER = os.environ.get("RATCHET_PROBE_AGENT_MARKER")
if _MARKER:
    Path(_MARKER).write_text("imported\n")


def make(config: dict[str, Any]) -> GreetingAgent:
    return GreetingAgent.from_config(config)
