"""The run state machine: pure functions from (state, facts) to a new state.

Nothing here performs I/O, reads a clock or draws randomness. Callers (the engine, the
worker) pass in what they observed (``now``, observations, receipts, signed evidence) and
get back a new immutable :class:`RunState` plus, for proposals, what to do next. Every
change appends exactly one trace event with the next sequence number.

Order of the gate in :func:`propose` (first failing check wins):

1. phase: frozen or terminal runs take no proposals (no budget is spent);
2. budget: proposals and wall clock; exhaustion fails the run;
3. the proposal is counted (a rejected proposal still spends budget);
4. schema, deadline, single pending write, permission, scope, environment precondition;
5. step and cost budget; exhaustion fails the run;
6. idempotency key: quarantined keys are refused; a cached key with another intent is a
   conflict; a cached key with the same intent becomes a replay that must be checked
   against the adapter's authoritative receipt;
7. approval: kinds that need one wait in ``awaiting_approval`` unless an exact, fresh,
   trusted approval came with the proposal.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from ratchet.errors import (
    ActionError,
    ApprovalError,
    InvalidTransitionError,
)
from ratchet.runtime.actions import KIND_SPECS, Action, ActionKind, parse_action
from ratchet.runtime.catalog import ToolSpec
from ratchet.runtime.evidence import ApprovalEvidence, TrustRoots
from ratchet.runtime.ports import Observation
from ratchet.runtime.scenario import Scenario, kind_spec_target
from ratchet.runtime.state import (
    STATE_SCHEMA_VERSION,
    TERMINAL_PHASES,
    Event,
    PendingWrite,
    Phase,
    RunState,
    TraceOutcome,
    Usage,
    transition,
)
from ratchet.runtime.tracing import append_event as _with
from ratchet.runtime.tracing import make_event as _event

__all__ = [
    "Disposition",
    "Proposal",
    "approval_deadline_ms",
    "attach_approval",
    "check_executable",
    "new_run",
    "propose",
    "refresh_pending_approval",
    "unprojected",
    "with_projection",
]


class Disposition(StrEnum):
    """What the caller does next with a proposal."""

    REJECTED = "rejected"  # nothing to do; the trace says why
    EXECUTE_WRITE = "execute_write"  # commit the pending intent, then call the adapter
    CHECK_REPLAY = "check_replay"  # commit, then compare the adapter's receipt with the cache
    AWAIT_APPROVAL = "await_approval"  # commit and wait for a fresh exact approval
    READ = "read"  # perform the read-only action, then apply_read
    VERIFY = "verify"  # run the verifier, then apply_verification
    FINISHED = "finished"  # the run ended (completed or failed on budget)


@dataclass(frozen=True, slots=True)
class Proposal:
    state: RunState
    disposition: Disposition
    outcome: TraceOutcome
    action: Action | None = None
    reason: str = ""


def new_run(
    run_id: str,
    scenario: Scenario,
    observation: Observation,
    now: int,
    *,
    document_digest: str | None = None,
) -> RunState:
    """The initial state of a run on an observed environment. ``document_digest`` binds
    the signed run document the run was created from into every checkpoint."""
    state = RunState(
        schema_version=STATE_SCHEMA_VERSION,
        run_id=run_id,
        task_id=scenario.task_id,
        task_version=scenario.task_version,
        policy_id=scenario.policy_id,
        policy_version=scenario.policy_version,
        scenario_fingerprint=scenario.fingerprint,
        document_digest=document_digest,
        phase=Phase.RUNNING,
        usage=Usage(),
        started_at=now,
        environment=observation,
    )
    return _with(
        state,
        _event(
            state, now, TraceOutcome.STARTED, detail={"env_instance_id": observation.instance_id}
        ),
    )


# --- proposals ---------------------------------------------------------------------------


def _reject(
    state: RunState, now: int, outcome: TraceOutcome, reason: str, action: Action | None = None
) -> Proposal:
    event = _event(state, now, outcome, action=action, detail={"reason": reason})
    return Proposal(_with(state, event), Disposition.REJECTED, outcome, action, reason)


def _exhaust(state: RunState, now: int, which: str, action: Action | None = None) -> Proposal:
    event = _event(
        state, now, TraceOutcome.BUDGET_EXHAUSTED, action=action, detail={"budget": which}
    )
    phase = transition(state.phase, Event.BUDGET_EXHAUSTED)
    new = _with(state, event, phase=phase, stop_reason=f"budget exhausted: {which}", pending=None)
    return Proposal(new, Disposition.FINISHED, TraceOutcome.BUDGET_EXHAUSTED, action, which)


def propose(
    state: RunState,
    scenario: Scenario,
    raw: Action | dict[str, Any],
    *,
    now: int,
    generation: int,
    approval: ApprovalEvidence | None = None,
    approvers: TrustRoots | None = None,
    agent_state: dict[str, Any] | None = None,
    tools: Mapping[str, ToolSpec] | None = None,
) -> Proposal:
    """Gate one proposal. See the module docstring for the order of checks.

    ``agent_state``, when given, replaces the agent's own JSON state in whatever this
    proposal commits (it is validated with the state before the commit). ``tools`` are the
    declared tools' contracts by name (:class:`ratchet.runtime.catalog.ToolCatalog`): a
    permitted tool's call is checked against its contract (risk, then arguments, which
    are normalised to what its model dumps) and rejected as ``rejected_schema`` otherwise.

    Raises:
        InvalidTransitionError: the run is terminal (nothing is recorded).
    """
    if state.phase in TERMINAL_PHASES:
        raise InvalidTransitionError(
            f"run is {state.phase.value}; it takes no proposals", phase=state.phase.value
        )
    budgets = scenario.budgets
    if (
        state.phase is not Phase.RUNNING
        or state.usage.proposals >= budgets.proposals
        or (now - state.started_at > budgets.wall_clock_seconds)
    ):
        if agent_state is not None:
            state = state.model_copy(update={"agent_state": agent_state})
        if state.phase is not Phase.RUNNING:
            return _reject(
                state,
                now,
                TraceOutcome.REJECTED_PHASE,
                f"run is {state.phase.value}: proposals are frozen",
            )
        if state.usage.proposals >= budgets.proposals:
            return _exhaust(state, now, "proposals")
        return _exhaust(state, now, "wall_clock_seconds")
    # The agent's state and the proposal count change together: one copy.
    counted: dict[str, Any] = {
        "usage": state.usage.model_copy(update={"proposals": state.usage.proposals + 1})
    }
    if agent_state is not None:
        counted["agent_state"] = agent_state
    state = state.model_copy(update=counted)
    try:
        action = raw if isinstance(raw, Action) else parse_action(raw)
    except ActionError as exc:
        return _reject(state, now, TraceOutcome.REJECTED_SCHEMA, exc.message)
    if now > action.deadline_at:
        return _reject(
            state, now, TraceOutcome.REJECTED_DEADLINE, "proposal deadline has passed", action
        )
    if state.pending is not None:
        return _reject(
            state, now, TraceOutcome.REJECTED_PENDING, "a pending write must finish first", action
        )
    if action.kind not in scenario.permissions:
        return _reject(
            state,
            now,
            TraceOutcome.REJECTED_PERMISSION,
            f"{action.kind!s} is not permitted",
            action,
        )
    if not action.is_builtin:
        checked = _check_tool_call(action, tools)
        if isinstance(checked, str):
            return _reject(state, now, TraceOutcome.REJECTED_SCHEMA, checked, action)
        action = checked
    for name in KIND_SPECS[action.kind].path_args if isinstance(action.kind, ActionKind) else ():
        if not scenario.path_allowed(action.text(name)):
            return _reject(
                state,
                now,
                TraceOutcome.REJECTED_SCOPE,
                f"path {action.text(name)!r} is outside allowed_paths",
                action,
            )
    target = kind_spec_target(action.kind, action.args)
    if target is not None and not scenario.target_allowed(action.kind, target):
        return _reject(
            state,
            now,
            TraceOutcome.REJECTED_SCOPE,
            f"target {target!r} is not allow-listed",
            action,
        )
    if action.expected_env_version != state.environment.version:
        return _reject(
            state,
            now,
            TraceOutcome.REJECTED_STALE_ENV,
            f"planned against environment version {action.expected_env_version}, "
            f"current is {state.environment.version}",
            action,
        )
    if action.kind is ActionKind.FINISH:
        return _finish(state, now, action)
    if state.usage.steps >= budgets.steps:
        return _exhaust(state, now, "steps", action)
    if state.usage.cost_units + action.cost_units > budgets.cost_units:
        return _exhaust(state, now, "cost_units", action)
    state = state.model_copy(
        update={
            "usage": state.usage.model_copy(
                update={
                    "steps": state.usage.steps + 1,
                    "cost_units": state.usage.cost_units + action.cost_units,
                }
            )
        }
    )
    if not action.is_write:
        disposition = (
            Disposition.VERIFY if action.kind is ActionKind.RUN_VERIFIER else Disposition.READ
        )
        # Reads and verifications leave no trace until their result is applied.
        return Proposal(state, disposition, TraceOutcome.READ, action)
    return _propose_write(
        state,
        scenario,
        action,
        now=now,
        generation=generation,
        approval=approval,
        approvers=approvers,
    )


def _check_tool_call(action: Action, tools: Mapping[str, ToolSpec] | None) -> Action | str:
    """A declared tool's call checked against the tool's contract: the action with its
    arguments normalised, or why it is refused."""
    spec = (tools or {}).get(str(action.kind))
    if spec is None or spec.builtin:
        return f"no tool named {action.kind!s} is installed"
    if action.risk is not spec.risk:
        return f"tool {spec.name} has risk {spec.risk.value}, not {action.risk.value}"
    try:
        args = spec.validate_args(action.args)
    except ActionError as exc:
        return exc.message
    return action if args == action.args else action.model_copy(update={"args": args})


def unprojected(proposal: Proposal) -> PendingWrite | None:
    """The new pending write ``proposal`` plans whose one-commit environment is still to
    be projected (by the adapter, through the caller), or None: nothing to project (not a
    new write, or a replay of a cached key, which has no new effect to project).

    The caller asks the adapter once and passes the answer to :func:`with_projection`
    before committing the proposal's state. An adapter that cannot say leaves it None;
    recovery then settles the write by its receipt alone.
    """
    pending = proposal.state.pending
    if (
        proposal.disposition in (Disposition.EXECUTE_WRITE, Disposition.AWAIT_APPROVAL)
        and pending is not None
        and pending.replay_of is None
        and pending.env_after is None
        and pending.action == proposal.action
    ):
        return pending
    return None


def with_projection(proposal: Proposal, env_after: Observation | None) -> Proposal:
    """``proposal`` with its new pending write's one-commit environment set (see
    :func:`unprojected`)."""
    pending = proposal.state.pending
    if pending is None or env_after is None:
        return proposal
    state = proposal.state.model_copy(
        update={"pending": pending.model_copy(update={"env_after": env_after})}
    )
    return replace(proposal, state=state)


def _propose_write(
    state: RunState,
    scenario: Scenario,
    action: Action,
    *,
    now: int,
    generation: int,
    approval: ApprovalEvidence | None,
    approvers: TrustRoots | None,
) -> Proposal:
    key = action.idempotency_key
    intent = action.intent_digest
    if key in state.quarantined_keys:
        return _reject(
            state,
            now,
            TraceOutcome.REJECTED_KEY_QUARANTINED,
            "key was quarantined by a reviewer; plan with a new key",
            action,
        )
    cached = state.cached(key) if key else None
    if cached is not None and cached.intent_digest != intent:
        return _reject(
            state,
            now,
            TraceOutcome.REJECTED_KEY_CONFLICT,
            "key was already used for a different intent",
            action,
        )
    env = state.environment
    pending = PendingWrite(
        action=action,
        intent_digest=intent,
        env_before=env,
        env_after=None,  # projected by the caller: see unprojected()
        replay_of=cached.receipt_fingerprint if cached is not None else None,
    )
    disposition = Disposition.CHECK_REPLAY if cached is not None else Disposition.EXECUTE_WRITE
    accepted = _with(
        state,
        _event(
            state,
            now,
            TraceOutcome.ACCEPTED_PENDING,
            action=action,
            detail={"replay": int(cached is not None)},
        ),
        pending=pending,
    )
    if not scenario.needs_approval(action.kind):
        return Proposal(accepted, disposition, TraceOutcome.ACCEPTED_PENDING, action)
    if approval is not None and approvers is not None:
        try:
            approved = attach_approval(
                accepted, scenario, approval, approvers, generation=generation, now=now
            )
        except ApprovalError as exc:
            waiting = _await(accepted, now, action, f"approval refused: {exc.message}")
            return Proposal(
                waiting,
                Disposition.AWAIT_APPROVAL,
                TraceOutcome.REJECTED_APPROVAL,
                action,
                exc.message,
            )
        return Proposal(approved, disposition, TraceOutcome.ACCEPTED_PENDING, action)
    waiting = _await(accepted, now, action, "approval required")
    return Proposal(waiting, Disposition.AWAIT_APPROVAL, TraceOutcome.AWAITING_APPROVAL, action)


def _await(state: RunState, now: int, action: Action, reason: str) -> RunState:
    event = _event(
        state, now, TraceOutcome.AWAITING_APPROVAL, action=action, detail={"reason": reason}
    )
    return _with(state, event, phase=transition(state.phase, Event.APPROVAL_NEEDED))


def _finish(state: RunState, now: int, action: Action) -> Proposal:
    report = state.verification
    env = state.environment
    ok = (
        report is not None
        and report.passed
        and report.env_instance_id == env.instance_id
        and report.env_version == env.version
        and report.env_fingerprint == env.fingerprint
        and (
            state.last_write_env_version is None
            or report.env_version >= state.last_write_env_version
        )
        and any(e.outcome is TraceOutcome.VERIFIED and e.verifier == report for e in state.trace)
    )
    if not ok:
        return _reject(
            state,
            now,
            TraceOutcome.REJECTED_UNVERIFIED,
            "no passing verifier event at the current environment version",
            action,
        )
    event = _event(
        state,
        now,
        TraceOutcome.COMPLETED,
        action=action,
        detail={"summary": action.text("summary")[:1024]},
    )
    new = _with(
        state,
        event,
        phase=transition(state.phase, Event.COMPLETE),
        stop_reason="completed",
        plan_cursor=state.plan_cursor + 1,
    )
    return Proposal(new, Disposition.FINISHED, TraceOutcome.COMPLETED, action)


# --- approvals ---------------------------------------------------------------------------


def _check_approval(
    state: RunState,
    scenario: Scenario,
    evidence: ApprovalEvidence,
    approvers: TrustRoots,
    *,
    generation: int,
    now: int,
) -> PendingWrite:
    pending = state.pending
    if pending is None:
        raise ApprovalError("there is no pending write to approve", reason="no_pending")
    if pending.receipt is not None:
        raise ApprovalError("the pending write already has a receipt", reason="has_receipt")
    approvers.verify_approval(evidence)
    c, action, env = evidence.claims, pending.action, state.environment
    bound = {
        "task_id": (c.task_id, scenario.task_id),
        "run_id": (c.run_id, state.run_id),
        "policy": ((c.policy_id, c.policy_version), (scenario.policy_id, scenario.policy_version)),
        "action_id": (c.action_id, action.action_id),
        "idempotency_key": (c.idempotency_key, action.idempotency_key),
        "intent_digest": (c.intent_digest, pending.intent_digest),
        "env_instance_id": (c.env_instance_id, env.instance_id),
        "env_fingerprint": (c.env_fingerprint, env.fingerprint),
        "env_version": (c.env_version, env.version),
        "generation": (c.generation, generation),
    }
    for name, (claimed, actual) in bound.items():
        if claimed != actual:
            raise ApprovalError(
                f"approval is bound to another {name}", reason="binding", field=name
            )
    if c.nonce in state.consumed_nonces:
        raise ApprovalError(
            "approval nonce was already consumed", reason="replayed_nonce", nonce=c.nonce
        )
    if c.expired(now=now, proposals_used=state.usage.proposals):
        raise ApprovalError("approval has expired", reason="expired")
    return pending


def attach_approval(
    state: RunState,
    scenario: Scenario,
    evidence: ApprovalEvidence,
    approvers: TrustRoots,
    *,
    generation: int,
    now: int,
) -> RunState:
    """Bind a fresh, exact, trusted approval to the pending write and consume its nonce.

    Any approval the pending write held before is sealed in the trace. Raises
    ApprovalError (``reason`` says which check failed); the state is then unchanged.
    """
    pending = _check_approval(state, scenario, evidence, approvers, generation=generation, now=now)
    phase = state.phase
    if phase is Phase.AWAITING_APPROVAL:
        phase = transition(phase, Event.APPROVAL_GRANTED)
    elif phase is not Phase.RUNNING:
        raise ApprovalError(f"run is {phase.value}; approvals are not accepted", reason="phase")
    event = _event(
        state,
        now,
        TraceOutcome.APPROVAL_REFRESHED,
        action=pending.action,
        detail={"approver_id": evidence.approver_id, "approval_digest": evidence.digest},
        sealed_approval=pending.approval,
    )
    return _with(
        state,
        event,
        phase=phase,
        pending=pending.model_copy(update={"approval": evidence}),
        consumed_nonces=(*state.consumed_nonces, evidence.claims.nonce),
    )


refresh_pending_approval = attach_approval


def check_executable(
    state: RunState, scenario: Scenario, *, now: int, approvers: TrustRoots | None = None
) -> RunState | None:
    """Decide whether the pending write may be sent to the adapter now.

    Returns None when it may. Otherwise returns the new state: an approval-requiring write
    whose approval is missing, expired, or signed by an approver revoked since (checked
    when ``approvers`` is given) is frozen in ``awaiting_approval`` with the evidence
    still visible.
    """
    pending = state.pending
    if pending is None or pending.receipt is not None:
        raise InvalidTransitionError("there is no pending write to execute")
    if state.phase is not Phase.RUNNING:
        raise InvalidTransitionError(
            f"run is {state.phase.value}; nothing may execute", phase=state.phase.value
        )
    if not scenario.needs_approval(pending.action.kind):
        return None
    approval = pending.approval
    revoked = (
        approval is not None
        and approvers is not None
        and approvers.is_revoked(approval.approver_id)
    )
    if (
        approval is not None
        and not revoked
        and not approval.claims.expired(now=now, proposals_used=state.usage.proposals)
    ):
        return None
    reason = (
        "approval missing"
        if approval is None
        else "approver revoked"
        if revoked
        else "approval expired"
    )
    event = _event(
        state, now, TraceOutcome.APPROVAL_EXPIRED, action=pending.action, detail={"reason": reason}
    )
    return _with(state, event, phase=transition(state.phase, Event.APPROVAL_NEEDED))


def approval_deadline_ms(state: RunState, scenario: Scenario) -> int:
    """For a state whose approved pending write may be sent next, the approval's expiry
    in store milliseconds: the store refuses the commit after it, by its own clock, so
    an engine whose clock is wrong still cannot commit the write for execution late. 0
    for every other state."""
    pending = state.pending
    if (
        pending is None
        or pending.receipt is not None
        or pending.approval is None
        or state.phase is not Phase.RUNNING
        or not scenario.needs_approval(pending.action.kind)
    ):
        return 0
    # ``expired`` means ``now > expires_at`` in whole seconds: the last valid instant is
    # the end of that second.
    return pending.approval.claims.expires_at * 1000 + 999
