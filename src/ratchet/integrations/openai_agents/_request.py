"""One model request of an OpenAI Agents SDK agent, made as the SDK's runner makes it,
and nothing else of the runner: no tool runs, no second turn.

What the runner would resolve for a turn is resolved here from the same public pieces
(the agent's instructions, prompt, enabled function tools, model, model settings and
output schema; a ``RunConfig``'s model, provider and settings), then the model's
``get_response`` is called once with the journal as its input, on the process's model
loop (:class:`ModelLoop`). The response is read the way the runner reads it: its
function calls, or (none) the last message's text as the final output, validated
against the agent's output type.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import openai
from agents.agent import Agent
from agents.agent_output import AgentOutputSchema, AgentOutputSchemaBase
from agents.exceptions import AgentsException, ModelBehaviorError, UserError
from agents.items import ItemHelpers, ModelResponse, TResponseInputItem
from agents.model_settings import ModelSettings
from agents.models import get_default_model_settings
from agents.models.interface import Model, ModelTracing
from agents.run_config import RunConfig
from agents.run_context import RunContextWrapper
from agents.tool import FunctionTool, Tool
from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage

from ratchet.agents.conversation import clip
from ratchet.errors import AdapterError, ConfigurationError, ContractError
from ratchet.integrations._journal import RawCall
from ratchet.runtime.canonical import strict_json_loads
from ratchet.runtime.catalog import ToolSpec

__all__ = ["ModelLoop", "Reading", "Request", "model_error", "read_response"]

T = TypeVar("T")

_RETRYABLE_STATUS = frozenset({408, 409, 425, 429})


class ModelLoop:
    """The process's event loop for model requests, on a daemon thread of its own.

    Why one loop for the process, where the Pydantic AI integration runs each request on a
    loop of its own: an ``AsyncOpenAI`` client (the agent's, or the default provider's)
    pools its connections on the loop it first ran on. On a new loop per request, the next
    request reuses a connection of a closed loop and fails ("Event loop is closed"). One
    loop for the process's life keeps the agent's client usable across steps and jobs.
    Started on first use; a process forked after that starts its own (a fork copies no
    threads; ratchet's worker pool spawns its processes).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pid = 0

    def _running(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._pid != os.getpid():
                loop = asyncio.new_event_loop()
                thread = threading.Thread(
                    target=loop.run_forever, name="ratchet-model-loop", daemon=True
                )
                thread.start()
                self._loop, self._pid = loop, os.getpid()
            return self._loop

    def run(self, coro: Coroutine[Any, Any, T], *, timeout_s: float) -> T:
        """``coro``'s result, run on the loop; past ``timeout_s`` it is cancelled.

        Raises:
            TimeoutError: it took longer than ``timeout_s``.
            What ``coro`` raises.
        """
        future = asyncio.run_coroutine_threadsafe(coro, self._running())
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise


@dataclass(frozen=True, slots=True, repr=False)
class Request:
    """What the runner would send for one turn of ``agent`` (see the module docstring).
    ``offered`` are the run's permitted tools (``finish`` aside); ``used_tools`` whether
    the model called a tool earlier in the run (the agent's ``reset_tool_choice``). Its
    repr names the agent only: the context and the run config's provider are the
    user's, and may hold what no log line should."""

    agent: Agent[Any]
    context: Any
    run_config: RunConfig
    offered: Mapping[str, ToolSpec]
    used_tools: bool

    def __repr__(self) -> str:
        return f"Request(agent={self.agent.name!r}, offered={sorted(self.offered)!r})"

    async def send(self, items: list[dict[str, Any]]) -> ModelResponse:
        """One ``get_response`` with ``items`` as the input."""
        ctx = RunContextWrapper(context=self.context)
        agent = self.agent
        instructions = await agent.get_system_prompt(ctx)
        prompt = await agent.get_prompt(ctx)
        tools = await self._tools(ctx)
        return await self._model().get_response(
            instructions,
            cast(list[TResponseInputItem], items),
            self._settings(),
            tools,
            output_schema(agent),
            [],
            ModelTracing.DISABLED,
            previous_response_id=None,
            conversation_id=None,
            prompt=prompt,
        )

    def _model(self) -> Model:
        """The runner's choice: the run config's model, else the agent's, a name resolved
        by the run config's provider."""
        chosen = self.run_config.model
        if isinstance(chosen, Model):
            return chosen
        if isinstance(chosen, str):
            return self.run_config.model_provider.get_model(chosen)
        if isinstance(self.agent.model, Model):
            return self.agent.model
        return self.run_config.model_provider.get_model(self.agent.model)

    def _settings(self) -> ModelSettings:
        """The runner's settings: the agent's (its model's defaults realigned to the model
        the run config names), the run config's over them; ``tool_choice`` dropped once a
        tool was used, when the agent resets it."""
        settings = self.agent.model_settings
        if settings == _implicit_settings(self.agent.model) and self.run_config.model is not None:
            settings = _implicit_settings(self.run_config.model)
        settings = settings.resolve(self.run_config.model_settings)
        if self.agent.reset_tool_choice is True and self.used_tools:
            settings = dataclasses.replace(settings, tool_choice=None)
        return settings

    async def _tools(self, ctx: RunContextWrapper[Any]) -> list[Tool]:
        """The offered tools: the agent's own function tools as the agent defines them
        (when enabled), the others from their ratchet contract. The agent's tools the run
        does not permit are not offered."""
        declared = {t.name for t in self.agent.tools if isinstance(t, FunctionTool)}
        enabled = {
            t.name: t for t in await self.agent.get_all_tools(ctx) if isinstance(t, FunctionTool)
        }
        tools: list[Tool] = []
        for name, spec in self.offered.items():
            if name in enabled:
                tools.append(enabled[name])
            elif name not in declared:
                tools.append(_offered_tool(spec))
        return tools


def _implicit_settings(model: str | Model | None) -> ModelSettings:
    if model is None:
        return get_default_model_settings()
    if isinstance(model, str):
        return get_default_model_settings(model)
    return ModelSettings()


def output_schema(agent: Agent[Any]) -> AgentOutputSchemaBase | None:
    """The agent's output schema as the runner builds it (None: plain text)."""
    if agent.output_type is None or agent.output_type is str:
        return None
    if isinstance(agent.output_type, AgentOutputSchemaBase):
        return agent.output_type
    return AgentOutputSchema(agent.output_type)


async def _not_here(ctx: Any, arguments: str) -> Any:
    raise UserError("ratchet carries this tool's calls out; the agent process never runs them")


def _offered_tool(spec: ToolSpec) -> FunctionTool:
    return FunctionTool(
        name=spec.name,
        description=spec.description,
        params_json_schema=spec.json_schema,
        on_invoke_tool=_not_here,
        strict_json_schema=False,
    )


# -- reading a response -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Reading:
    """A response as the runner reads it: its function calls, or its final output text,
    or a ``problem`` to tell the model (an answer that does not fit the output type), or
    none of them (nothing to act on)."""

    calls: list[RawCall]
    output: str | None = None
    problem: str | None = None


def read_response(response: ModelResponse, schema: AgentOutputSchemaBase | None) -> Reading:
    """Read ``response`` (see :class:`Reading`).

    Raises:
        AdapterError: ``retryable=False``: the model refused (the runner's
            ``ModelRefusalError``).
    """
    calls = [
        _raw_call(item) for item in response.output if isinstance(item, ResponseFunctionToolCall)
    ]
    if calls:
        return Reading(calls)
    messages = [item for item in response.output if isinstance(item, ResponseOutputMessage)]
    if not messages:
        # The runner's rule: plain text ends with "", a structured output asks again.
        plain = schema is None or schema.is_plain_text()
        return Reading([], output="" if plain else None)
    refusal = ItemHelpers.extract_refusal(messages[-1])
    if refusal:
        raise AdapterError(
            f"the model refused the request (ModelRefusalError): {clip(refusal, 200)}",
            retryable=False,
        )
    text = ItemHelpers.extract_text(messages[-1]) or ""
    if schema is None or schema.is_plain_text():
        return Reading([], output=text)
    try:
        schema.validate_json(text)
    except ModelBehaviorError as exc:
        problem = (
            f"Your final answer does not fit the output type ({clip(str(exc), 300)}). "
            "Answer again with JSON that does."
        )
        return Reading([], problem=problem)
    return Reading([], output=text)


def _raw_call(item: ResponseFunctionToolCall) -> RawCall:
    try:
        args = strict_json_loads(item.arguments or "{}")
    except ContractError as exc:
        return RawCall(item.call_id, item.name, None, f"the arguments are not JSON: {exc.message}")
    if not isinstance(args, dict):
        return RawCall(item.call_id, item.name, None, "the arguments are not a JSON object")
    return RawCall(item.call_id, item.name, args)


# -- errors -----------------------------------------------------------------------------------


def model_error(exc: Exception) -> AdapterError | ConfigurationError:
    """A request's failure as the worker treats a model endpoint's: retryable when
    asking again can help. The message names the status and the error's type, never a
    provider's error body (which may quote the key it was sent)."""
    if isinstance(exc, openai.APIStatusError):
        status = exc.status_code
        retryable = status in _RETRYABLE_STATUS or status >= 500
        return AdapterError(
            f"model request failed: HTTP {status} ({type(exc).__name__})",
            retryable=retryable,
            status=status,
        )
    if isinstance(exc, openai.APIConnectionError):  # a timeout is one too
        return AdapterError(f"model request failed ({type(exc).__name__})", retryable=True)
    if isinstance(exc, TimeoutError):
        return AdapterError("model request took longer than request_timeout_s", retryable=True)
    if isinstance(exc, UserError):
        return ConfigurationError(
            f"the Agents SDK refused the request: {clip(str(exc), 300)}", field="agent"
        )
    # The rest (a response the client could not read, the SDK's ModelBehaviorError):
    # asking again will not help.
    return AdapterError(f"model request failed ({type(exc).__name__})", retryable=False)


#: What :func:`model_error` turns into ratchet errors; anything else propagates.
MODEL_ERRORS = (openai.APIError, AgentsException, TimeoutError)
