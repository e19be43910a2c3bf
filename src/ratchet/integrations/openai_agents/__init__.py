"""An OpenAI Agents SDK ``Agent`` as a ratchet agent: its function tools are declared
ratchet tools, its model responses are journaled in the run.

Wrap the agent once, in the module that defines it::

    from agents import Agent, function_tool
    from ratchet.integrations.openai_agents import RatchetAgent, current_call

    @function_tool
    def create_refund(order_id: str, amount_cents: int) -> dict:
        \"\"\"Refund part of an order.\"\"\"
        key = current_call().idempotency_key      # ratchet's key for this call
        return payments.refund(order_id, amount_cents, idempotency_key=key)

    agent = Agent(name="refunds", instructions="Refund the order the user names.",
                  tools=[create_refund])
    refunds = RatchetAgent(agent)
    create_refund_tool = refunds.tool("create_refund", idempotent=True)   # ratchet.tools
    # `refunds` itself is the agent factory: --agent mypkg.shop:refunds

**What runs, and why this way.** The SDK's ``Runner`` runs a whole agent loop in one
call: it asks the model, runs the tools the model called in the same process, and asks
again. Ratchet needs the opposite at a tool call: the call proposed as data, committed as
an intent, carried out by the worker with its key and fence, and the outcome fed back
later, possibly in another process. So this integration does not run the ``Runner``. Each
step makes one model request itself, through the SDK's own ``Model.get_response``, with
what the runner would send for that turn (the agent's instructions and prompt, its
enabled function tools, its model and model settings, its output schema; a ``RunConfig``'s
model, provider and settings), and reads the response as the runner reads it (function
calls; else the last message's text, validated against ``output_type``). The other way,
running the ``Runner`` with the tools swapped for stand-ins and stopping it after the
first turn, was weighed and not taken: it runs no fewer of the runner's parts that matter
here (guardrails and hooks would run again at every step, whose model calls are not
journaled), needs placeholder tool outputs that must be cut out of its items, and cannot
promise one model request per step. Driving ``get_response`` makes that promise by
construction, and no tool function can run in the agent's process.

**One model request per step, journaled.** The conversation is kept as the SDK's input
items (the runner's ``to_input_list()`` shape, JSON text) in the agent's state. A
response's function calls are checked against their ratchet contracts together, and the
first is proposed as an action of the declared tool of that name; the state (with the
response) is signed and committed with that proposal, in the same commit as its intent.
The next calls of the response are proposed one per step without asking the model. When
every call has an outcome, the outcomes go back as ``function_call_output`` items and the
model is asked again. A worker that takes the run over resumes from the journal: a model
response the run committed is never asked for again. (A request whose response was not
yet committed, a worker dying while the model thinks, is asked again: nothing of it left
the process.)

**Tools.** The model is offered the run's permitted tools (``view.tools``) except
``finish``: the agent's own function tools as the agent defines them (description, strict
schema, ``is_enabled``), the others (built-in kinds, tools installed on the worker) from
their ratchet contract. What the worker runs for a call is the ratchet tool of that name:
for the agent's function tools, :meth:`RatchetAgent.tool` declares one (risk, recovery,
approval) that calls the function ``@function_tool`` wrapped, to be installed under the
``ratchet.tools`` entry-point group. Every guarantee of a declared tool applies
(``docs/tools.md``).

**Results, output, budgets, keys** are the journaled step's
(:mod:`ratchet.integrations._journal`), as for the Pydantic AI integration: outcomes are
judged from the view, never the agent's notes; the final output is proposed as ``finish``
(after ``run_verifier`` with ``verify_target``); with ``tokens_per_cost_unit``, a step's
model tokens (``usage.input_tokens + usage.output_tokens``) are its ``cost_units``; a
write's key is ``step_key(view, position)``. ``tool_use_behavior`` is honoured:
``stop_on_first_tool`` and ``StopAtTools`` make a carried-out call's outcome the output.

**What is refused at wrap time** (one line, :class:`~ratchet.errors.ConfigurationError`),
because running it here would either skip it silently or act outside ratchet: handoffs,
input and output guardrails, lifecycle hooks, MCP servers (ratchet's own MCP tools are
``ratchet.tools.mcp``), tools that are not function tools (hosted, computer, shell), a
``tool_use_behavior`` function, a tool named like a built-in kind, and a ``RunConfig``
with guardrails or a model input filter.

Configuration (the run's ``agent_config``, checked strictly: :class:`OpenAIAgentsConfig`)::

    {"prompt": "Refund order A-1 for 500 cents.", "verify_target": "unit",
     "tokens_per_cost_unit": 1000, "request_timeout_s": 120}

Errors: a model error is an :class:`~ratchet.errors.AdapterError`, retryable for a rate
limit, a timeout, a transport failure or a 5xx (the job ends ``retry_later`` with nothing
committed), not for the rest (a refusal by the model included). Messages name the status
and the error's type, never a provider's error body; the key stays in the agent's client.
"""

