"""How runs are shown to operators: one summary row, the full JSON view, rich panels."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ratchet.fleet.context import Fleet
from ratchet.leasing.listing import ListedRun
from ratchet.ops import RunView
from ratchet.ops.diagnosis import diagnose
from ratchet.runtime import ApprovalEvidence
from ratchet.runtime.state import TERMINAL_PHASES

__all__ = ["approval_status", "render_diagnosis", "render_run", "run_summary", "run_to_json"]


def approval_status(evidence: ApprovalEvidence, *, now: int, proposals_used: int) -> str:
    """``valid`` or ``EXPIRED (...)``: expired evidence stays visible, clearly marked."""
    claims = evidence.claims
    if now > claims.expires_at:
        return f"EXPIRED (wall clock, {now - claims.expires_at}s ago)"
    if proposals_used > claims.max_proposals:
        return f"EXPIRED (proposal count {proposals_used} > {claims.max_proposals})"
    return f"valid for {claims.expires_at - now}s"


_ENDED = frozenset(p.value for p in TERMINAL_PHASES)


def run_summary(
    row: ListedRun, now_ms: int, hosts: Mapping[str, bool] | None = None
) -> dict[str, Any]:
    """One row of ``ratchet runs`` (and of the console's list), from a listing row: what
    the index and the run's hashes say, nothing verified (``ratchet show`` verifies). A
    row that could not be read says so in ``note``. ``hosts`` (host -> alive) marks a
    run whose host is gone as waiting for it."""
    out: dict[str, Any] = {
        "host": row.host,
        "run_id": row.run_id,
        "phase": row.phase,
        "listed_at_ms": row.listed_at_ms,
        "task_id": row.task_id,
        "owner": row.owner,
        "generation": row.generation,
        "failures": row.incidents,
        "last_failure": row.last_incident,
    }
    if row.problem is not None:
        out.update(lease="-", note=row.problem)
        return out
    if row.owner is not None and row.expires_at_ms is not None:
        out["lease"] = f"{(row.expires_at_ms - now_ms) / 1000:.1f}s left"
    else:
        out["lease"] = "free"
    gone = (
        row.host is not None
        and hosts is not None
        and not hosts.get(row.host, False)
        and row.owner is None
        and row.phase not in _ENDED
    )
    out["waiting_for_host"] = gone
    if row.phase is None:
        out["note"] = "no phase recorded (created before phase indexes: ratchet store init)"
    elif gone:
        out["note"] = f"waiting for host {row.host} (gone: no worker of it alive)"
    elif row.incidents:
        out["note"] = f"{row.incidents} incident(s), latest {row.last_incident or '?'}"
    return out


def run_to_json(view: RunView, now: int, *, fleet: Fleet | None = None) -> dict[str, Any]:
    """The full JSON view of ``ratchet show --json`` and the console. With ``fleet`` it
    also carries what :func:`ratchet.ops.diagnosis.diagnose` reads (status, current
    incident, last job error, verifier output, timeline, pending change)."""
    state = view.state
    snap = view.snapshot
    data: dict[str, Any] = {
        "run_id": state.run_id,
        "phase": state.phase.value,
        "stop_reason": state.stop_reason,
        "generation": view.generation,
        "lease": {
            "owner": snap.owner,
            "lease_version": snap.lease_version,
            "live": snap.lease_live,
            "expires_at_ms": snap.expires_at_ms,
        },
        "task": {
            "task_id": state.task_id,
            "task_version": state.task_version,
            "policy_id": state.policy_id,
            "policy_version": state.policy_version,
        },
        "budgets": {
            "used": state.usage.model_dump(),
            "limits": view.document.scenario.budgets.model_dump(),
        },
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
                state.pending.approval, now=now, proposals_used=state.usage.proposals
            )
        data["pending"] = pending
    if state.review is not None:
        data["review"] = state.review.model_dump(mode="json")
    if fleet is not None:
        data.update(diagnose(fleet, view))
    return data


def render_run(console: Console, view: RunView, now: int, *, fleet: Fleet | None = None) -> None:
    """The rich text of ``ratchet show``; with ``fleet``, headed by the status and what
    went wrong, and with the timeline in place of the bare trace."""
    diagnosis = diagnose(fleet, view) if fleet is not None else None
    if diagnosis is not None:
        render_diagnosis(console, diagnosis)
    state = view.state
    snap = view.snapshot
    head = Table(title=f"run {state.run_id}", show_header=False)
    head.add_row(
        "phase", state.phase.value + (f" ({state.stop_reason})" if state.stop_reason else "")
    )
    head.add_row(
        "task / policy",
        f"{state.task_id} v{state.task_version} / {state.policy_id} v{state.policy_version}",
    )
    head.add_row("generation", str(view.generation))
    head.add_row(
        "lease",
        f"{snap.owner or '-'} v{snap.lease_version} ({'live' if snap.lease_live else 'free'})",
    )
    limits = view.document.scenario.budgets
    used = state.usage
    head.add_row(
        "budgets",
        f"proposals {used.proposals}/{limits.proposals}, steps "
        f"{used.steps}/{limits.steps}, cost {used.cost_units}/{limits.cost_units}",
    )
    env = state.environment
    head.add_row("environment", f"{env.instance_id} v{env.version} {env.fingerprint[:16]}")
    console.print(head)
    if state.pending is not None:
        pending = state.pending
        table = Table(title="pending write", show_header=False)
        table.add_row("action", f"{pending.action.action_id} ({pending.action.kind!s})")
        table.add_row("idempotency key", pending.action.idempotency_key or "-")
        table.add_row("intent digest", pending.intent_digest)
        if pending.approval is not None:
            table.add_row(
                "approval",
                f"{pending.approval.approver_id}: "
                + approval_status(pending.approval, now=now, proposals_used=used.proposals),
            )
        else:
            table.add_row("approval", "none")
        console.print(table)
        if state.phase.value == "awaiting_approval":
            console.print(
                f"to approve: ratchet approve {state.run_id} "
                f"{pending.action.action_id} --key APPROVER_KEY.pem",
                markup=False,
            )
    if state.review is not None:
        case = state.review
        table = Table(title=f"review case {case.case_id} ({case.reason.value})", show_header=False)
        table.add_row("pending intent digest", case.pending.intent_digest)
        table.add_row(
            "receipt intent digest", case.receipt.intent_digest if case.receipt else "(no receipt)"
        )
        table.add_row("receipt fingerprint", case.receipt_fingerprint or "-")
        if case.receipt is not None:
            table.add_row(
                "receipt",
                f"{case.receipt.namespace} v{case.receipt.receipt_version}"
                f" {case.receipt.receipt_id} {case.receipt.result}",
            )
        console.print(table)
        console.print(
            f"to decide: ratchet review {state.run_id} --decision replan|abort "
            "--key REVIEWER_KEY.pem",
            markup=False,
        )
    if state.executed:
        table = Table(title="executed writes")
        for column in ("key", "receipt", "intent digest"):
            table.add_column(column, overflow="fold")
        for entry in state.executed:
            table.add_row(
                entry.idempotency_key,
                f"{entry.receipt.namespace}/{entry.receipt.receipt_id}",
                entry.intent_digest[:16],
            )
        console.print(table)
    for incident in view.incidents:
        said = " ".join(
            str(incident[k]) for k in ("reason", "message", "operator") if incident.get(k)
        )
        console.print(
            f"incident: {incident.get('kind')}" + (f": {said}" if said else ""), markup=False
        )
    if diagnosis is not None:
        _render_change(console, diagnosis.get("pending_change"))
        _render_timeline(console, diagnosis)
        return
    trace = Table(title="trace")
    for column in ("seq", "outcome", "action", "env"):
        trace.add_column(column)
    for event in state.trace:
        trace.add_row(
            str(event.seq), event.outcome.value, event.action_id or "-", str(event.env_version)
        )
    console.print(trace)


def _ms(at_ms: object) -> str:
    if not isinstance(at_ms, int):
        return "-"
    return datetime.fromtimestamp(at_ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def render_diagnosis(console: Console, diagnosis: dict[str, Any]) -> None:
    """Status, current incident, last job error and verifier output, as rich tables."""
    status = diagnosis.get("status") or {}
    table = Table(title=f"status: {status.get('state')}", show_header=False)
    table.add_row("now", str(status.get("summary") or "-"))
    if status.get("owner"):
        table.add_row(
            "lease",
            f"{status['owner']} v{status.get('lease_version')}, expires "
            f"in {status.get('expires_in_ms')} ms (store's clock)",
        )
    if status.get("worker"):
        table.add_row("worker", str(status["worker"]))
    depth = status.get("queue_depth")
    table.add_row(
        "queue",
        f"{status.get('queue')}: {depth if depth is not None else '?'} "
        "waiting"
        + (f", this run at {status['queue_position']}" if status.get("queue_position") else ""),
    )
    if status.get("why") and str(status["why"]) not in str(status.get("summary")):
        table.add_row("why", str(status["why"]))
    host = status.get("host")
    alive = status.get("host_alive")
    moved = status.get("moved")
    table.add_row(
        "host",
        str(status.get("host_note") or "any host may take it")
        if host is None
        else f"{host} ({'alive' if alive else 'gone' if alive is False else 'unknown'})"
        + (
            f", moved from {moved.get('from')} by {moved.get('by')}"
            if isinstance(moved, dict)
            else ""
        ),
    )
    parts = status.get("environment_parts") or {}
    if parts:
        table.add_row("environment", ", ".join(f"{k}: {v}" for k, v in parts.items()))
    for note in diagnosis.get("notes") or []:
        table.add_row("note", str(note))
    console.print(table)
    incident = diagnosis.get("current_incident")
    if incident:
        console.print(
            Text(f"current incident ({_ms(incident.get('at_ms'))}): {incident.get('summary')}")
        )
    error = diagnosis.get("last_job_error")
    if error:
        table = Table(title="last job error", show_header=False)
        for name in ("error", "message", "where", "attempt", "next"):
            table.add_row(name, str(error.get(name) if error.get(name) is not None else "-"))
        table.add_row("at", _ms(error.get("at_ms")))
        console.print(table)
    output = diagnosis.get("verifier_output")
    if output:
        console.print(
            Text(
                f"verifier output: {output.get('target')} failed ({output.get('message')}); "
                f"exit code {output.get('exit_code')}, timed out {output.get('timed_out')}, "
                f"truncated {output.get('truncated')}; {output.get('binding')}"
            )
        )
        console.print(
            Text(
                f"--- last lines, {output.get('label')} "
                + ("(earlier output cut) " if output.get("tail_cut") else "")
                + "---"
            )
        )
        console.print(Text(str(output.get("tail") or "")), soft_wrap=True)
        console.print(Text("--- end of verifier output ---"))


def _render_change(console: Console, change: dict[str, Any] | None) -> None:
    if not change:
        return
    content = change.get("content") or {}
    head = f"pending {change.get('operation')} {change.get('path') or change.get('target') or ''}: "
    if content:
        head += f"{content.get('bytes')} bytes, {content.get('form')}, sha256 "
        head += str(content.get("sha256", ""))[:16]
    if change.get("scrubbed"):
        head += " (text that looks like a secret is redacted here)"
    console.print(Text(head))
    for note in (change.get("receipt_note"), change.get("current_note"), change.get("diff_note")):
        if note:
            console.print(Text(f"  {note}"))
    if change.get("diff"):
        console.print(Text(str(change["diff"])), soft_wrap=True)
    elif content.get("form") == "text":  # nothing to compare with: the content itself
        console.print(Text(str(content.get("text"))), soft_wrap=True)


def _render_timeline(console: Console, diagnosis: dict[str, Any]) -> None:
    left_out = diagnosis.get("timeline_left_out") or 0
    title = "timeline" + (
        f" (newest {len(diagnosis.get('timeline') or [])}; {left_out} earlier not shown)"
        if left_out
        else ""
    )
    table = Table(title=title)
    for column in ("at (store's clock; trace: upper bound)", "source", "what", "detail"):
        table.add_column(column, overflow="fold")
    for item in diagnosis.get("timeline") or []:
        at = item.get("at_ms")
        when = "<= " + _ms(at)[:-4] if item.get("source") == "trace" else _ms(at)
        source = str(item.get("source"))
        if item.get("seq") is not None:
            source += f" #{item['seq']}"
        table.add_row(
            when, source, Text(str(item.get("what"))), Text(str(item.get("detail") or ""))
        )
    console.print(table)
