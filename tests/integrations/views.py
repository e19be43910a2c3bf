"""What an integration's agent is shown before a step, built by hand for its unit tests."""

from __future__ import annotations

from typing import Any

from ratchet.agents import AgentView
from ratchet.runtime import Observation, Phase, TraceOutcome
from ratchet.runtime.catalog import ToolSpec
from ratchet.runtime.state import Usage


def view(
    tools: tuple[ToolSpec, ...],
    agent_state: dict[str, Any] | None = None,
    *,
    proposals: int = 0,
    outcome: TraceOutcome = TraceOutcome.STARTED,
    executed: frozenset[str] = frozenset(),
    last_read: str | None = None,
    verified: bool = False,
) -> AgentView:
    """A running run's view at environment version 3 after ``proposals`` proposals."""
    return AgentView(
        run_id="run-1",
        phase=Phase.RUNNING,
        observation=Observation(instance_id="ws-1", version=3, fingerprint="0" * 64),
        plan_cursor=0,
        usage=Usage(proposals=proposals, steps=proposals),
        last_outcome=outcome,
        quarantined_keys=(),
        agent_state=agent_state or {},
        now=1_000,
        executed_keys=executed,
        verified=verified,
        last_read=last_read,
        tools=tools,
    )
