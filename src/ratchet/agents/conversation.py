"""The conversation a :class:`~ratchet.agents.tool_calling.ToolCallingAgent` keeps in its
state: OpenAI chat messages, bounded, plus what it still has to carry out, and how a
proposal's outcome is told to the model (:func:`describe_outcome`).

The state is plain JSON (no floats) because the runtime signs and commits it with each
proposal. Bounds, so a checkpoint never grows with the run:

* every text kept in a message (a reply, a tool's result, a call's arguments) is cut to
  ``max_message_bytes`` (a cut call's arguments become a small JSON object saying so,
  so the history stays valid JSON for servers that parse it);
* only the last ``max_messages`` messages are kept, and fewer when they would take more
  than ``max_history_bytes``; a window never opens with a ``tool`` message (its call
  was dropped with the assistant message that made it). The system prompt and the
  task are not kept at all: they come from the agent's configuration on every request;
* the calls queued from one reply are at most ``max_tool_calls_per_turn - 1``, each with
  arguments of at most ``max_argument_bytes`` (larger ones are refused, not kept).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from ratchet.errors import IntegrityError
from ratchet.runtime.canonical import canonical_json
from ratchet.runtime.state import TraceOutcome

if TYPE_CHECKING:
    from ratchet.agents import AgentView

__all__ = [
    "Awaiting",
    "ConversationState",
    "LastWrite",
    "QueuedCall",
    "clip",
    "clip_arguments",
    "describe_outcome",
    "trim",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class QueuedCall(_Strict):
    """A tool call of the last reply that is still to be carried out."""

    id: StrictStr
    name: StrictStr
    arguments: StrictStr


class Awaiting(_Strict):
    """The proposal whose outcome the next step reports to the model.

    ``id`` is the tool call it answers (None: a final answer proposed as ``finish``);
    ``key`` the idempotency key it was proposed with (writes only)."""

    id: StrictStr | None
    name: StrictStr
    write: bool
    key: StrictStr | None = None


class LastWrite(_Strict):
    """The last write proposed: its position, tool and arguments' digest. The same call
    again is the same write (same position, so the same key)."""

    position: StrictInt = Field(ge=0)
    name: StrictStr
    digest: StrictStr


class ConversationState(_Strict):
    """The agent's JSON state (``view.agent_state``), validated on every step."""

    version: Literal[1] = 1
    messages: list[dict[str, Any]] = Field(default_factory=list)
    queue: list[QueuedCall] = Field(default_factory=list)
    awaiting: Awaiting | None = None
    last_write: LastWrite | None = None
    malformed: StrictInt = Field(default=0, ge=0)
    dropped: StrictInt = Field(default=0, ge=0)

    @classmethod
    def load(cls, raw: dict[str, Any]) -> ConversationState:
        """The state as the agent last committed it (a new one for ``{}``).

        Raises:
            IntegrityError: ``field="agent_state"``: the state is not this agent's.
        """
        if not raw:
            return cls()
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise IntegrityError(
                f"agent_state is not a tool_calling agent's state (at {where or 'top'})",
                field="agent_state",
            ) from None

    def dump(self) -> dict[str, Any]:
        dumped: dict[str, Any] = self.model_dump(mode="json")
        return dumped


def clip(text: str, max_bytes: int) -> str:
    """``text`` cut to at most ``max_bytes`` UTF-8 bytes plus a short marker."""
    raw = text.encode("utf-8")
    if len(raw) <= max_bytes:
        return text
    kept = raw[:max_bytes].decode("utf-8", "ignore")
    return f"{kept}…[cut {len(raw) - len(kept.encode('utf-8'))} bytes]"


def clip_arguments(arguments: str, max_bytes: int) -> str:
    """Arguments kept in the history: as written when short, else a JSON object that
    says they were cut (so the history stays parseable)."""
    if len(arguments.encode("utf-8")) <= max_bytes:
        return arguments
    return json.dumps({"cut": clip(arguments, max_bytes // 2)}, ensure_ascii=False)


def trim(
    messages: list[dict[str, Any]], *, max_messages: int, max_history_bytes: int
) -> tuple[list[dict[str, Any]], int]:
    """The last messages within both bounds, never opening on a ``tool`` message, and
    how many were dropped."""
    start = max(0, len(messages) - max_messages)
    sizes = [len(canonical_json(m)) + 1 for m in messages]
    total = sum(sizes[start:])
    while start < len(messages) and (
        total > max_history_bytes or messages[start].get("role") == "tool"
    ):
        total -= sizes[start]
        start += 1
    return messages[start:], start


def describe_outcome(view: AgentView, awaiting: Awaiting) -> tuple[str, bool]:
    """The previous proposal's outcome as the model reads it, and whether it was
    carried out. Judged from the view (receipts, trace, verification), never from
    the agent's own notes."""
    last = view.last_outcome
    facts: dict[str, Any] = {
        "outcome": last.value,
        "environment_version": view.observation.version,
    }
    if awaiting.write:
        if awaiting.key is not None and awaiting.key in view.executed_keys:
            if last is TraceOutcome.REPLAYED:
                facts["note"] = "this call had taken effect already; it was not repeated."
            return json.dumps({"status": "done", **facts}), True
        note = {
            TraceOutcome.REVIEW_REPLANNED: "a reviewer refused this write; it did not "
            "happen. Plan it again if it is still needed.",
            TraceOutcome.EXECUTION_ERROR: "the tool refused the call; it had no effect.",
        }.get(last, "it did not happen.")
        return json.dumps({"status": "not done", "note": note, **facts}), False
    if last is TraceOutcome.VERIFIED and awaiting.name == "run_verifier":
        return json.dumps({"status": "done", "passed": view.verified, **facts}), True
    if last is TraceOutcome.READ:
        if view.last_read is not None:
            return view.last_read, True
        note = (
            "the result is not kept across a restart of the run; call it again if "
            "it is still needed."
        )
        return json.dumps({"status": "done", "note": note, **facts}), True
    if last is TraceOutcome.REJECTED_UNVERIFIED:
        note = (
            "the run can finish only after a passing verification at the current "
            "environment version."
        )
        return json.dumps({"status": "refused", "note": note, **facts}), False
    return json.dumps({"status": "refused", **facts}), False
