"""A Pydantic AI ``Agent`` as a ratchet agent: its tools are declared ratchet tools, its
model requests are journaled in the run.

Wrap the agent once, in the module that defines it::

    from pydantic_ai import Agent
    from ratchet.integrations.pydantic_ai import RatchetAgent, current_call

    agent = Agent("openai:gpt-5", instructions="Refund the order the user names.")

    @agent.tool_plain
    def create_refund(order_id: str, amount_cents: int) -> dict:
        key = current_call().idempotency_key      # ratchet's key for this call
        return payments.refund(order_id, amount_cents, idempotency_key=key)

    refunds = RatchetAgent(agent)
    create_refund_tool = refunds.tool("create_refund", idempotent=True)   # ratchet.tools
    # `refunds` itself is the agent factory: --agent mypkg.shop:refunds

**One model request per step, journaled.** The ratchet agent runs the Pydantic AI agent
with every tool call deferred (``CallDeferred``): Pydantic AI asks the model, validates
the calls, and ends the run with :class:`~pydantic_ai.DeferredToolRequests` instead of
calling a tool. The messages so far (serialized with ``ModelMessagesTypeAdapter``) go
into the agent's state, and the first call is proposed as a ratchet action of the tool
of that name; the state is signed and committed with that proposal, in the same commit
as its intent. The next calls of the same response wait in the state and are proposed
one per step without asking the model. When every call of the response has an outcome,
the outcomes go back as the calls' results (``DeferredToolResults``) and the model is
asked again. So a worker that takes the run over resumes from the journal: a model
response the run already committed is never asked for again. (A request whose response
was not yet committed with a proposal, a worker dying while the model thinks, is asked
again: nothing of it left the process.)

**Tools.** The model is offered the run's permitted tools (``view.tools``) except
``finish``: a tool the Pydantic AI agent defines is offered as the agent defines it
(description, schema, ``prepare``), the others (built-in kinds, tools installed on the
worker) from their ratchet contract. The agent's tools that the scenario does not permit
are not offered. What the worker runs for a call is the ratchet tool of that name: for
the agent's own function tools, :meth:`RatchetAgent.tool` declares one (risk, recovery,
approval) that calls the same function, to be installed under the ``ratchet.tools``
entry-point group. Every guarantee of a declared tool applies (``docs/tools.md``).

**Results.** What the model is told for a call is judged from the view, never from the
agent's notes: a write is ``done`` when its key has a receipt; a read returns what it
read (in the same job; after a restart the model is told to call it again); a call the
runtime refused or that did not take effect comes back as a failed tool call
(``ToolFailed``) with the trace outcome. A write's own output stays in its receipt
(``ratchet show``); the model is told that it took effect.

**The final output.** When the model answers with the agent's output, the output (text,
or its JSON) is proposed as ``finish``. With ``verify_target`` set, a ``run_verifier`` of
that target is proposed first when the current environment is not verified (the run
completes only after a passing verification after the last write). A verification that
fails, or a refused ``finish``, is told to the model as a new user message, and the run
goes on.

**Budgets.** Every proposal spends the scenario's budgets as any agent's. With
``tokens_per_cost_unit`` set, the tokens of the model requests a step made (input plus
output, from Pydantic AI's usage) are charged as the proposal's ``cost_units``, rounded
up; leave it unset when the scenario has no cost budget.

**Keys.** A write's idempotency key is ``step_key(view, position)`` with the run's
proposal count as the position: it comes from the signed run state, never from the
model, and is fixed in the state with the proposal.

Configuration (the run's ``agent_config``, checked strictly: :class:`PydanticAIConfig`)::

    {"prompt": "Refund order A-1 for 500 cents.", "verify_target": "unit",
     "tokens_per_cost_unit": 1000}

The step, the state, the journal's bound and the tools' base are shared with the other
integrations (:mod:`ratchet.integrations._journal`, :mod:`ratchet.integrations._tools`);
this module is what is Pydantic AI's: the deferred toolset, the request, the journal's
format, the errors.

Errors: a model error is an :class:`~ratchet.errors.AdapterError`, retryable for a
rate limit, a timeout, a transport failure or a 5xx (the job ends ``retry_later`` with
nothing committed), not for the rest. Messages name the status and the error's type,
never a provider's error body.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import pydantic_ai
from pydantic_ai import (
    CallDeferred,
    DeferredToolRequests,
    DeferredToolResults,
    ModelMessagesTypeAdapter,
    RunContext,
    ToolDefinition,
    ToolFailed,
)
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.exceptions import (
    AgentRunError,
    ModelAPIError,
    ModelHTTPError,
    ModelRequestRejectedError,
    UserError,
)
from pydantic_ai.messages import ModelMessage, ModelResponse
from pydantic_ai.toolsets import AbstractToolset, ExternalToolset, FunctionToolset, WrapperToolset
from pydantic_ai.toolsets.abstract import ToolsetTool
from pydantic_core import to_json

from ratchet.agents.conversation import clip
from ratchet.errors import AdapterError, ConfigurationError
from ratchet.integrations._journal import (
    BUILTIN_NAMES,
    Answer,
    Asked,
    JournalConfig,
    JournaledAgent,
    JournalState,
    RawCall,
    fit_journal,
)
from ratchet.integrations._tools import JournaledTool, complete, current_call
from ratchet.runtime.actions import Risk
from ratchet.runtime.catalog import ToolSpec

__all__ = [
    "PYDANTIC_AI_VERSION",
    "PydanticAIAgent",
    "PydanticAIConfig",
    "PydanticAIState",
    "PydanticAITool",
    "RatchetAgent",
    "current_call",
]

#: The Pydantic AI release this module is built and tested against (the test extra pins
#: it; the ``pydantic-ai`` extra admits >=2.78,<3).
PYDANTIC_AI_VERSION = "2.78.0"

_RETRYABLE_STATUS = frozenset({408, 409, 425, 429})


# -- the tools --------------------------------------------------------------------------------


class PydanticAITool(JournaledTool):
    """A ratchet tool that runs a Pydantic AI agent's function tool (made by
    :meth:`RatchetAgent.tool`). While the function runs, :func:`current_call` returns
    the call; an ``async`` function is run to completion. ``lookup`` and ``fence`` are
    the decorators of :class:`ratchet.tools.FunctionTool`."""


def _function_tools(agent: pydantic_ai.Agent[Any, Any]) -> dict[str, pydantic_ai.Tool[Any]]:
    """The function tools registered on ``agent`` (``@agent.tool``, ``tools=[...]``,
    function toolsets), by name."""
    found: dict[str, pydantic_ai.Tool[Any]] = {}
    for toolset in agent.toolsets:
        if isinstance(toolset, FunctionToolset):
            found.update(toolset.tools)
    return found


# -- what the model is offered ----------------------------------------------------------------


def _offered_def(spec: ToolSpec) -> ToolDefinition:
    return ToolDefinition(
        name=spec.name, description=spec.description, parameters_json_schema=spec.json_schema
    )


@dataclass
class _RatchetToolset(WrapperToolset[Any]):
    """The agent's toolset as a ratchet run offers it: only the permitted tools, the
    agent's approval flag left to ratchet, every call deferred (ratchet carries it out)."""

    offered: Mapping[str, ToolSpec] = field(default_factory=dict)

    async def get_tools(self, ctx: RunContext[Any]) -> dict[str, ToolsetTool[Any]]:
        own = await self.wrapped.get_tools(ctx)
        tools: dict[str, ToolsetTool[Any]] = {}
        for name, tool in own.items():
            if name not in self.offered or name in BUILTIN_NAMES:
                continue
            if tool.tool_def.kind == "unapproved":  # ratchet's approval gates the call
                tools[name] = replace(tool, tool_def=replace(tool.tool_def, kind="function"))
            else:
                tools[name] = tool
        missing = [_offered_def(s) for n, s in self.offered.items() if n not in tools]
        if missing:
            tools.update(await ExternalToolset[Any](missing).get_tools(ctx))
        return tools

    async def call_tool(
        self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], tool: ToolsetTool[Any]
    ) -> Any:
        raise CallDeferred()


