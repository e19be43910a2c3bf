"""What the framework integrations share: a model-driven agent whose model responses are
journaled in its signed state and whose tool calls are actions of declared ratchet tools.

An integration (:mod:`~ratchet.integrations.pydantic_ai`,
:mod:`~ratchet.integrations.openai_agents`) supplies one method,
:meth:`JournaledAgent._ask`: one model request, made through its framework, from the
journal, the outcomes gathered for the last response (or a note for the model), returning
the new journal and either the response's tool calls or its final output. The rest is
here, once:

* **the step** (:meth:`JournaledAgent.next_step`): read the last proposal's outcome from
  the view, propose the next call of the journaled response, or ask the model, check the
  response's calls against their ratchet contracts together (one that does not fit: none
  runs, each is answered why), propose the first one, or propose the output's
  verification and ``finish``;
* **the state** (:class:`JournalState`): the journal (text: a framework's messages may
  hold floats, which the signed state does not admit), the calls still to propose, the
  answers gathered, the proposal awaited, counters;
* **the journal's bound** (:func:`fit_journal`): the first request and the newest
  exchanges, dropped whole from a model response on;
* **the tools** (:mod:`ratchet.integrations._tools`): a declared ratchet tool that calls
  a framework's tool function, which reads its call from ``current_call()``;
* **budgets** (:func:`charge`): a step's model tokens as the proposal's cost units.

Order within a step, and why: the outcome is judged from the view before anything is
asked (never from the agent's notes); a response is journaled in the state returned with
the proposal it led to, so both are committed together, with the call's intent, before
anything is sent. A worker that dies after the commit resumes from the journal; one that
dies before it asks again (nothing of the response left the process).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Literal, Self, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from ratchet.agents import AgentStep, AgentView, make_action, step_key
from ratchet.agents.conversation import Awaiting as _Told
from ratchet.agents.conversation import clip, describe_outcome
from ratchet.errors import ActionError, ConfigurationError, ContractError, IntegrityError
from ratchet.runtime.actions import ActionKind
from ratchet.runtime.canonical import canonical_json
from ratchet.runtime.catalog import ToolSpec

__all__ = [
    "BUILTIN_NAMES",
    "Answer",
    "Asked",
    "Awaiting",
    "Call",
    "JournalConfig",
    "JournalState",
    "JournaledAgent",
    "RawCall",
    "charge",
    "fit_journal",
]

#: Names a framework's tool may not take: the built-in action kinds.
BUILTIN_NAMES = frozenset(kind.value for kind in ActionKind)
_MAX_ANSWER_BYTES = 16 * 1024
_MAX_SUMMARY_BYTES = 4000
_SKIPPED = "not run: an earlier call of the same response did not go through"

# -- configuration and state --------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class JournalConfig(_Strict):
    """The ``agent_config`` keys every journaled agent takes (an unknown key is refused)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    prompt: StrictStr | None = Field(default=None, min_length=1, max_length=65536)
    verify_target: StrictStr | None = Field(default=None, min_length=1, max_length=64)
    tokens_per_cost_unit: StrictInt | None = Field(default=None, ge=1)
    max_history_bytes: StrictInt = Field(default=256 * 1024, ge=4096, le=768 * 1024)
    max_malformed: StrictInt = Field(default=5, ge=0, le=100)
    deadline_s: StrictInt = Field(default=600, ge=1, le=86400)

    @classmethod
    def parse(cls, config: Mapping[str, Any]) -> Self:
        """The configuration, checked.

        Raises:
            ConfigurationError: one line, ``field="agent_config.<key>"``.
        """
        try:
            return cls.model_validate(dict(config))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(["agent_config", *(str(p) for p in first["loc"])])
            raise ConfigurationError(f"{where}: {first['msg']}", field=where) from None

    @classmethod
    def for_run(cls, config: Mapping[str, Any], wrapped_prompt: str | None) -> Self:
        """The configuration (:meth:`parse`), its prompt the run's or else the one the
        agent was wrapped with.

        Raises:
            ConfigurationError: the configuration is refused, or neither names a prompt.
        """
        parsed = cls.parse(config)
        prompt = parsed.prompt or wrapped_prompt
        if prompt is None:
            raise ConfigurationError(
                "agent_config.prompt is needed (the agent was wrapped without a prompt)",
                field="agent_config.prompt",
            )
        return parsed.model_copy(update={"prompt": prompt})


