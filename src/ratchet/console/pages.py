"""Server-side HTML of the console. Every value is escaped; no script, no inline style.

Pages: the runs list (filters by phase and owner), one run (timeline, budgets, pending
intent with its approval evidence, review case with both digests and the receipt, the
executed writes, incidents, and the exact commands an operator runs to sign; with the
status, what went wrong, the pending change and the merged timeline of
:mod:`ratchet.console.sections`), the review queue (needs review, then awaiting
approval), and the workers (RQ's registry: state, current run, heartbeat age; the queue's
depth). Nothing here signs or writes: the
commands shown are for the operator's terminal, where the private keys are.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from html import escape
from typing import Any
from urllib.parse import quote, urlencode

from ratchet.console.data import DEFAULT_PAGE, RunListing, RunQuery
from ratchet.console.sections import (
    SECTIONS_CSS,
    change_section,
    problem_sections,
    status_section,
    timeline_section,
    workers_table,
)
from ratchet.runtime import Phase

__all__ = [
    "CSS",
    "approval_badge",
    "approve_command",
    "error_page",
    "review_commands",
    "review_queue_page",
    "run_page",
    "runs_page",
    "workers_page",
]

CSS = """
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:#1d232b;
background:#f6f7f9}
header{background:#1d232b;color:#fff;padding:.7rem 1.4rem;display:flex;gap:1.6rem;
align-items:baseline}
header a{color:#dfe6ee;text-decoration:none}header strong{font-size:1.1rem}
main{padding:1rem 1.4rem;max-width:1200px}
h1{font-size:1.35rem;margin:.4rem 0 1rem}h2{font-size:1.1rem;margin:1.6rem 0 .5rem}
table{border-collapse:collapse;background:#fff;width:100%;margin-bottom:.6rem}
th,td{border:1px solid #d5dbe2;padding:.35rem .55rem;text-align:left;vertical-align:top}
th{background:#eef1f5;font-weight:600}
td.k{width:14rem;color:#4a5563;font-weight:600}
code,pre,.mono{font-family:ui-monospace,"DejaVu Sans Mono",monospace;font-size:13px;
word-break:break-all}
pre{background:#fff;border:1px solid #d5dbe2;padding:.6rem;white-space:pre-wrap;margin:0}
pre.cmd{background:#111820;color:#e8f0f8;border:0;word-break:normal;overflow-wrap:anywhere}
.badge{display:inline-block;padding:0 .45rem;border-radius:.6rem;font-size:12px;
font-weight:700;background:#dde3ea}
.phase-completed{background:#cdebd3}.phase-failed,.phase-cancelled{background:#f3d0d0}
.phase-needs_review{background:#ffd9a8}.phase-awaiting_approval{background:#fff0a8}
.phase-running{background:#cfe3ff}
.expired{background:#c62828;color:#fff}.valid{background:#2e7d32;color:#fff}
.note{color:#6b7480}.warn{background:#fff4e5;border:1px solid #f0b566;padding:.5rem .8rem}
form.filters{display:flex;gap:.8rem;align-items:end;margin-bottom:.8rem}
nav.counts{display:flex;flex-wrap:wrap;gap:.4rem .9rem;margin:.2rem 0 .4rem}
nav.counts a{color:#1d4f91;text-decoration:none}nav.counts a.on{text-decoration:underline}
p.pager{font-weight:600}
form.filters label{display:flex;flex-direction:column;font-size:13px;color:#4a5563}
table.trace td:nth-child(2){white-space:nowrap}
table.trace td:nth-child(4),table.trace td:nth-child(5){min-width:11rem}
table.trace td:last-child{word-break:break-all}
"""
CSS += SECTIONS_CSS  # the run page's status, problem, change and timeline sections


def _e(value: object) -> str:
    return escape("" if value is None else str(value), quote=True)


def _phase(phase: object) -> str:
    name = str(phase) if phase else "unverifiable"
    return f'<span class="badge phase-{_e(name)}">{_e(name)}</span>'


def _run_link(run_id: str) -> str:
    return f'<a href="/runs/{quote(run_id, safe="")}">{_e(run_id)}</a>'


def _kv(rows: Iterable[tuple[str, str]]) -> str:
    body = "".join(f'<tr><td class="k">{_e(k)}</td><td>{v}</td></tr>' for k, v in rows)
    return f"<table>{body}</table>"


def _mono(value: object) -> str:
    return f'<span class="mono">{_e(value) if value is not None else "-"}</span>'


def _when(epoch_s: object) -> str:
    if not isinstance(epoch_s, int):
        return "-"
    return datetime.fromtimestamp(epoch_s, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _layout(title: str, body: str, *, refresh_s: int | None = None) -> str:
    # Auto-refresh without JavaScript: the browser reloads the same URL every refresh_s.
    refresh = f'<meta http-equiv="refresh" content="{int(refresh_s)}">' if refresh_s else ""
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"{refresh}<title>{_e(title)} · ratchet console</title>"
        '<link rel="stylesheet" href="/static/console.css"></head><body>'
        '<header><strong>ratchet console</strong><a href="/runs">runs</a>'
        '<a href="/reviews">review queue</a><a href="/workers">workers</a>'
        '<span class="note">read-only</span>'
        f"</header><main>{body}</main></body></html>"
    )


def approve_command(run_id: str, action_id: str) -> str:
    """The exact command an approver runs (with their own key file)."""
    return f"ratchet approve {shlex.quote(run_id)} {shlex.quote(action_id)} --key APPROVER_KEY.pem"


def review_commands(run_id: str) -> list[str]:
    """The exact commands a reviewer runs: replan or abort."""
    return [
        f"ratchet review {shlex.quote(run_id)} --decision {d} --key REVIEWER_KEY.pem"
        for d in ("replan", "abort")
    ]


def approval_badge(approval: dict[str, Any], *, now: int, proposals_used: int) -> str:
    """EXPIRED (red) or valid (green): expired evidence stays visible, clearly marked."""
    claims = approval.get("claims") or {}
    expires_at = claims.get("expires_at")
    cap = claims.get("max_proposals")
    if isinstance(expires_at, int) and now > expires_at:
        return f'<span class="badge expired">EXPIRED</span> {_e(now - expires_at)}s ago'
    if isinstance(cap, int) and proposals_used > cap:
        return (
            f'<span class="badge expired">EXPIRED</span> proposal count '
            f"{_e(proposals_used)} &gt; {_e(cap)}"
        )
    left = expires_at - now if isinstance(expires_at, int) else "?"
    return f'<span class="badge valid">valid</span> for {_e(left)}s'


def _approval_rows(approval: dict[str, Any], *, now: int, used: int) -> str:
    claims = approval.get("claims") or {}
    return _kv(
        [
            ("status", approval_badge(approval, now=now, proposals_used=used)),
            ("approver", _e(approval.get("approver_id"))),
            ("expires at", _e(_when(claims.get("expires_at")))),
            ("max proposals", _e(claims.get("max_proposals"))),
            ("bound intent digest", _mono(claims.get("intent_digest"))),
            ("bound generation", _e(claims.get("generation"))),
            (
                "bound environment",
                _mono(
                    f"{claims.get('env_instance_id')} "
                    f"v{claims.get('env_version')} "
                    f"{claims.get('env_fingerprint')}"
                ),
            ),
            ("nonce", _mono(claims.get("nonce"))),
            ("signature", _mono(approval.get("signature"))),
        ]
    )


def _receipt_rows(receipt: dict[str, Any] | None, fingerprint: str | None) -> str:
    if receipt is None:
        return _kv(
            [
                ("receipt", "(no receipt at the adapter)"),
                ("receipt fingerprint", _mono(fingerprint)),
            ]
        )
    rows = [("receipt fingerprint", _mono(fingerprint))]
    rows += [(f"receipt {name}", _mono(value)) for name, value in sorted(receipt.items())]
    return _kv(rows)


def _command_block(commands: Sequence[str]) -> str:
    return "".join(f'<pre class="cmd">{_e(c)}</pre>' for c in commands)


SORTS = {"newest": False, "oldest": True}  # the list's orders: name -> oldest first
REFRESH_CHOICES = (0, 10, 30, 60, 300)  # seconds (0: off)


def _when_ms(ms: object) -> str:
    return _when(ms // 1000) if isinstance(ms, int) and ms > 0 else "-"


def _query(**params: object) -> str:
    """A ``/runs`` link keeping the given parameters (empty ones left out)."""
    kept = {k: str(v) for k, v in params.items() if v not in (None, "", 0, False)}
    return "/runs" + (f"?{urlencode(kept)}" if kept else "")


def _counts_bar(listing: RunListing, query: RunQuery, sort: str, refresh: int) -> str:
    """Exact counts per phase, each a link to that phase's list."""
    keep = {"sort": sort if sort != "newest" else "", "refresh": refresh}
    on_all = ' class="on"' if query.phase is None else ""
    links = [f'<a href="{_e(_query(**keep))}"{on_all}>all <strong>{_e(listing.total)}</strong></a>']
    for phase in Phase:
        on = ' class="on"' if query.phase == phase.value else ""
        links.append(
            f'<a href="{_e(_query(phase=phase.value, **keep))}"{on}>'
            f"{_e(phase.value)} <strong>{_e(listing.counts.get(phase.value, 0))}"
            "</strong></a>"
        )
    extra = []
    if listing.unindexed:
        extra.append(
            f'<span class="warn">{_e(listing.unindexed)} runs are in no phase '
            "list (created before phase indexes: run <code>ratchet store init"
            "</code>)</span>"
        )
    depth = "?" if listing.queue_depth is None else listing.queue_depth
    extra.append(f"queue depth <strong>{_e(depth)}</strong>")
    return f'<nav class="counts">{" ".join(links)}</nav><p class="note">{" · ".join(extra)}</p>'


def _failures(row: dict[str, Any]) -> str:
    count = row.get("failures") or 0
    if not count:
        return '<span class="note">0</span>'
    return f'<span class="badge expired">{_e(count)}</span> {_e(row.get("last_failure") or "")}'


def runs_page(
    listing: RunListing,
    query: RunQuery,
    *,
    sort: str = "newest",
    refresh: int = 0,
    notice: str | None = None,
) -> str:
    """The runs list: exact counts per phase, the queue's depth, a search (exact prefix of
    run id, task id or lease owner), the order, optional auto-refresh, one page of rows
    and a link to the next (nothing here is verified: a run's own page verifies)."""
    options = ['<option value="">any</option>'] + [
        f'<option value="{_e(p.value)}"{" selected" if p.value == query.phase else ""}>'
        f"{_e(p.value)}</option>"
        for p in Phase
    ]
    sorts = "".join(
        f'<option value="{_e(name)}"{" selected" if name == sort else ""}>{_e(name)} first</option>'
        for name in SORTS
    )
    refreshes = "".join(
        f'<option value="{n}"{" selected" if n == refresh else ""}>'
        f"{'off' if not n else f'every {n}s'}</option>"
        for n in REFRESH_CHOICES
    )
    form = (
        '<form class="filters" method="get" action="/runs">'
        f'<label>phase<select name="phase">{"".join(options)}</select></label>'
        f'<label>search<input name="q" value="{_e(query.search or "")}" '
        'placeholder="run id, task or owner (prefix)"></label>'
        f'<label>order<select name="sort">{sorts}</select></label>'
        f'<label>refresh<select name="refresh">{refreshes}</select></label>'
        + (
            f'<input type="hidden" name="limit" value="{_e(query.limit)}">'
            if query.limit != DEFAULT_PAGE
            else ""
        )
        + '<button type="submit">show</button></form>'
    )
    body = "".join(
        f"<tr><td>{_run_link(str(r['run_id']))}</td><td>{_phase(r.get('phase'))}</td>"
        f"<td>{_mono(r.get('task_id'))}</td><td>{_mono(r.get('owner'))}</td>"
        f"<td>{_e(r.get('lease') or '-')}</td><td>{_e(r.get('generation'))}</td>"
        f"<td>{_failures(r)}</td><td>{_e(_when_ms(r.get('listed_at_ms')))}</td>"
        f'<td class="note">{_e(r.get("note") or "")}</td></tr>'
        for r in listing.rows
    )
    since = "entered phase" if query.phase else "created"
    table = (
        "<table><tr><th>run</th><th>phase</th><th>task</th><th>owner</th>"
        "<th>lease</th><th>generation</th><th>failures</th>"
        f"<th>{since}</th><th>note</th></tr>{body}</table>"
    )
    keep = {
        "phase": query.phase,
        "q": query.search,
        "sort": sort if sort != "newest" else "",
        "refresh": refresh,
        "limit": query.limit if query.limit != DEFAULT_PAGE else "",
    }
    links = []
    if query.after:
        links.append(f'<a href="{_e(_query(**keep))}">first page</a>')
    if listing.next_cursor:
        label = "continue searching" if query.search else "next page"
        links.append(
            f'<a rel="next" href="{_e(_query(after=listing.next_cursor, **keep))}">'
            f"{label} &rarr;</a>"
        )
    pager = f'<p class="pager">{" · ".join(links)}</p>' if links else ""
    what = f"phase {query.phase}" if query.phase else "all runs"
    if query.search:
        title = (
            f"{len(listing.rows)} matching &ldquo;{_e(query.search)}&rdquo; "
            f'<span class="note">({_e(what)}, {_e(listing.scanned)} examined)</span>'
        )
    else:
        title = f'{len(listing.rows)} runs <span class="note">({_e(what)})</span>'
    warn = f'<p class="warn">{_e(notice)}</p>' if notice else ""
    return _layout(
        "runs",
        f"<h1>{title}</h1>{warn}{_counts_bar(listing, query, sort, refresh)}{form}{table}{pager}",
        refresh_s=refresh or None,
    )


def _trace_rows(trace: list[dict[str, Any]]) -> str:
    body = []
    for event in trace:
        detail = event.get("detail") or {}
        extra = ", ".join(f"{k}={v}" for k, v in sorted(detail.items()))
        if event.get("sealed_approval"):
            extra = (
                (extra + ", " if extra else "")
                + "sealed approval by "
                + str(event["sealed_approval"].get("approver_id"))
            )
        body.append(
            f"<tr><td>{_e(event.get('seq'))}</td><td>{_e(_when(event.get('at')))}</td>"
            f"<td>{_e(event.get('outcome'))}</td><td>{_mono(event.get('action_id'))}</td>"
            f"<td>{_mono(event.get('idempotency_key'))}</td>"
            f"<td>{_e(event.get('env_version'))}</td><td>{_e(extra)}</td></tr>"
        )
    return (
        '<table class="trace"><tr><th>seq</th><th>at</th><th>outcome</th>'
        "<th>action</th><th>key</th>"
        f"<th>env</th><th>detail</th></tr>{''.join(body)}</table>"
    )


def _pending_section(run: dict[str, Any], now: int) -> str:
    pending = run.get("pending")
    if not pending:
        return '<h2>Pending intent</h2><p class="note">none</p>'
    action = pending.get("action") or {}
    used = int((run.get("budgets") or {}).get("used", {}).get("proposals", 0))
    args = json.dumps(action.get("args"), indent=2, sort_keys=True)
    if len(args) > 4000:
        args = args[:4000] + "\n... (truncated)"
    parts = [
        "<h2>Pending intent</h2>",
        _kv(
            [
                (
                    "action",
                    _mono(
                        f"{action.get('action_id')} ({action.get('kind')}, {action.get('risk')})"
                    ),
                ),
                ("idempotency key", _mono(action.get("idempotency_key"))),
                ("intent digest", _mono(pending.get("intent_digest"))),
                ("arguments", f"<pre>{_e(args)}</pre>"),
            ]
        ),
    ]
    approval = pending.get("approval")
    parts.append("<h2>Approval evidence</h2>")
    if approval:
        parts.append(_approval_rows(approval, now=now, used=used))
    else:
        parts.append('<p class="note">no approval attached</p>')
    if run.get("phase") == Phase.AWAITING_APPROVAL.value:
        parts.append("<p>To approve exactly this write, on the approver's machine:</p>")
        parts.append(
            _command_block([approve_command(str(run["run_id"]), str(action.get("action_id")))])
        )
    return "".join(parts)


def _review_section(run: dict[str, Any]) -> str:
    case = run.get("review")
    if not case:
        return ""
    pending = case.get("pending") or {}
    receipt = case.get("receipt")
    env = case.get("environment") or {}
    parts = [
        f"<h2>Review case {_e(case.get('case_id'))}</h2>",
        _kv(
            [
                (
                    "reason",
                    f'<span class="badge phase-needs_review">{_e(case.get("reason"))}</span>',
                ),
                ("action", _mono((pending.get("action") or {}).get("action_id"))),
                ("idempotency key", _mono((pending.get("action") or {}).get("idempotency_key"))),
                ("pending intent digest", _mono(pending.get("intent_digest"))),
                (
                    "receipt intent digest",
                    _mono(receipt.get("intent_digest") if receipt else "(no receipt)"),
                ),
                (
                    "environment",
                    _mono(
                        f"{env.get('instance_id')} v{env.get('version')} {env.get('fingerprint')}"
                    ),
                ),
                ("opened at trace seq", _e(case.get("opened_seq"))),
            ]
        ),
        "<h2>Receipt</h2>",
        _receipt_rows(receipt, case.get("receipt_fingerprint")),
    ]
    if case.get("decision") is None and run.get("phase") == Phase.NEEDS_REVIEW.value:
        parts.append("<p>To decide, on the reviewer's machine (one of):</p>")
        parts.append(_command_block(review_commands(str(run["run_id"]))))
    return "".join(parts)


def run_page(run: dict[str, Any], *, now: int) -> str:
    """One run, as ``ratchet show`` sees it."""
    lease = run.get("lease") or {}
    task = run.get("task") or {}
    budgets = run.get("budgets") or {}
    used, limits = budgets.get("used") or {}, budgets.get("limits") or {}
    env = run.get("environment") or {}
    budget_text = ", ".join(
        f"{name} {used.get(name, 0)}/{limits.get(name, '-')}"
        for name in sorted(set(used) | set(limits))
    )
    head = _kv(
        [
            (
                "phase",
                _phase(run.get("phase"))
                + (f" ({_e(run.get('stop_reason'))})" if run.get("stop_reason") else ""),
            ),
            (
                "task / policy",
                _e(
                    f"{task.get('task_id')} v{task.get('task_version')} / "
                    f"{task.get('policy_id')} v{task.get('policy_version')}"
                ),
            ),
            ("generation", _e(run.get("generation"))),
            (
                "lease",
                _e(
                    f"{lease.get('owner') or '-'} v{lease.get('lease_version')} "
                    f"({'live' if lease.get('live') else 'free'})"
                ),
            ),
            ("budgets", _e(budget_text)),
            (
                "environment",
                _mono(f"{env.get('instance_id')} v{env.get('version')} {env.get('fingerprint')}"),
            ),
        ]
    )
    executed = "".join(
        f"<tr><td>{_mono(e.get('idempotency_key'))}</td>"
        f"<td>{_mono((e.get('receipt') or {}).get('namespace'))}/"
        f"{_mono((e.get('receipt') or {}).get('receipt_id'))}</td>"
        f"<td>{_mono(e.get('intent_digest'))}</td>"
        f"<td>{_mono((e.get('receipt') or {}).get('approval_digest'))}</td></tr>"
        for e in run.get("executed") or []
    )
    incidents = "".join(
        f"<li>{_e(i.get('kind'))} <strong>{_e(i.get('reason'))}</strong>: "
        f"{_e(i.get('message'))}</li>"
        for i in run.get("incidents") or []
    )
    body = [
        f"<h1>run {_e(run.get('run_id'))}</h1>",
        status_section(run),
        head,
        problem_sections(run),
        _review_section(run),
        _pending_section(run, now),
        change_section(run),
    ]
    if executed:
        body.append(
            "<h2>Executed writes</h2><table><tr><th>key</th><th>receipt</th>"
            f"<th>intent digest</th><th>approval digest</th></tr>{executed}</table>"
        )
    if incidents:
        body.append(f'<h2>Incidents</h2><ul class="warn">{incidents}</ul>')
    body.append(
        timeline_section(run)
        if "timeline" in run
        else "<h2>Timeline</h2>" + _trace_rows(run.get("trace") or [])
    )
    return _layout(f"run {run.get('run_id')}", "".join(body))


def workers_page(info: dict[str, Any] | None) -> str:
    """The workers RQ knows for the fleet's queue, and the queue's depth."""
    if info is None:
        return _layout(
            "workers", '<h1>Workers</h1><p class="note">this console has no view of the workers</p>'
        )
    head = (
        f"<h1>Workers ({len(info.get('workers') or [])})</h1><p>queue "
        f'<span class="mono">{_e(info.get("queue"))}</span>: '
        f"<strong>{_e(info.get('queue_depth'))}</strong> jobs waiting</p>"
    )
    return _layout("workers", head + workers_table(info))


def _waiting_heading(title: str, shown: int, waiting: int | None, phase: Phase) -> str:
    """``title (N)``; with the exact count from the phase index, say when more wait than
    the page shows and link to all of them."""
    if waiting is None or waiting <= shown:
        return f"<h2>{_e(title)} ({_e(waiting if waiting is not None else shown)})</h2>"
    return (
        f'<h2>{_e(title)} ({_e(waiting)})</h2><p class="note">the newest {_e(shown)} '
        f'shown: <a href="{_e(_query(phase=phase.value))}">all {_e(waiting)}</a></p>'
    )


def review_queue_page(
    reviews: list[dict[str, Any]],
    approvals: list[dict[str, Any]],
    broken: list[dict[str, Any]],
    *,
    now: int,
    counts: dict[str, int] | None = None,
) -> str:
    """Runs waiting for a human, newest first: review cases, then approvals. ``counts``
    (runs per phase, exact) says how many wait in all."""
    counts = counts or {}
    rows = []
    for run in reviews:
        case = run.get("review") or {}
        receipt = case.get("receipt")
        rows.append(
            f"<tr><td>{_run_link(str(run['run_id']))}</td><td>{_e(case.get('case_id'))}</td>"
            f"<td>{_e(case.get('reason'))}</td>"
            f"<td>{_mono((case.get('pending') or {}).get('intent_digest'))}</td>"
            f"<td>{_mono(receipt.get('intent_digest') if receipt else '(no receipt)')}</td>"
            f"<td>{_mono(case.get('receipt_fingerprint'))}</td>"
            f"<td>{_command_block(review_commands(str(run['run_id'])))}</td></tr>"
        )
    review_table = (
        (
            "<table><tr><th>run</th><th>case</th><th>reason</th>"
            "<th>pending intent digest</th><th>receipt intent digest</th>"
            f"<th>receipt fingerprint</th><th>decide with</th></tr>{''.join(rows)}"
            "</table>"
        )
        if rows
        else '<p class="note">no open review cases</p>'
    )
    arows = []
    for run in approvals:
        pending = run.get("pending") or {}
        action = pending.get("action") or {}
        used = int((run.get("budgets") or {}).get("used", {}).get("proposals", 0))
        approval = pending.get("approval")
        status = (
            (
                approval_badge(approval, now=now, proposals_used=used)
                + " by "
                + _e(approval.get("approver_id"))
            )
            if approval
            else "none yet"
        )
        command = approve_command(str(run["run_id"]), str(action.get("action_id")))
        arows.append(
            f"<tr><td>{_run_link(str(run['run_id']))}</td>"
            f"<td>{_mono(action.get('action_id'))} ({_e(action.get('kind'))})</td>"
            f"<td>{_mono(pending.get('intent_digest'))}</td><td>{status}</td>"
            f"<td>{_command_block([command])}</td></tr>"
        )
    approval_table = (
        "<table><tr><th>run</th><th>action</th><th>intent digest</th>"
        f"<th>evidence</th><th>approve with</th></tr>{''.join(arows)}</table>"
        if arows
        else '<p class="note">no runs awaiting approval</p>'
    )
    unreadable = "".join(
        f"<li>{_run_link(str(r['run_id']))}: {_e(r.get('note'))}</li>" for r in broken
    )
    body = [
        "<h1>Review queue</h1>",
        _waiting_heading(
            "Needs review", len(reviews), counts.get(Phase.NEEDS_REVIEW.value), Phase.NEEDS_REVIEW
        ),
        review_table,
        _waiting_heading(
            "Awaiting approval",
            len(approvals),
            counts.get(Phase.AWAITING_APPROVAL.value),
            Phase.AWAITING_APPROVAL,
        ),
        approval_table,
    ]
    if unreadable:
        body.append(f'<h2>Unverifiable runs</h2><ul class="warn">{unreadable}</ul>')
    return _layout("review queue", "".join(body))


def error_page(title: str, message: str) -> str:
    return _layout(
        title,
        f'<h1>{_e(title)}</h1><p class="warn">{_e(message)}</p>'
        '<p><a href="/runs">back to the runs</a></p>',
    )
