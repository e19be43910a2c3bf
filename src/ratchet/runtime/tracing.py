"""How every transition records itself: one trace event, the next sequence number."""

from __future__ import annotations

from typing import Any

from ratchet.runtime.actions import Action
from ratchet.runtime.history import grow
from ratchet.runtime.state import RunState, TraceEvent, TraceOutcome

__all__ = ["append_event", "make_event"]


def make_event(
    state: RunState,
    now: int,
    outcome: TraceOutcome,
    *,
    action: Action | None = None,
    intent: str | None = None,
    detail: dict[str, Any] | None = None,
    **extra: Any,
) -> TraceEvent:
    return TraceEvent(
        seq=state.next_seq,
        at=now,
        outcome=outcome,
        action_id=action.action_id if action else None,
        idempotency_key=action.idempotency_key if action else None,
        intent_digest=intent
        if intent is not None
        else (action.intent_digest if action and action.is_write else None),
        env_version=state.environment.version,
        detail=detail or {},
        **extra,
    )


def append_event(state: RunState, event: TraceEvent, **changes: Any) -> RunState:
    """Return ``state`` with ``changes`` applied and ``event`` appended to the trace."""
    return state.model_copy(update={**changes, "trace": grow(state.trace, event)})
