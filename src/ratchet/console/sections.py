"""HTML sections of the run page that say what went wrong, and the workers table.

They render the parts of a run's JSON view that :func:`ratchet.ops.diagnosis.diagnose`
adds (status, current incident, last job error, verifier output, pending change,
timeline) and the worker list of :func:`ratchet.ops.queueview.list_workers`. A view
without those parts renders nothing here. Every value is escaped; no script, no inline
style (diff lines are coloured by class from the console's style sheet).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from html import escape
from typing import Any
from urllib.parse import quote

__all__ = [
    "SECTIONS_CSS",
    "change_section",
    "problem_sections",
    "status_section",
    "timeline_section",
    "workers_table",
]

SECTIONS_CSS = """
.state-running,.state-leased{background:#cfe3ff}.state-queued,.state-scheduled{background:#e6dcff}
.state-idle{background:#dde3ea}.state-frozen{background:#c62828;color:#fff}
pre.diff span{display:block}pre.diff .add{background:#e3f6e6}pre.diff .del{background:#fbe4e4}
pre.diff .hunk{color:#4a5563;background:#eef1f5}pre.tail{max-height:40rem;overflow:auto}
p.label{font-size:13px;color:#6b4b00;background:#fff4e5;padding:.3rem .6rem;margin:.2rem 0}
table.timeline td:first-child{white-space:nowrap}table.timeline td:nth-child(3){min-width:20rem}
tr.src-lease td,tr.src-incident td{background:#fff8ec}
"""


def _e(value: object) -> str:
    return escape("" if value is None else str(value), quote=True)


def _ms(at_ms: object, *, seconds_only: bool = False) -> str:
    if not isinstance(at_ms, int) or isinstance(at_ms, bool):
        return "-"
    text = datetime.fromtimestamp(at_ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")
    return (text[:-7] if seconds_only else text[:-3]) + " UTC"


def _kv(rows: Iterable[tuple[str, str]]) -> str:
    body = "".join(f'<tr><td class="k">{_e(k)}</td><td>{v}</td></tr>' for k, v in rows)
    return f"<table>{body}</table>"


def _run_link(run_id: object) -> str:
    if not run_id:
        return "-"
    return f'<a href="/runs/{quote(str(run_id), safe="")}">{_e(run_id)}</a>'


def status_section(run: dict[str, Any]) -> str:
    """Where the run is: running, leased, queued, scheduled or idle (and frozen-why)."""
    status = run.get("status")
    if not isinstance(status, dict):
        return ""
    state = "frozen" if status.get("frozen") else str(status.get("state"))
    rows = [
        (
            "state",
            f'<span class="badge state-{_e(state)}">{_e(state)}</span> {_e(status.get("summary"))}',
        )
    ]
    if status.get("owner"):
        rows.append(
            (
                "lease",
                _e(
                    f"{status['owner']} v{status.get('lease_version')}, "
                    f"expires in {status.get('expires_in_ms')} ms by the "
                    "store's clock"
                ),
            )
        )
    if status.get("worker"):
        rows.append(("worker", f'<span class="mono">{_e(status["worker"])}</span>'))
    depth = status.get("queue_depth")
    queue = f"{status.get('queue')}: {depth if depth is not None else '?'} waiting"
    if status.get("queue_position"):
        queue += f", this run at position {status['queue_position']}"
    rows.append(("queue", _e(queue)))
    if status.get("why") and str(status["why"]) not in str(status.get("summary")):
        rows.append(("why", _e(status["why"])))
    host = status.get("host")
    if "host" in status:
        alive = status.get("host_alive")
        state = "alive" if alive else "gone" if alive is False else "unknown"
        text = (
            str(status.get("host_note") or "any host may take it")
            if host is None
            else f"{host} ({state})"
        )
        moved = status.get("moved")
        if isinstance(moved, dict):
            text += f", moved from {moved.get('from')} by {moved.get('by')}"
        rows.append(("host", _e(text)))
    parts = status.get("environment_parts")
    if isinstance(parts, dict) and parts:
        rows.append(("environment", _e(", ".join(f"{k}: {v}" for k, v in parts.items()))))
    rows += [("note", _e(note)) for note in status.get("notes") or run.get("notes") or []]
    return "<h2>Status</h2>" + _kv(rows)


def problem_sections(run: dict[str, Any]) -> str:
    """The current incident, the last job error and the verifier's last failed output."""
    parts: list[str] = []
    incident = run.get("current_incident")
    if isinstance(incident, dict):
        parts.append(
            "<h2>Current incident</h2>"
            + _kv(
                [
                    ("what", _e(incident.get("summary"))),
                    ("kind", _e(incident.get("kind"))),
                    ("at", _e(_ms(incident.get("at_ms")))),
                ]
            )
        )
    error = run.get("last_job_error")
    if isinstance(error, dict):
        parts.append(
            "<h2>Last job error</h2>"
            + _kv(
                [
                    ("error", f"<strong>{_e(error.get('error'))}</strong>"),
                    ("message", _e(error.get("message"))),
                    ("where", f'<span class="mono">{_e(error.get("where"))}</span>'),
                    ("attempt", _e(error.get("attempt"))),
                    ("next", _e(error.get("next"))),
                    ("at", _e(_ms(error.get("at_ms")))),
                ]
            )
        )
    output = run.get("verifier_output")
    if isinstance(output, dict):
        cut = " (earlier output cut)" if output.get("tail_cut") else ""
        parts.append(
            "<h2>Verifier output (last failed check)</h2>"
            + _kv(
                [
                    ("target", _e(output.get("target"))),
                    ("result", _e(output.get("message"))),
                    ("exit code", _e(output.get("exit_code"))),
                    (
                        "timed out / truncated",
                        _e(f"{output.get('timed_out')} / {output.get('truncated')}"),
                    ),
                    ("signed report", _e(output.get("binding"))),
                    (
                        "output digest",
                        f'<span class="mono">{_e(output.get("output_digest"))}</span>',
                    ),
                    ("at", _e(_ms(output.get("at_ms")))),
                ]
            )
            + f'<p class="label">{_e(output.get("label"))}; secrets scrubbed{_e(cut)}</p>'
            + f'<pre class="tail">{_e(output.get("tail"))}</pre>'
        )
    return "".join(parts)


def _diff_html(diff: str) -> str:
    lines = []
    for line in diff.splitlines():
        cls = (
            "hunk"
            if line.startswith("@@")
            else "add"
            if line.startswith("+") and not line.startswith("+++")
            else "del"
            if line.startswith("-") and not line.startswith("---")
            else ""
        )
        lines.append(
            f'<span class="{cls}">{_e(line) or "&nbsp;"}</span>'
            if cls
            else f"<span>{_e(line) or '&nbsp;'}</span>"
        )
    return f'<pre class="diff">{"".join(lines)}</pre>'


def change_section(run: dict[str, Any]) -> str:
    """The pending write's content and its unified diff against the current file."""
    change = run.get("pending_change")
    if not isinstance(change, dict):
        return ""
    raw = change.get("content")
    content: dict[str, Any] = raw if isinstance(raw, dict) else {}
    rows = [
        (
            "operation",
            _e(f"{change.get('operation')} {change.get('path') or change.get('target') or ''}"),
        )
    ]
    if content:
        rows.append(
            (
                "content",
                _e(
                    f"{content.get('bytes')} bytes, {content.get('form')}, "
                    f"sha256 {content.get('sha256')}"
                ),
            )
        )
    current = change.get("current")
    if isinstance(current, dict):
        rows.append(
            (
                "current file",
                _e(
                    f"{current.get('bytes')} bytes, "
                    f"{current.get('form')}, sha256 "
                    f"{current.get('sha256')}"
                ),
            )
        )
    for name in ("receipt_note", "current_note", "diff_note"):
        if change.get(name):
            rows.append((name.split("_")[0], _e(change[name])))
    if change.get("scrubbed"):
        rows.append(("redacted", "text that looks like a secret is redacted here"))
    parts = ["<h2>Pending change</h2>", _kv(rows)]
    if change.get("diff"):
        parts.append(_diff_html(str(change["diff"])))
    elif content.get("form") == "text":
        parts.append(f"<pre>{_e(content.get('text'))}</pre>")
    elif content.get("form") in ("binary", "huge"):
        parts.append(f'<p class="note">{_e(content.get("form"))} content: not shown</p>')
    return "".join(parts)


def timeline_section(run: dict[str, Any]) -> str:
    """Trace events, lease changes and incidents in one table, oldest first."""
    timeline = run.get("timeline")
    if not isinstance(timeline, list):
        return ""
    rows = []
    for item in timeline:
        if not isinstance(item, dict):
            continue
        source = str(item.get("source"))
        label = source + (f" #{item['seq']}" if item.get("seq") is not None else "")
        rows.append(
            f'<tr class="src-{_e(source)}"><td>'
            f"{'&le; ' if source == 'trace' else ''}"
            f"{_e(_ms(item.get('at_ms'), seconds_only=source == 'trace'))}</td>"
            f"<td>{_e(label)}</td><td>{_e(item.get('what'))}</td>"
            f"<td>{_e(item.get('detail') or '')}</td></tr>"
        )
    left_out = run.get("timeline_left_out") or 0
    note = f'<p class="note">{_e(left_out)} earlier entries not shown</p>' if left_out else ""
    return (
        f'<h2>Timeline</h2>{note}<table class="timeline"><tr><th>at (store\'s clock; '
        "a trace time is an upper bound, to the second)</th><th>source</th><th>what</th>"
        f"<th>detail</th></tr>{''.join(rows)}</table>"
    )


def workers_table(info: dict[str, Any]) -> str:
    """The workers RQ knows, with their state, current run and heartbeat age."""
    rows = []
    for worker in info.get("workers") or []:
        age = worker.get("heartbeat_age_s")
        rows.append(
            f'<tr><td class="mono">{_e(worker.get("name"))}</td>'
            f'<td class="mono">{_e(worker.get("owner") or "-")}</td>'
            f"<td>{_e(worker.get('state'))}</td>"
            f"<td>{_run_link(worker.get('current_run'))}</td>"
            f'<td class="mono">{_e(worker.get("current_job") or "-")}</td>'
            f"<td>{_e(f'{age} s ago' if age is not None else '-')}</td>"
            f"<td>{_e(', '.join(worker.get('queues') or []))}</td>"
            f"<td>{_e(worker.get('successful_jobs'))} / {_e(worker.get('failed_jobs'))}"
            "</td></tr>"
        )
    if not rows:
        return '<p class="note">no worker is registered for this queue</p>'
    return (
        "<table><tr><th>worker</th><th>lease owner id</th><th>state</th><th>run</th>"
        "<th>current job</th><th>last heartbeat</th><th>queues</th>"
        f"<th>jobs ok / failed</th></tr>{''.join(rows)}</table>"
    )
