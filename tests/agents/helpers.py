"""Shared pieces for the agent tests: what a worker shows an agent, a loop that steps a
run with an agent the way a job does, and small builders of model replies."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ratchet.agents import Agent, AgentView
from ratchet.agents.models import ModelReply, ToolCallRequest
from ratchet.runtime import Phase, RunEngine, StepResult
from ratchet.runtime.catalog import BUILTIN_TOOLS, ToolCatalog, ToolSpec
from ratchet.worker.jobprotocol import agent_view

SYSTEM_PROMPT = "You fix the greeting in app.py, run the unit tests, then finish."


def permitted_tools(engine: RunEngine, catalog: ToolCatalog | None = None) -> tuple[ToolSpec, ...]:
    """The scenario's permitted tools with their contracts, as a worker fills them in."""
    return tuple((catalog or ToolCatalog()).permitted(engine.scenario))


def view_of(
    engine: RunEngine, *, last_read: str | None = None, catalog: ToolCatalog | None = None
) -> AgentView:
    """The view a worker builds before asking the agent (ratchet.worker.job), with the
    tools of ``catalog`` when the engine was given none."""
    view = agent_view(engine, last_read)
    return view if catalog is None else replace(view, tools=permitted_tools(engine, catalog))


def drive(
    engine: RunEngine,
    agent: Agent,
    *,
    catalog: ToolCatalog | None = None,
    max_steps: int = 50,
) -> list[StepResult]:
    """Step the run as a job does until it leaves ``running``, the agent has nothing to
    propose, or ``max_steps`` proposals were made."""
    results: list[StepResult] = []
    last_read: str | None = None
    for _ in range(max_steps):
        if engine.state.phase is not Phase.RUNNING:
            break
        step = agent.next_step(view_of(engine, last_read=last_read, catalog=catalog))
        if step is None:
            break
        result = engine.propose(step.action, agent_state=step.agent_state)
        last_read = result.read.content if result.read is not None else None
        results.append(result)
    return results


def call(name: str, arguments: Mapping[str, Any] | str, call_id: str = "") -> ToolCallRequest:
    text = arguments if isinstance(arguments, str) else json.dumps(dict(arguments))
    return ToolCallRequest(id=call_id or f"call-{name}", name=name, arguments=text)


def calls(*requests: ToolCallRequest) -> ModelReply:
    return ModelReply(tool_calls=list(requests))


def answer(text: str) -> ModelReply:
    return ModelReply(content=text)


def offered(specs: tuple[ToolSpec, ...] | list[ToolSpec]) -> list[dict[str, Any]]:
    """What the model must be shown for ``specs``: OpenAI function tools."""
    return [
        {
            "type": "function",
            "function": {
                "name": s.name,
                "description": s.description,
                "parameters": s.json_schema,
            },
        }
        for s in specs
    ]


BUILTIN_NAMES = tuple(BUILTIN_TOOLS)