from __future__ import annotations

import inspect
from typing import Any

from agents.agent import Agent
from agents.exceptions import UserError
from agents.function_schema import function_schema
from agents.run_config import RunConfig
from agents.tool import FunctionTool

from ratchet.agents.conversation import clip
from ratchet.errors import ConfigurationError
from ratchet.integrations._journal import BUILTIN_NAMES
from ratchet.integrations._tools import JournaledTool, current_call
from ratchet.integrations.openai_agents._agent import (
    OpenAIAgentsAgent,
    OpenAIAgentsConfig,
    OpenAIAgentsState,
)
from ratchet.runtime.actions import Risk

__all__ = [
    "OPENAI_AGENTS_VERSION",
    "OpenAIAgentsAgent",
    "OpenAIAgentsConfig",
    "OpenAIAgentsState",
    "OpenAIAgentsTool",
    "RatchetAgent",
    "current_call",
]

#: The Agents SDK release this package is built and tested against (the test extra pins
#: it; the ``openai-agents`` extra admits >=0.24,<0.25).
OPENAI_AGENTS_VERSION = "0.24.0"


class OpenAIAgentsTool(JournaledTool):
    """A ratchet tool that runs an Agents SDK agent's function tool (made by
    :meth:`RatchetAgent.tool`). While the function runs, :func:`current_call` returns the
    call; an ``async`` function is run to completion. ``lookup`` and ``fence`` are the
    decorators of :class:`ratchet.tools.FunctionTool`."""


def _refusals(agent: Agent[Any], run_config: RunConfig) -> list[str]:
    """What ratchet cannot run faithfully (see the module docstring), each with why."""
    found: list[str] = []
    if agent.handoffs:
        found.append("handoffs (ratchet runs one agent per run)")
    if agent.input_guardrails or agent.output_guardrails:
        found.append("input or output guardrails (they would run unjournaled at every step)")
    if agent.hooks is not None:
        found.append("lifecycle hooks (agent.clone(hooks=None); ratchet's trace is the record)")
    if agent.mcp_servers:
        found.append("MCP servers (declare them as ratchet tools: ratchet.tools.mcp)")
    others = sorted({type(t).__name__ for t in agent.tools if not isinstance(t, FunctionTool)})
    if others:
        found.append(f"tools that are not function tools ({', '.join(others)})")
    if callable(agent.tool_use_behavior):
        found.append("a tool_use_behavior function")
    if run_config.input_guardrails or run_config.output_guardrails:
        found.append("a RunConfig with guardrails")
    if run_config.call_model_input_filter is not None:
        found.append("a RunConfig with call_model_input_filter")
    return found