@dataclass
class _DeferToRatchet(AbstractCapability[Any]):
    offered: Mapping[str, ToolSpec] = field(default_factory=dict)

    def get_wrapper_toolset(self, toolset: AbstractToolset[Any]) -> AbstractToolset[Any]:
        return _RatchetToolset(toolset, self.offered)


# -- configuration and state --------------------------------------------------------------------


class PydanticAIConfig(JournalConfig):
    """A run's ``agent_config`` for a wrapped Pydantic AI agent (an unknown key is
    refused): the keys of :class:`~ratchet.integrations._journal.JournalConfig`."""


class PydanticAIState(JournalState):
    """The agent's JSON state (``view.agent_state``), validated on every step.

    ``journal`` is the conversation, as ``ModelMessagesTypeAdapter`` serializes it
    (kept as text: its numbers are not all integers, and the state admits no floats);
    ``model_requests`` counts the model requests whose responses the journal took in.
    """

    whose: ClassVar[str] = "a Pydantic AI agent's"

    def messages(self) -> list[ModelMessage]:
        return list(ModelMessagesTypeAdapter.validate_json(self.journal)) if self.journal else []


# -- the wrapper a user builds ------------------------------------------------------------------


class RatchetAgent:
    """A Pydantic AI agent made runnable by ratchet: the agent factory (call it with a
    run's ``agent_config``; :meth:`factory`) and its tools' ratchet declarations
    (:meth:`tool`).

    ``prompt`` is the first user message when the configuration names none; ``deps``
    the dependencies every run of the agent gets (its instructions and ``prepare``
    functions see them; tools run by ratchet do not).

    Raises (constructor):
        ConfigurationError: not a Pydantic AI agent, or one of its function tools has a
            built-in kind's name (``read_file``, ``finish``, ...).
    """

    def __init__(
        self, agent: pydantic_ai.Agent[Any, Any], *, prompt: str | None = None, deps: Any = None
    ) -> None:
        if not isinstance(agent, pydantic_ai.Agent):
            raise ConfigurationError("RatchetAgent wraps a pydantic_ai.Agent", field="agent")
        clash = sorted(set(_function_tools(agent)) & BUILTIN_NAMES)
        if clash:
            raise ConfigurationError(
                f"the agent's tool {clash[0]!r} has a built-in kind's name; rename it",
                field="tools",
            )
        self.agent = agent
        self.prompt = prompt
        self.deps = deps

    def __repr__(self) -> str:
        return f"RatchetAgent(agent={self.agent.name!r})"

    def tool(
        self,
        name: str,
        *,
        risk: Risk | str = Risk.IRREVERSIBLE_EXTERNAL_WRITE,
        idempotent: bool = False,
        requires_approval: bool | None = None,
        description: str | None = None,
    ) -> PydanticAITool:
        """The ratchet declaration of the agent's function tool ``name``: a tool that
        calls the same function, with ``risk`` (the most careful one by default),
        ``idempotent`` (the service dedupes by the key the function reads from
        :func:`current_call`), and the approval the agent's tool asks for
        (``requires_approval=True`` in Pydantic AI) unless given here. Register the
        result under the ``ratchet.tools`` entry-point group; a ``lookup`` or ``fence``
        goes on it with its decorators.

        Raises:
            ConfigurationError: no such function tool, a tool that takes a
                ``RunContext`` (ratchet runs the function outside an agent run: make it
                a plain tool), or what a declaration refuses (floats, a risk).
        """
        found = _function_tools(self.agent).get(name)
        if found is None:
            raise ConfigurationError(
                f"the agent has no function tool {name!r}", field=f"tools.{name}"
            )
        if found.takes_ctx:
            raise ConfigurationError(
                f"tool {name!r} takes a RunContext; a tool ratchet runs must be a plain "
                "tool (tool_plain)",
                field=f"tools.{name}",
            )
        if "call" in inspect.signature(found.function).parameters:
            raise ConfigurationError(
                f"tool {name!r} has an argument named 'call'; read the call from "
                "current_call() instead",
                field=f"tools.{name}",
            )
        made = PydanticAITool(
            found.function,
            name=name,
            risk=risk,
            description=description if description is not None else (found.description or ""),
            requires_approval=(
                found.requires_approval if requires_approval is None else requires_approval
            ),
            idempotent=idempotent,
        )
        made.spec  # noqa: B018 - declaration errors surface here, not at first call
        return made

    def factory(self, config: dict[str, Any]) -> PydanticAIAgent:
        """The ratchet agent for a run's ``agent_config`` (:class:`PydanticAIConfig`).

        Raises:
            ConfigurationError: the configuration is refused, or no prompt is named.
        """
        return PydanticAIAgent(self, PydanticAIConfig.for_run(config, self.prompt))

    def __call__(self, config: dict[str, Any]) -> PydanticAIAgent:
        return self.factory(config)


