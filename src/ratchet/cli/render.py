"""How runs are shown to operators: one summary row, the full JSON view, rich panels."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from ratchet.errors import RatchetError
from ratchet.runtime import ApprovalEvidence
from ratchet.worker.context import Fleet
from ratchet.worker.ops import RunView, inspect_run

__all__ = ["approval_status", "render_run", "run_summary", "run_to_json"]


def approval_status(evidence: ApprovalEvidence, *, now: int, proposals_used: int) -> str:
    """``valid`` or ``EXPIRED (...)``: expired evidence stays visible, clearly marked."""
    claims = evidence.claims
    if now > claims.expires_at:
        return f"EXPIRED (wall clock, {now - claims.expires_at}s ago)"
    if proposals_used > claims.max_proposals:
        return f"EXPIRED (proposal count {proposals_used} > {claims.max_proposals})"
    return f"valid for {claims.expires_at - now}s"


def run_summary(fleet: Fleet, run_id: str) -> dict[str, Any]:
    """One row of ``ratchet runs``; a run whose checkpoint does not verify says so."""
    row: dict[str, Any] = {"run_id": run_id}
    try:
        snap = fleet.store.read_run(run_id)
        row.update(owner=snap.owner if snap.lease_live else None,
                   generation=snap.generation,
                   lease=(f"{(snap.expires_at_ms - snap.now_ms) / 1000:.1f}s left"
                          if snap.lease_live else "free"))
        view = inspect_run(fleet, run_id)
        row["phase"] = view.state.phase.value
        if view.incidents:
            row["note"] = f"{len(view.incidents)} incident(s)"
    except RatchetError as exc:
        row.update(phase=None, note=f"unverifiable: {exc.message}")
    except Exception as exc:
        row.update(phase=None, note=f"unreadable: {type(exc).__name__}")
    return row


def run_to_json(view: RunView, now: int) -> dict[str, Any]:
    state = view.state
    snap = view.snapshot
    data: dict[str, Any] = {
        "run_id": state.run_id,
        "phase": state.phase.value,
        "stop_reason": state.stop_reason,
        "generation": view.generation,
        "lease": {"owner": snap.owner, "lease_version": snap.lease_version,
                  "live": snap.lease_live, "expires_at_ms": snap.expires_at_ms},
        "task": {"task_id": state.task_id, "task_version": state.task_version,
                 "policy_id": state.policy_id, "policy_version": state.policy_version},
        "budgets": {"used": state.usage.model_dump(),
                    "limits": view.document.scenario.budgets.model_dump()},
        "environment": state.environment.model_dump(mode="json"),
        "pending": None,
        "review": None,
        "executed": [e.model_dump(mode="json") for e in state.executed],
        "quarantined_keys": list(state.quarantined_keys),
        "incidents": view.incidents,
        "trace": [e.model_dump(mode="json", exclude_none=True) for e in state.trace],
    }
    if state.pending is not None:
        pending = state.pending.model_dump(mode="json")
        if state.pending.approval is not None:
            pending["approval_status"] = approval_status(
                state.pending.approval, now=now, proposals_used=state.usage.proposals)
        data["pending"] = pending
    if state.review is not None:
        data["review"] = state.review.model_dump(mode="json")
    return data


def render_run(console: Console, view: RunView, now: int) -> None:
    state = view.state
    snap = view.snapshot
    head = Table(title=f"run {state.run_id}", show_header=False)
    head.add_row("phase", state.phase.value + (f" ({state.stop_reason})"
                                               if state.stop_reason else ""))
    head.add_row("task / policy", f"{state.task_id} v{state.task_version} / "
                 f"{state.policy_id} v{state.policy_version}")
    head.add_row("generation", str(view.generation))
    head.add_row("lease", f"{snap.owner or '-'} v{snap.lease_version} "
                 f"({'live' if snap.lease_live else 'free'})")
    limits = view.document.scenario.budgets
    used = state.usage
    head.add_row("budgets", f"proposals {used.proposals}/{limits.proposals}, steps "
                 f"{used.steps}/{limits.steps}, cost {used.cost_units}/{limits.cost_units}")
    env = state.environment
    head.add_row("environment", f"{env.instance_id} v{env.version} {env.fingerprint[:16]}")
    console.print(head)
    if state.pending is not None:
        pending = state.pending
        table = Table(title="pending write", show_header=False)
        table.add_row("action", f"{pending.action.action_id} ({pending.action.kind.value})")
        table.add_row("idempotency key", pending.action.idempotency_key or "-")
        table.add_row("intent digest", pending.intent_digest)
        if pending.approval is not None:
            table.add_row("approval", f"{pending.approval.approver_id}: " + approval_status(
                pending.approval, now=now, proposals_used=used.proposals))
        else:
            table.add_row("approval", "none")
        console.print(table)
        if state.phase.value == "awaiting_approval":
            console.print(f"to approve: ratchet approve {state.run_id} "
                          f"{pending.action.action_id} --key APPROVER_KEY.pem", markup=False)
    if state.review is not None:
        case = state.review
        table = Table(title=f"review case {case.case_id} ({case.reason.value})",
                      show_header=False)
        table.add_row("pending intent digest", case.pending.intent_digest)
        table.add_row("receipt intent digest",
                      case.receipt.intent_digest if case.receipt else "(no receipt)")
        table.add_row("receipt fingerprint", case.receipt_fingerprint or "-")
        if case.receipt is not None:
            table.add_row("receipt", f"{case.receipt.namespace} v{case.receipt.receipt_version}"
                          f" {case.receipt.receipt_id} {case.receipt.result}")
        console.print(table)
        console.print(f"to decide: ratchet review {state.run_id} --decision replan|abort "
                      "--key REVIEWER_KEY.pem", markup=False)
    if state.executed:
        table = Table(title="executed writes")
        for column in ("key", "receipt", "intent digest"):
            table.add_column(column, overflow="fold")
        for entry in state.executed:
            table.add_row(entry.idempotency_key, f"{entry.receipt.namespace}/"
                          f"{entry.receipt.receipt_id}", entry.intent_digest[:16])
        console.print(table)
    for incident in view.incidents:
        console.print(f"incident: {incident.get('kind')} {incident.get('reason')}: "
                      f"{incident.get('message')}", markup=False)
    trace = Table(title="trace")
    for column in ("seq", "outcome", "action", "env"):
        trace.add_column(column)
    for event in state.trace:
        trace.add_row(str(event.seq), event.outcome.value, event.action_id or "-",
                      str(event.env_version))
    console.print(trace)
