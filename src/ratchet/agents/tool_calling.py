"""A model-driven agent: a chat model with tools proposes each step (``tool_calling``).

Each step the agent shows the model the conversation so far and the tools the run may
use (``view.tools``: names, descriptions, JSON Schemas, built-in kinds included), and
turns the model's first tool call into a proposal. The runtime does everything else:
gates it, commits the intent, sends it with its key and fence, records the receipt. The
outcome goes back to the model as a ``tool`` message on the next step.

Configuration (the run's ``agent_config``; :class:`ToolCallingConfig`)::

    {"model": {"kind": "openai", "base_url": "https://api.openai.com/v1",
               "model": "gpt-4o-mini", "credential": "openai"},
     "system_prompt": "You fix the greeting in app.py, run the tests, then finish."}

or ``{"model": {"kind": "scripted", "replies": [...]}, ...}`` for a script of replies.

``credential`` names one of the worker's credentials (``RATCHET_CREDENTIALS``; see
:mod:`ratchet.agents.credentials`): the worker decides which secret that is and whether
it may go to ``base_url``. ``api_key_env`` (an environment variable's name, as the task
chose it) is no longer read: a configuration that still has it is refused.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from ratchet.agents import AgentStep, AgentView, make_action, step_key
from ratchet.agents.conversation import (
    Awaiting,
    ConversationState,
    LastWrite,
    QueuedCall,
    clip,
    clip_arguments,
    describe_outcome,
    trim,
)
from ratchet.agents.credentials import CredentialResolver, CredentialUse
from ratchet.agents.models import (
    Model,
    ModelReply,
    ModelRequest,
    OpenAIChatModel,
    ScriptedModel,
)
from ratchet.errors import ActionError, ConfigurationError, ContractError
from ratchet.runtime.canonical import canonical_json, digest, strict_json_loads
from ratchet.runtime.catalog import ToolSpec

__all__ = ["DEFAULT_TASK", "ToolCallingAgent", "ToolCallingConfig"]

#: The first user message when the configuration names no task.
DEFAULT_TASK = "Start the task. Use the tools; answer with a short summary when it is done."

# The domain of the digest that recognises a repeated write (not an intent digest: it
# never leaves the agent's state).
_CALL_DOMAIN = b"ratchet/agent-call/v1"
_SKIPPED = json.dumps(
    {"status": "not run", "note": "an earlier call of the same reply did not go through"}
)
_NOT_RUN_MALFORMED = json.dumps(
    {"status": "not run", "note": "another call of the same reply was malformed; none ran"}
)
_EMPTY_REPLY = "Reply with a tool call, or with your final answer as text."
_MAX_CALL_ID = 128


def _error(reason: str) -> str:
    return json.dumps({"status": "error", "error": reason}, ensure_ascii=False)


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class _OpenAIConfig(_Strict):
    kind: Literal["openai"]
    base_url: StrictStr = Field(min_length=1, max_length=2048)
    model: StrictStr = Field(min_length=1, max_length=200)
    # The worker's credential sent as the bearer key (None: no Authorization header).
    credential: StrictStr | None = Field(default=None, min_length=1, max_length=128)
    # No longer read (a task chose the variable): parsed only to be refused by name.
    api_key_env: StrictStr | None = None
    timeout_s: StrictInt = Field(default=60, ge=1, le=3600)
    max_retries: StrictInt = Field(default=3, ge=0, le=10)


class _ScriptedConfig(_Strict):
    kind: Literal["scripted"]
    replies: list[ModelReply] = Field(min_length=1)


class ToolCallingConfig(_Strict):
    """The ``tool_calling`` agent's configuration (strict: an unknown key is refused)."""

    model: Annotated[_OpenAIConfig | _ScriptedConfig, Field(discriminator="kind")]
    system_prompt: StrictStr = Field(min_length=1, max_length=65536)
    task: StrictStr = Field(default=DEFAULT_TASK, min_length=1, max_length=65536)
    max_tool_calls_per_turn: StrictInt = Field(default=4, ge=1, le=16)
    max_messages: StrictInt = Field(default=40, ge=2, le=1000)
    max_malformed: StrictInt = Field(default=5, ge=0, le=100)

    @classmethod
    def parse(cls, config: dict[str, Any]) -> ToolCallingConfig:
        """The configuration, checked.

        Raises:
            ConfigurationError: one line, ``field="agent_config.<path>"``.
        """
        try:
            parsed = cls.model_validate(config)
        except ValidationError as exc:
            first = exc.errors()[0]
            loc = [str(p) for p in first["loc"]]
            if len(loc) > 1 and loc[0] == "model" and loc[1] in ("openai", "scripted"):
                del loc[1]  # the union's tag, not a key the author wrote
            where = ".".join(["agent_config", *loc])
            raise ConfigurationError(f"{where}: {first['msg']}", field=where) from None
        if isinstance(parsed.model, _OpenAIConfig) and parsed.model.api_key_env is not None:
            where = "agent_config.model.api_key_env"
            raise ConfigurationError(
                f"{where} is no longer read: name one of the worker's credentials "
                "(RATCHET_CREDENTIALS) in agent_config.model.credential instead",
                field=where,
            )
        return parsed

    def credential_uses(self) -> list[CredentialUse]:
        """The worker credential the model would send, and where (none for a script)."""
        model = self.model
        if isinstance(model, _OpenAIConfig) and model.credential is not None:
            return [
                CredentialUse("agent_config.model.credential", model.credential, model.base_url)
            ]
        return []