# -- the ratchet agent ------------------------------------------------------------------------


def _model_error(exc: AgentRunError) -> AdapterError:
    """A Pydantic AI run's failure as the worker treats a model endpoint's: retryable
    when asking again can help. Never the provider's error body."""
    if isinstance(exc, ModelHTTPError):
        status = exc.status_code
        retryable = status in _RETRYABLE_STATUS or status >= 500
        return AdapterError(
            f"model request failed: HTTP {status} ({type(exc).__name__})",
            retryable=retryable,
            status=status,
        )
    if isinstance(exc, ModelAPIError):
        retryable = not isinstance(exc, ModelRequestRejectedError)
        return AdapterError(f"model request failed ({type(exc).__name__})", retryable=retryable)
    return AdapterError(
        f"the agent run failed ({type(exc).__name__}): {clip(str(exc), 300)}", retryable=False
    )


class PydanticAIAgent(JournaledAgent[PydanticAIState]):
    """The ratchet agent of a :class:`RatchetAgent` (see the module docstring). Built by
    the factory in every job; everything that must outlive a job is in the state."""

    config: PydanticAIConfig

    def __init__(self, wrapped: RatchetAgent, config: PydanticAIConfig) -> None:
        super().__init__(config, PydanticAIState)
        self.wrapped = wrapped

    def __repr__(self) -> str:
        return f"PydanticAIAgent(agent={self.wrapped.agent.name!r})"

    def _ask(
        self,
        state: PydanticAIState,
        offered: Mapping[str, ToolSpec],
        answers: Mapping[str, Answer],
        note: str | None,
    ) -> Asked[PydanticAIState]:
        history = state.messages()
        prompt: str | None = None
        results: DeferredToolResults | None = None
        if not history:
            prompt = self.config.prompt
        elif answers:
            results = DeferredToolResults(
                calls={
                    call_id: (a.text if a.ok else ToolFailed(a.text))
                    for call_id, a in answers.items()
                }
            )
        else:
            prompt = note or "Go on."
        agent = self.wrapped.agent
        try:
            # On a loop of its own, closed after the request (Pydantic AI's run_sync would
            # leave a loop set on the worker's thread for good).
            result = complete(
                agent.run(
                    prompt,
                    message_history=history or None,
                    deferred_tool_results=results,
                    output_type=_with_deferred(agent.output_type),
                    deps=self.wrapped.deps,
                    capabilities=[_DeferToRatchet(offered)],
                )
            )
        except UserError as exc:
            raise ConfigurationError(
                f"the Pydantic AI agent refused the run: {clip(str(exc), 300)}", field="agent"
            ) from None
        except AgentRunError as exc:
            raise _model_error(exc) from None
        state = self._journal(state, result.all_messages())
        usage = result.usage
        tokens = usage.input_tokens + usage.output_tokens
        output = result.output
        if isinstance(output, DeferredToolRequests):
            return Asked(state, calls=_calls(output), tokens=tokens, requests=usage.requests)
        text = output if isinstance(output, str) else to_json(output).decode()
        return Asked(state, output=text, tokens=tokens, requests=usage.requests)

    def _journal(self, state: PydanticAIState, messages: Sequence[ModelMessage]) -> PydanticAIState:
        """The state with ``messages`` as its journal, oldest exchanges dropped (never the
        first request, and always from a model response on) to fit the bound."""
        text, dropped = fit_journal(
            messages,
            head=1,
            starts=[i for i, m in enumerate(messages) if isinstance(m, ModelResponse)],
            dump=lambda window: ModelMessagesTypeAdapter.dump_json(window).decode(),
            limit=self.config.max_history_bytes,
        )
        return state.model_copy(update={"journal": text, "dropped": state.dropped + dropped})


def _calls(requests: DeferredToolRequests) -> list[RawCall]:
    """The deferred calls, with the arguments Pydantic AI validated (or as the model wrote
    them); an approval Pydantic AI asks for is refused: ratchet's approvals gate calls."""
    if requests.approvals:
        raise ConfigurationError(
            "the Pydantic AI agent asked for an approval (ApprovalRequired); ratchet's "
            "approvals gate the calls: declare requires_approval on the ratchet tool",
            field="agent",
        )
    calls: list[RawCall] = []
    for part in requests.calls:
        raw = requests.validated_args.get(part.tool_call_id)
        args = dict(raw) if raw is not None else part.args_as_dict()
        calls.append(RawCall(id=part.tool_call_id, name=part.tool_name, args=args))
    return calls


def _with_deferred(output_type: Any) -> Any:
    """The agent's output types with :class:`DeferredToolRequests` among them."""
    if isinstance(output_type, Sequence) and not isinstance(output_type, str):
        types = list(output_type)
    else:
        types = [output_type]
    if DeferredToolRequests not in types:
        types.append(DeferredToolRequests)
    return types