class Call(_Strict):
    """A tool call of the last model response, still to be proposed."""

    id: StrictStr
    name: StrictStr
    args: dict[str, Any]


class Answer(_Strict):
    """A call's outcome as the model will be told it: done (``ok``) or failed. ``name``
    is the tool's (None in states written before it was kept)."""

    ok: StrictBool
    text: StrictStr
    name: StrictStr | None = None


class Awaiting(_Strict):
    """The proposal whose outcome the next step reads. ``id`` is the tool call it
    answers; None for the ``run_verifier`` or ``finish`` proposed for the output."""

    id: StrictStr | None
    name: StrictStr
    write: StrictBool
    key: StrictStr | None = None


class JournalState(_Strict):
    """The agent's JSON state (``view.agent_state``), validated on every step.

    ``journal`` is the conversation as the framework serializes it (kept as text: its
    numbers are not all integers, and the state admits no floats); ``model_requests``
    counts the model requests whose responses the journal took in; ``dropped`` the
    messages the bound dropped.
    """

    #: Whose state this is, for the refusal of another's ("a Pydantic AI agent's").
    whose: ClassVar[str] = "a journaled agent's"

    version: Literal[1] = 1
    journal: StrictStr = ""
    batch: list[Call] = Field(default_factory=list)
    answers: dict[str, Answer] = Field(default_factory=dict)
    awaiting: Awaiting | None = None
    output: StrictStr | None = None
    malformed: StrictInt = Field(default=0, ge=0)
    model_requests: StrictInt = Field(default=0, ge=0)
    dropped: StrictInt = Field(default=0, ge=0)

    @classmethod
    def load(cls, raw: Mapping[str, Any]) -> Self:
        """The state as the agent last committed it (a new one for ``{}``).

        Raises:
            IntegrityError: ``field="agent_state"``: the state is not this agent's.
        """
        if not raw:
            return cls()
        try:
            return cls.model_validate(dict(raw))
        except ValidationError as exc:
            where = ".".join(str(p) for p in exc.errors()[0]["loc"])
            raise IntegrityError(
                f"agent_state is not {cls.whose} state (at {where or 'top'})",
                field="agent_state",
            ) from None

    def dump(self) -> dict[str, Any]:
        dumped: dict[str, Any] = self.model_dump(mode="json")
        return dumped


S = TypeVar("S", bound=JournalState)


@dataclass(frozen=True, slots=True)
class RawCall:
    """A call as the model made it, before its ratchet contract is checked: its
    arguments, or why they could not be read (``problem``)."""

    id: str
    name: str
    args: Mapping[str, Any] | None
    problem: str | None = None


@dataclass(frozen=True, slots=True)
class Asked(Generic[S]):
    """What one model request brought: the state with the response journaled, and the
    response's calls, or its final output (text), or neither with a ``problem`` the
    model is told (an answer that does not fit the agent's output type), or neither
    and no problem (a response with nothing to act on: the model is asked again).
    ``tokens`` and ``requests`` are the request's usage."""

    state: S
    calls: Sequence[RawCall] = ()
    output: str | None = None
    problem: str | None = None
    tokens: int = 0
    requests: int = 1


def fit_journal(
    items: Sequence[Any],
    *,
    head: int,
    starts: Sequence[int],
    dump: Callable[[list[Any]], str],
    limit: int,
) -> tuple[str, int]:
    """``items`` as journal text within ``limit`` bytes, and how many were dropped: the
    first ``head`` items (the first request) and the newest from one of ``starts`` (where
    a model response begins) on, the oldest window that fits.

    Raises:
        ContractError: not even the newest exchange fits.
    """
    kept = list(items)
    text = dump(kept)
    dropped = 0
    if len(text.encode()) > limit:
        for start in starts:
            if start <= head:
                continue
            window = [*kept[:head], *kept[start:]]
            text = dump(window)
            if len(text.encode()) <= limit:
                dropped = start - head
                break
    if len(text.encode()) > limit:
        raise ContractError(
            f"the conversation takes more than max_history_bytes ({limit}) even with "
            "its older exchanges dropped",
            field="agent_config.max_history_bytes",
        )
    return text, dropped