class ToolCallingAgent:
    """Asks a chat model for each step and proposes the tool call it answers with.

    **State.** The conversation (OpenAI messages, without the system prompt and the task,
    which come from the configuration) lives in the agent's JSON state: the runtime signs
    it and commits it with each proposal, and hands it back on resume, after a crash, in
    any process, so the model continues where it was. It records what the agent meant
    and what it was told; it is never evidence of what happened outside. Whether a write
    took effect is read from ``view.executed_keys`` and ``view.last_outcome`` every time,
    never from the notes. The state is bounded (:mod:`ratchet.agents.conversation`):
    the last ``max_messages`` messages within ``max_history_bytes``, each text cut to
    ``max_message_bytes``.

    **One step.** First the outcome of the previous proposal is appended (a ``tool``
    message answering its call: done or not, the environment version, what a read
    returned when this job still has it). Then the next call queued from the model's
    last reply is proposed, if any is left; otherwise the model is asked. Of a reply's
    tool calls the first is proposed now and the others (up to
    ``max_tool_calls_per_turn`` in all) wait in the state for the next steps; when one of
    them does not go through, the rest are answered "not run" and the model is asked
    again. A reply with text and no tool call is the final answer: it is proposed as
    ``finish`` with the text as summary when ``finish`` is offered; otherwise the agent
    has nothing to propose (None).

    **Keys.** A write's idempotency key is ``step_key(view, position)``, where the
    position is the run's proposal count when the write is first proposed: it comes from
    the signed run state, never from the model's output, and no two different writes
    share one (the plan cursor would not do: it stays put when a write is refused, and a
    tool ledger keeps the refused key). The same write proposed again (same tool, same
    arguments as the last write) keeps its position, so a model that repeats itself,
    after a crash or otherwise, proposes the same key and the runtime answers from the
    receipt without a second effect. So two identical writes in a row are one write: a
    deliberate second effect needs arguments that differ (an order reference).

    **Malformed calls.** Arguments that are not JSON, not an object, larger than
    ``max_argument_bytes`` or not fit for the tool's schema, a tool not offered, or an
    empty reply are answered with an error message to the model, not raised. A reply's
    calls are checked together: when one is malformed none of them runs. Each such reply
    counts against ``max_malformed`` (kept in the state, reset when a call is carried
    out); beyond it the agent gives up (None).

    A model error (:mod:`ratchet.agents.models`) propagates: nothing of the step is
    committed and the worker retries the job later.

    Raises (constructor):
        ConfigurationError: a bound out of range.
    """

    def __init__(
        self,
        model: Model,
        *,
        system_prompt: str,
        task: str = DEFAULT_TASK,
        max_tool_calls_per_turn: int = 4,
        max_messages: int = 40,
        max_malformed: int = 5,
        max_message_bytes: int = 16 * 1024,
        max_history_bytes: int = 256 * 1024,
        max_argument_bytes: int = 64 * 1024,
        deadline_s: int = 600,
    ) -> None:
        if not system_prompt:
            raise ConfigurationError("system_prompt must not be empty", field="system_prompt")
        for name, value, low in (
            ("max_tool_calls_per_turn", max_tool_calls_per_turn, 1),
            ("max_messages", max_messages, 2),
            ("max_malformed", max_malformed, 0),
            ("max_message_bytes", max_message_bytes, 256),
            ("max_history_bytes", max_history_bytes, 1024),
            ("max_argument_bytes", max_argument_bytes, 256),
            ("deadline_s", deadline_s, 1),
        ):
            if value < low:
                raise ConfigurationError(f"{name} must be at least {low}", field=name)
        self.model = model
        self.system_prompt = system_prompt
        self.task = task
        self.max_tool_calls_per_turn = max_tool_calls_per_turn
        self.max_messages = max_messages
        self.max_malformed = max_malformed
        self.max_message_bytes = max_message_bytes
        self.max_history_bytes = max_history_bytes
        self.max_argument_bytes = max_argument_bytes
        self.deadline_s = deadline_s

    def __repr__(self) -> str:
        return f"ToolCallingAgent(model={self.model!r})"

    @classmethod
    def from_config(
        cls, config: dict[str, Any], *, credentials: CredentialResolver | None = None
    ) -> ToolCallingAgent:
        """The agent a run's ``agent_config`` describes (see :class:`ToolCallingConfig`).
        A model's ``credential`` is bound through ``credentials`` (the building process's
        own map) to ``base_url`` here, before anything is sent; its secret is read when a
        request is made.

        Raises:
            ConfigurationError: the configuration is refused (one line, naming the field),
                or its credential is (not defined here, not for ``base_url``, none here).
        """
        parsed = ToolCallingConfig.parse(config)
        spec = parsed.model
        model: Model
        if isinstance(spec, _OpenAIConfig):
            key = None
            for use in parsed.credential_uses():
                if credentials is None:
                    raise ConfigurationError(
                        f"{use.field} names a credential, and no credentials are configured "
                        "where this agent is built (RATCHET_CREDENTIALS)",
                        field=use.field,
                    )
                key = credentials.bind(use.name, use.url, field=use.field)
            model = OpenAIChatModel(
                spec.base_url,
                spec.model,
                api_key=key,
                timeout=float(spec.timeout_s),
                max_retries=spec.max_retries,
            )
        else:
            model = ScriptedModel(spec.replies)
        return cls(
            model,
            system_prompt=parsed.system_prompt,
            task=parsed.task,
            max_tool_calls_per_turn=parsed.max_tool_calls_per_turn,
            max_messages=parsed.max_messages,
            max_malformed=parsed.max_malformed,
        )

    # -- what the model is shown ------------------------------------------------------------

    @staticmethod
    def offered(tools: tuple[ToolSpec, ...]) -> list[dict[str, Any]]:
        """``tools`` as OpenAI function tools: name, description, JSON Schema."""
        return [
            {
                "type": "function",
                "function": {
                    "name": spec.name,
                    "description": spec.description,
                    "parameters": spec.json_schema,
                },
            }
            for spec in tools
        ]

    def _preamble(self) -> list[dict[str, Any]]:
        return [
            {"role": "system", "content": self.system_prompt},
            {"role": "user", "content": self.task},
        ]

    def _tool_message(self, call_id: str, content: str) -> dict[str, Any]:
        return {
            "role": "tool",
            "tool_call_id": call_id,
            "content": clip(content, self.max_message_bytes),
        }

    def _assistant(self, reply: ModelReply, calls: list[QueuedCall]) -> dict[str, Any]:
        content = reply.content
        message: dict[str, Any] = {
            "role": "assistant",
            "content": None if content is None else clip(content, self.max_message_bytes),
        }
        if calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": clip(c.name, 256),
                        "arguments": clip_arguments(c.arguments, self.max_message_bytes),
                    },
                }
                for c in calls
            ]
        return message

    # -- the step -----------------------------------------------------------------------------

    def next_step(self, view: AgentView) -> AgentStep | None:
        """Report the last outcome, then propose the next queued call or ask the model.

        Raises:
            IntegrityError: ``view.agent_state`` is not this agent's state.
            AdapterError, ConfigurationError: from the model (nothing is committed).
        """
        state = ConversationState.load(view.agent_state)
        specs = {spec.name: spec for spec in view.tools}
        messages = list(state.messages)
        queue = list(state.queue)
        malformed = state.malformed
        if state.awaiting is not None:
            text, carried_out = describe_outcome(view, state.awaiting)
            if state.awaiting.id is None:
                messages.append({"role": "user", "content": clip(text, self.max_message_bytes)})
            else:
                messages.append(self._tool_message(state.awaiting.id, text))
            if carried_out:
                malformed = 0
            else:
                messages += [self._tool_message(c.id, _SKIPPED) for c in queue]
                queue = []
        while True:
            while queue:
                call = queue.pop(0)
                checked = self._check(call, specs)
                if isinstance(checked, str):  # a call checked when queued: the tools changed
                    messages.append(self._tool_message(call.id, _error(checked)))
                    messages += [self._tool_message(c.id, _SKIPPED) for c in queue]
                    queue, malformed = [], malformed + 1
                    break
                spec, args = checked
                return self._propose(view, state, messages, queue, malformed, call.id, spec, args)
            if malformed > self.max_malformed:
                return None
            messages, dropped = self._trim(messages)
            state = state.model_copy(update={"dropped": state.dropped + dropped})
            reply = self.model(
                ModelRequest(messages=self._preamble() + messages, tools=self.offered(view.tools))
            )
            calls = self._calls(reply, view)
            messages.append(self._assistant(reply, calls))
            if calls:
                taken = calls[: self.max_tool_calls_per_turn]
                too_many = json.dumps(
                    {
                        "status": "not run",
                        "note": f"at most {self.max_tool_calls_per_turn} calls of one reply run",
                    }
                )
                messages += [self._tool_message(c.id, too_many) for c in calls[len(taken) :]]
                # A reply's calls are checked together: one malformed call and none runs,
                # so the queue only ever holds checked calls (bounded arguments).
                ready: list[QueuedCall] = []
                errors: dict[str, str] = {}
                for c in taken:
                    result = self._check(c, specs)
                    if isinstance(result, str):
                        errors[c.id] = result
                    else:
                        spec, args = result
                        text = canonical_json(args).decode()
                        ready.append(QueuedCall(id=c.id, name=spec.name, arguments=text))
                if errors:
                    for c in taken:
                        error = errors.get(c.id)
                        content = _NOT_RUN_MALFORMED if error is None else _error(error)
                        messages.append(self._tool_message(c.id, content))
                    malformed += 1
                    continue
                queue = ready
                continue
            if reply.content is not None and reply.content.strip():
                finish = specs.get("finish")
                if finish is None:
                    return None
                summary = {"summary": clip(reply.content, 4000)}
                return self._propose(view, state, messages, [], malformed, None, finish, summary)
            messages.append({"role": "user", "content": _EMPTY_REPLY})
            malformed += 1

    def _trim(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
        return trim(
            messages, max_messages=self.max_messages, max_history_bytes=self.max_history_bytes
        )

    def _calls(self, reply: ModelReply, view: AgentView) -> list[QueuedCall]:
        """The reply's tool calls with ids fit to echo (a missing or overlong id, or one
        used twice in the reply, is replaced by one made from the proposal count)."""
        calls: list[QueuedCall] = []
        seen: set[str] = set()
        for index, call in enumerate(reply.tool_calls):
            call_id = call.id
            if not call_id or len(call_id) > _MAX_CALL_ID or call_id in seen:
                call_id = f"call_{view.usage.proposals}_{index}"
            seen.add(call_id)
            calls.append(QueuedCall(id=call_id, name=call.name[:128], arguments=call.arguments))
        return calls

    def _check(
        self, call: QueuedCall, specs: dict[str, ToolSpec]
    ) -> tuple[ToolSpec, dict[str, Any]] | str:
        """The tool and its arguments (normalised by its model), or why not, for the model."""
        spec = specs.get(call.name)
        if spec is None:
            return f"there is no tool named {clip(call.name, 64)!r}; the tools are {sorted(specs)}"
        size = len(call.arguments.encode("utf-8"))
        if size > self.max_argument_bytes:
            return f"the arguments take {size} bytes; at most {self.max_argument_bytes} are taken"
        try:
            value = strict_json_loads(call.arguments.strip() or "{}")
        except ContractError as exc:
            return f"the arguments are not JSON: {exc.message}"
        if not isinstance(value, dict):
            return "the arguments must be a JSON object"
        try:
            args: dict[str, Any] = spec.validate_args(value)
        except ActionError as exc:
            return exc.message
        return spec, args

    def _propose(
        self,
        view: AgentView,
        state: ConversationState,
        messages: list[dict[str, Any]],
        queue: list[QueuedCall],
        malformed: int,
        call_id: str | None,
        spec: ToolSpec,
        args: dict[str, Any],
    ) -> AgentStep:
        position = view.usage.proposals
        last_write = state.last_write
        if spec.is_write:
            # The same call as the last write is that write again: its position, its key.
            seen = digest(_CALL_DOMAIN, {"tool": spec.name, "args": args})
            if last_write is not None and (last_write.name, last_write.digest) == (
                spec.name,
                seen,
            ):
                position = last_write.position
            last_write = LastWrite(position=position, name=spec.name, digest=seen)
        action = self._action(view, position, spec, args)
        kept, dropped = self._trim(messages)
        new = state.model_copy(
            update={
                "messages": kept,
                "queue": queue,
                "awaiting": Awaiting(
                    id=call_id,
                    name=spec.name,
                    write=spec.is_write,
                    key=action["idempotency_key"],
                ),
                "last_write": last_write,
                "malformed": malformed,
                "dropped": state.dropped + dropped,
            }
        )
        return AgentStep(action, new.dump())

    def _action(
        self, view: AgentView, position: int, spec: ToolSpec, args: dict[str, Any]
    ) -> dict[str, Any]:
        if spec.builtin:  # the built-in kinds' arguments are text (checked by their model)
            text = {k: v for k, v in args.items() if isinstance(v, str)}
            return make_action(view, position, spec.name, text, deadline_s=self.deadline_s)
        return {
            "action_id": f"{view.run_id}-s{position}-p{view.usage.proposals + 1}",
            "kind": spec.name,
            "risk": spec.risk.value,
            "args": args,
            "idempotency_key": step_key(view, position) if spec.is_write else None,
            "expected_env_version": view.observation.version,
            "deadline_at": view.now + self.deadline_s,
        }