class RatchetAgent:
    """An Agents SDK agent made runnable by ratchet: the agent factory (call it with a
    run's ``agent_config``; :meth:`factory`) and its function tools' ratchet declarations
    (:meth:`tool`).

    ``prompt`` is the first user message when the configuration names none; ``context``
    the run context every request of the agent gets (its instructions, prompt and
    ``is_enabled`` functions see it; tools run by ratchet do not); ``run_config`` the
    model, provider and settings a ``Runner`` would take from it (its other fields are
    not used).

    Raises (constructor):
        ConfigurationError: not an Agents SDK agent, or one ratchet cannot run (see the
            module docstring).
    """

    def __init__(
        self,
        agent: Agent[Any],
        *,
        prompt: str | None = None,
        context: Any = None,
        run_config: RunConfig | None = None,
    ) -> None:
        if not isinstance(agent, Agent):
            raise ConfigurationError("RatchetAgent wraps an agents.Agent", field="agent")
        config = run_config if run_config is not None else RunConfig()
        refused = _refusals(agent, config)
        if refused:
            raise ConfigurationError(
                f"ratchet cannot run an agent with {'; '.join(refused)}", field="agent"
            )
        clash = sorted(set(self._tools_of(agent)) & BUILTIN_NAMES)
        if clash:
            raise ConfigurationError(
                f"the agent's tool {clash[0]!r} has a built-in kind's name; rename it",
                field="tools",
            )
        self.agent = agent
        self.prompt = prompt
        self.context = context
        self.run_config = config

    def __repr__(self) -> str:
        return f"RatchetAgent(agent={self.agent.name!r})"

    @staticmethod
    def _tools_of(agent: Agent[Any]) -> dict[str, FunctionTool]:
        return {t.name: t for t in agent.tools if isinstance(t, FunctionTool)}

    def tool(
        self,
        name: str,
        *,
        risk: Risk | str = Risk.IRREVERSIBLE_EXTERNAL_WRITE,
        idempotent: bool = False,
        requires_approval: bool | None = None,
        description: str | None = None,
    ) -> OpenAIAgentsTool:
        """The ratchet declaration of the agent's function tool ``name``: a tool that
        calls the function ``@function_tool`` wrapped, with ``risk`` (the most careful
        one by default), ``idempotent`` (the service dedupes by the key the function
        reads from :func:`current_call`), and the approval the SDK tool asks for
        (``needs_approval``: a function of the call counts as always) unless given here.
        Register the result under the ``ratchet.tools`` entry-point group; a ``lookup``
        or ``fence`` goes on it with its decorators.

        Raises:
            ConfigurationError: no such function tool, one not made by
                ``@function_tool``, one that takes a ``RunContextWrapper`` or
                ``ToolContext`` (ratchet runs the function outside an agent run), one with
                tool guardrails (they would not run), or what a declaration refuses
                (floats, a risk).
        """
        found = self._tools_of(self.agent).get(name)
        where = f"tools.{name}"
        if found is None:
            raise ConfigurationError(f"the agent has no function tool {name!r}", field=where)
        try:
            function = found.__wrapped__
        except AttributeError:
            raise ConfigurationError(
                f"tool {name!r} was not made by @function_tool: ratchet has no function to run",
                field=where,
            ) from None
        try:
            takes_context = function_schema(function, use_docstring_info=False).takes_context
        except UserError as exc:
            raise ConfigurationError(f"tool {name!r}: {clip(str(exc), 200)}", field=where) from None
        if takes_context:
            raise ConfigurationError(
                f"tool {name!r} takes a RunContextWrapper or ToolContext; a tool ratchet runs "
                "takes its arguments only",
                field=where,
            )
        if found.tool_input_guardrails or found.tool_output_guardrails:
            raise ConfigurationError(
                f"tool {name!r} has tool guardrails, which ratchet would not run", field=where
            )
        if "call" in inspect.signature(function).parameters:
            raise ConfigurationError(
                f"tool {name!r} has an argument named 'call'; read the call from "
                "current_call() instead",
                field=where,
            )
        asks = found.needs_approval is not False  # a function of the call: always
        made = OpenAIAgentsTool(
            function,
            name=name,
            risk=risk,
            description=description if description is not None else found.description,
            requires_approval=asks if requires_approval is None else requires_approval,
            idempotent=idempotent,
        )
        made.spec  # noqa: B018 - declaration errors surface here, not at first call
        return made

    def factory(self, config: dict[str, Any]) -> OpenAIAgentsAgent:
        """The ratchet agent for a run's ``agent_config`` (:class:`OpenAIAgentsConfig`).

        Raises:
            ConfigurationError: the configuration is refused, or no prompt is named.
        """
        return OpenAIAgentsAgent(self, OpenAIAgentsConfig.for_run(config, self.prompt))

    def __call__(self, config: dict[str, Any]) -> OpenAIAgentsAgent:
        return self.factory(config)
