"""The ratchet agent of a wrapped OpenAI Agents SDK agent: its configuration, its state,
and the one method the journaled step needs from it (:meth:`OpenAIAgentsAgent._ask`)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import Field, StrictBool, StrictInt
from pydantic_core import to_json

from ratchet.errors import AdapterError, ConfigurationError
from ratchet.integrations._journal import (
    Answer,
    Asked,
    JournalConfig,
    JournaledAgent,
    JournalState,
    fit_journal,
)
from ratchet.integrations.openai_agents._request import (
    MODEL_ERRORS,
    ModelLoop,
    Request,
    model_error,
    output_schema,
    read_response,
)
from ratchet.runtime.catalog import ToolSpec

if TYPE_CHECKING:
    from ratchet.integrations.openai_agents import RatchetAgent

__all__ = ["OpenAIAgentsAgent", "OpenAIAgentsConfig", "OpenAIAgentsState"]

#: Every model request of the process runs on this loop (see :class:`ModelLoop`).
_LOOP = ModelLoop()


class OpenAIAgentsConfig(JournalConfig):
    """A run's ``agent_config`` for a wrapped OpenAI Agents SDK agent (an unknown key is
    refused): the keys of :class:`~ratchet.integrations._journal.JournalConfig`, and
    ``request_timeout_s``, how long one model request may take before it is abandoned
    (a retryable error: the job ends ``retry_later``)."""

    request_timeout_s: StrictInt = Field(default=600, ge=1, le=3600)


class OpenAIAgentsState(JournalState):
    """The agent's JSON state (``view.agent_state``), validated on every step.

    ``journal`` is the conversation as the SDK's input items (Responses API format, the
    runner's ``to_input_list()`` shape), kept as JSON text: a response's items may hold
    floats (log probabilities), and the state admits none. ``used_tools``: the model
    called a tool earlier in the run (the agent's ``reset_tool_choice`` reads it).
    """

    whose: ClassVar[str] = "an OpenAI Agents SDK agent's"

    used_tools: StrictBool = False

    def items(self) -> list[dict[str, Any]]:
        """The journal's input items, oldest first."""
        loaded = json.loads(self.journal) if self.journal else []
        return [dict(item) for item in loaded]


class OpenAIAgentsAgent(JournaledAgent[OpenAIAgentsState]):
    """The ratchet agent of a :class:`~ratchet.integrations.openai_agents.RatchetAgent`.
    Built by the factory in every job; everything that must outlive a job is in the
    state."""

    config: OpenAIAgentsConfig

    def __init__(self, wrapped: RatchetAgent, config: OpenAIAgentsConfig) -> None:
        super().__init__(config, OpenAIAgentsState)
        self.wrapped = wrapped

    def __repr__(self) -> str:
        return f"OpenAIAgentsAgent(agent={self.wrapped.agent.name!r})"

    def _ask(
        self,
        state: OpenAIAgentsState,
        offered: Mapping[str, ToolSpec],
        answers: Mapping[str, Answer],
        note: str | None,
    ) -> Asked[OpenAIAgentsState]:
        items = state.items() or [{"role": "user", "content": self.config.prompt or ""}]
        items += [
            {"type": "function_call_output", "call_id": call_id, "output": answer.text}
            for call_id, answer in answers.items()
        ]
        if note is not None:
            items.append({"role": "user", "content": note})
        agent = self.wrapped.agent
        request = Request(
            agent=agent,
            context=self.wrapped.context,
            run_config=self.wrapped.run_config,
            offered=offered,
            used_tools=state.used_tools,
        )
        failure: AdapterError | ConfigurationError | None = None
        try:
            response = _LOOP.run(request.send(items), timeout_s=self.config.request_timeout_s)
        except MODEL_ERRORS as exc:
            failure = model_error(exc)
        if failure is not None:
            # Raised here, outside the handler: the provider's exception (whose message
            # may quote its error body and the key it was sent) is not its context.
            raise failure
        reading = read_response(response, output_schema(agent))
        journal = [*items, *(dict(item) for item in response.to_input_items())]
        text, dropped = fit_journal(
            journal,
            head=1,
            starts=_response_starts(journal),
            dump=lambda window: to_json(window).decode(),
            limit=self.config.max_history_bytes,
        )
        state = state.model_copy(
            update={
                "journal": text,
                "dropped": state.dropped + dropped,
                "used_tools": state.used_tools or bool(reading.calls),
            }
        )
        usage = response.usage
        return Asked(
            state,
            calls=reading.calls,
            output=reading.output,
            problem=reading.problem,
            tokens=usage.input_tokens + usage.output_tokens,
            requests=max(usage.requests, 1),
        )

    def _tool_output(self, answers: Mapping[str, Answer]) -> str | None:
        """The agent's ``tool_use_behavior``: with ``stop_on_first_tool`` the first call's
        outcome is the run's output, with ``StopAtTools`` the first call of a named tool;
        only when that call was carried out (a failed one is told to the model)."""
        behavior = self.wrapped.agent.tool_use_behavior
        if behavior == "run_llm_again":
            return None
        for answer in answers.values():
            stops = behavior == "stop_on_first_tool" or (
                isinstance(behavior, dict) and answer.name in behavior["stop_at_tool_names"]
            )
            if stops:
                return answer.text if answer.ok else None
        return None


def _is_input(item: Mapping[str, Any]) -> bool:
    """An item the agent wrote (the prompt, a note, a call's output), not the model."""
    return item.get("role") == "user" or item.get("type") == "function_call_output"


def _response_starts(items: Sequence[Mapping[str, Any]]) -> list[int]:
    """Where each model response's items begin."""
    return [i for i in range(1, len(items)) if not _is_input(items[i]) and _is_input(items[i - 1])]