def charge(action: dict[str, Any], tokens: int, per_unit: int | None) -> dict[str, Any]:
    """``action`` with the step's model tokens added to its ``cost_units`` (rounded up)."""
    if per_unit is None or tokens <= 0:
        return action
    units = math.ceil(tokens / per_unit) + int(action.get("cost_units") or 0)
    return {**action, "cost_units": units}


# -- the step ---------------------------------------------------------------------------------


class JournaledAgent(abc.ABC, Generic[S]):
    """The ratchet agent of a framework's agent (see the module docstring). Built by the
    factory in every job; everything that must outlive a job is in the state."""

    def __init__(self, config: JournalConfig, state_type: type[S]) -> None:
        self.config = config
        self.state_type = state_type

    def next_step(self, view: AgentView) -> AgentStep | None:
        """Read the last proposal's outcome, then propose the next call of the journaled
        response, or the output's verification or finish, or ask the model.

        Raises:
            IntegrityError: ``view.agent_state`` is not this agent's state.
            ContractError: the conversation does not fit ``max_history_bytes``.
            AdapterError: the model request failed (nothing is committed).
            ConfigurationError: the framework refused the run.
        """
        state = self.state_type.load(view.agent_state)
        specs = {spec.name: spec for spec in view.tools}
        answers = dict(state.answers)
        batch = list(state.batch)
        note: str | None = None
        awaiting = state.awaiting
        state = state.model_copy(update={"awaiting": None})
        if awaiting is not None:
            told = _Told.model_validate(awaiting.model_dump())
            text, done = describe_outcome(view, told)
            if awaiting.id is not None:
                answers[awaiting.id] = Answer(
                    ok=done, text=clip(text, _MAX_ANSWER_BYTES), name=awaiting.name
                )
                if done:
                    state = state.model_copy(update={"malformed": 0})
                else:
                    answers.update({c.id: _skipped(c) for c in batch})
                    batch = []
            elif awaiting.name == "run_verifier" and view.verified and state.output is not None:
                return self._finish(view, state, state.output, answers, tokens=0)
            elif awaiting.name == "run_verifier":
                note = (
                    "The run's verification did not pass after your answer "
                    f"({clip(text, 2000)}). Fix what it needs, then answer again."
                )
            else:
                note = f"Your answer could not finish the run: {clip(text, 2000)}"
        tokens = 0
        while True:
            if batch:
                call = batch.pop(0)
                spec = specs.get(call.name)
                if spec is not None:
                    return self._propose_call(view, state, batch, answers, call, spec, tokens)
                # Offered when the response came, not permitted now: told, not proposed.
                answers[call.id] = Answer(
                    ok=False, text="the tool is not permitted", name=call.name
                )
                answers.update({c.id: _skipped(c) for c in batch})
                batch = []
                state = state.model_copy(update={"malformed": state.malformed + 1})
                continue
            final = self._tool_output(answers) if answers and note is None else None
            if final is not None:
                # The answers stay in the state: the journal's calls still need them if the
                # model is asked again (a verification that fails, a refused finish).
                return self._output(view, state, final, answers, tokens)
            if state.malformed > self.config.max_malformed:
                return None
            offered = {name: spec for name, spec in specs.items() if name != "finish"}
            asked = self._ask(state, offered, answers, note)
            note, answers = None, {}
            tokens += asked.tokens
            state = asked.state.model_copy(
                update={"model_requests": state.model_requests + asked.requests}
            )
            if asked.problem is not None:
                note = asked.problem
                state = state.model_copy(update={"malformed": state.malformed + 1})
                continue
            if asked.calls:
                ready, refused = _check(asked.calls, specs)
                if refused:
                    answers = refused
                    state = state.model_copy(update={"malformed": state.malformed + 1})
                    continue
                batch = ready
                continue
            if asked.output is None:  # nothing to act on: asked again, within the bound
                state = state.model_copy(update={"malformed": state.malformed + 1})
                continue
            return self._output(view, state, asked.output, {}, tokens)

    @abc.abstractmethod
    def _ask(
        self,
        state: S,
        offered: Mapping[str, ToolSpec],
        answers: Mapping[str, Answer],
        note: str | None,
    ) -> Asked[S]:
        """One model request: the journal, then the ``answers`` to the last response's
        calls (in order), or ``note`` as a user message, or (a new run) the prompt; the
        model is offered ``offered``. Raises what :meth:`next_step` documents."""

    def _tool_output(self, answers: Mapping[str, Answer]) -> str | None:
        """The run's output read off a response's call outcomes (a framework whose agent
        stops at a tool), or None: the model is asked again. Called once every call of a
        response has its answer."""
        return None

    # -- proposing ----------------------------------------------------------------------------

    def _output(
        self, view: AgentView, state: S, output: str, answers: dict[str, Answer], tokens: int
    ) -> AgentStep | None:
        """Propose the run's ``output``: its verification first (``verify_target``, when
        the environment is not verified), then ``finish``. ``answers`` are the last
        response's, kept for the model until it is asked again."""
        state = state.model_copy(update={"output": clip(output, _MAX_SUMMARY_BYTES)})
        specs = {spec.name for spec in view.tools}
        target = self.config.verify_target
        if target is not None and not view.verified and "run_verifier" in specs:
            action = make_action(
                view,
                view.usage.proposals,
                "run_verifier",
                {"target": target},
                deadline_s=self.config.deadline_s,
            )
            waiting = Awaiting(id=None, name="run_verifier", write=False)
            return self._step(action, state, waiting, [], answers, tokens)
        if "finish" not in specs:
            return None
        return self._finish(view, state, state.output or "", answers, tokens=tokens)

    def _propose_call(
        self,
        view: AgentView,
        state: S,
        batch: list[Call],
        answers: dict[str, Answer],
        call: Call,
        spec: ToolSpec,
        tokens: int,
    ) -> AgentStep:
        position = view.usage.proposals
        if spec.builtin:
            text_args = {k: v for k, v in call.args.items() if isinstance(v, str)}
            action = make_action(
                view, position, spec.name, text_args, deadline_s=self.config.deadline_s
            )
        else:
            action = {
                "action_id": f"{view.run_id}-s{position}-p{view.usage.proposals + 1}",
                "kind": spec.name,
                "risk": spec.risk.value,
                "args": call.args,
                "idempotency_key": step_key(view, position) if spec.is_write else None,
                "expected_env_version": view.observation.version,
                "deadline_at": view.now + self.config.deadline_s,
            }
        waiting = Awaiting(
            id=call.id, name=spec.name, write=spec.is_write, key=action["idempotency_key"]
        )
        return self._step(action, state, waiting, batch, answers, tokens)

    def _finish(
        self, view: AgentView, state: S, summary: str, answers: dict[str, Answer], *, tokens: int
    ) -> AgentStep:
        action = make_action(
            view,
            view.usage.proposals,
            "finish",
            {"summary": summary or "done"},
            deadline_s=self.config.deadline_s,
        )
        waiting = Awaiting(id=None, name="finish", write=False)
        return self._step(action, state, waiting, [], answers, tokens)

    def _step(
        self,
        action: dict[str, Any],
        state: S,
        waiting: Awaiting,
        batch: list[Call],
        answers: dict[str, Answer],
        tokens: int,
    ) -> AgentStep:
        new = state.model_copy(update={"awaiting": waiting, "batch": batch, "answers": answers})
        return AgentStep(charge(action, tokens, self.config.tokens_per_cost_unit), new.dump())


def _skipped(call: Call) -> Answer:
    return Answer(ok=False, text=_SKIPPED, name=call.name)


def _check(
    calls: Sequence[RawCall], specs: Mapping[str, ToolSpec]
) -> tuple[list[Call], dict[str, Answer]]:
    """A response's calls, checked against their ratchet contracts together: when one
    does not fit, none runs (each is answered why)."""
    ready: list[Call] = []
    errors: dict[str, str] = {}
    for raw in calls:
        spec = specs.get(raw.name)
        if spec is None:
            errors[raw.id] = f"there is no tool named {clip(raw.name, 64)!r}"
            continue
        if raw.args is None:
            errors[raw.id] = raw.problem or "the call's arguments could not be read"
            continue
        try:
            checked = spec.validate_args(raw.args)
            canonical_json(checked)
        except (ActionError, ContractError) as exc:
            errors[raw.id] = exc.message
            continue
        ready.append(Call(id=raw.id, name=spec.name, args=dict(checked)))
    if not errors:
        return ready, {}
    refused = {
        raw.id: Answer(
            ok=False,
            text=errors.get(raw.id, "not run: another call of the response was refused"),
            name=raw.name,
        )
        for raw in calls
    }
    return [], refused
