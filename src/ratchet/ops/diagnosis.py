"""What went wrong with a run and where it is now, for ``ratchet show`` and the console.

:func:`diagnose` adds to a verified :class:`~ratchet.ops.RunView`:

* ``status``: ``running`` (a live lease, and RQ says a worker executes its job),
  ``leased`` (a live lease no worker reports running: its holder may have died; the lease
  expires and the reaper hands the run on), ``queued`` (a job waits in the queue, with
  its position), ``scheduled`` (on the reaper's index, due at a time: a retry after a
  backoff, or a pickup deadline) or ``idle``; with the owner, lease version and expiry by
  the store's clock, and why an idle run is not moving (ended, waiting for a human,
  frozen by an incident);
* ``current_incident`` (the newest) and ``last_job_error`` (error type, bounded message,
  where, attempt, what happens next);
* ``verifier_output``: the newest ``verifier_failed`` record's scrubbed tail, marked
  unsigned, and whether its digest names the run's latest signed report;
* ``timeline``: trace events merged with lease changes from the commit history and the
  incidents (takeovers, job errors, refusals), newest :data:`TIMELINE_LIMIT` kept;
* ``pending_change``: see :mod:`ratchet.ops.changes`.

Every stored record is read by shape (junk is shown as such, never trusted), every text
is bounded and scrubbed of the secrets this process knows, and nothing is written.
Trace times are upper bounds of Redis time in whole seconds (a worker's StoreClock, which
runs up to about two seconds ahead); history and incident times are Redis milliseconds.
The timeline keeps the trace in its signed order and places each lease change and
incident among it by those bounds (:func:`_merge`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis

from ratchet.errors import RatchetError, StoreUnavailableError
from ratchet.fleet.context import Fleet, HostSeen
from ratchet.fleet.placement import home_of
from ratchet.fleet.scrub import Scrubber
from ratchet.leasing import run_keys
from ratchet.ops.changes import pending_change
from ratchet.ops.operations import RunView
from ratchet.ops.queueview import QueueFacts, owner_of_worker, queue_facts
from ratchet.runtime import Phase
from ratchet.runtime.state import TERMINAL_PHASES

__all__ = [
    "FREEZING_KINDS",
    "MESSAGE_CHARS",
    "TIMELINE_LIMIT",
    "HistoryEntry",
    "diagnose",
    "read_history",
]

TIMELINE_LIMIT = 200
MESSAGE_CHARS = 500
#: Incident kinds after which nothing continues the run until an operator acts.
FREEZING_KINDS = frozenset(
    {"restore_refused", "environment_changed", "store_record_unreadable", "reaper_entry_refused"}
)


@dataclass(frozen=True, slots=True)
class HistoryEntry:
    """One commit of the run's history: who committed which generation, under which
    lease, when (Redis ms)."""

    generation: int
    lease_version: int
    owner: str
    at_ms: int


def read_history(fleet: Fleet, run_id: str) -> list[HistoryEntry]:
    """The run's commit history, oldest first; entries that do not parse are skipped.
    Raises StoreUnavailableError."""
    try:
        raw = fleet.store.client.lrange(run_keys(run_id).history, 0, -1)
    except redis.RedisError as exc:
        raise StoreUnavailableError(
            "the run's history cannot be read", run_id=run_id, cause=type(exc).__name__
        ) from None
    out = []
    for item in reversed(raw):
        parts = (item.decode("utf-8", "replace") if isinstance(item, bytes) else str(item)).split(
            "|"
        )
        if len(parts) == 7 and all(parts[i].isdigit() for i in (0, 2, 6)):
            out.append(HistoryEntry(int(parts[0]), int(parts[2]), parts[3][:200], int(parts[6])))
    return out


class _Text:
    """Bounded, scrubbed text from stored values of any shape."""

    def __init__(self, scrubber: Scrubber) -> None:
        self._scrubber = scrubber

    def __call__(self, value: object, limit: int = MESSAGE_CHARS) -> str:
        # Scrub before cutting, so a cut never leaves a secret's start behind a "...";
        # the scrubber itself redacts a configured secret's start at the end of its input.
        text = self._scrubber.scrub(("" if value is None else str(value))[: limit * 4 + 256])
        return text if len(text) <= limit else text[:limit] + "..."


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _since_retry(incidents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The incidents newer than the last operator retry (newest first)."""
    out = []
    for incident in incidents:
        if incident.get("kind") == "operator_retry":
            break
        out.append(incident)
    return out


def _incident_line(incident: dict[str, Any], text: _Text) -> str:
    kind = incident.get("kind")
    if kind == "job_error":
        return (
            f"job error {text(incident.get('error'), 100)} at "
            f"{text(incident.get('where'), 200)} (attempt "
            f"{text(incident.get('attempt'), 10)}): {text(incident.get('message'))}; "
            f"{text(incident.get('next'), 100)}"
        )
    if kind == "lease_taken_over":
        return f"lease v{text(incident.get('lease_version'), 20)} taken over after expiry"
    if kind == "verifier_failed":
        return (
            f"verifier {text(incident.get('target'), 100)} failed: {text(incident.get('message'))}"
        )
    if kind == "operator_retry":
        return (
            f"operator retry by {text(incident.get('operator'), 100)}: "
            f"{text(incident.get('reason'))}"
        )
    if kind == "unreadable":
        return f"unreadable record: {text(incident.get('malformed'), 200)}"
    reason = incident.get("reason")
    return (
        f"{text(kind, 100)}"
        + (f" ({text(reason, 100)})" if reason else "")
        + f": {text(incident.get('message'))}"
    )


def _incident_view(incident: dict[str, Any] | None, text: _Text) -> dict[str, Any] | None:
    if incident is None:
        return None
    return {
        "kind": text(incident.get("kind"), 100),
        "at_ms": _int(incident.get("at_ms")),
        "summary": _incident_line(incident, text),
        "reason": text(incident.get("reason"), 200) or None,
    }


def _job_error(incidents: list[dict[str, Any]], text: _Text) -> dict[str, Any] | None:
    incident = next((i for i in incidents if i.get("kind") == "job_error"), None)
    if incident is None:
        return None
    return {
        "kind": "job_error",
        "error": text(incident.get("error"), 100),
        "message": text(incident.get("message")),
        "where": text(incident.get("where"), 200),
        "attempt": _int(incident.get("attempt")),
        "next": text(incident.get("next"), 100),
        "at_ms": _int(incident.get("at_ms")),
    }


def _verifier_output(
    view: RunView, incidents: list[dict[str, Any]], text: _Text
) -> dict[str, Any] | None:
    incident = next((i for i in incidents if i.get("kind") == "verifier_failed"), None)
    if incident is None:
        return None
    digest = incident.get("output_digest")
    latest = view.state.verification
    signed_at = next(
        (
            e.seq
            for e in reversed(view.state.trace)
            if e.verifier is not None and e.verifier.output_digest == digest
        ),
        None,
    )
    if latest is not None and latest.output_digest == digest:
        binding = "its digest is the run's latest signed verifier report"
    elif signed_at is not None:
        binding = f"its digest is the signed verifier report at trace seq {signed_at}"
        if latest is not None and latest.passed:
            binding += "; a later verification passed"
    else:
        binding = "no signed verifier report has its digest (that job's commit did not land)"
    return {
        "target": text(incident.get("target"), 100),
        "exit_code": _int(incident.get("exit_code")),
        "timed_out": incident.get("timed_out") is True,
        "truncated": incident.get("truncated") is True,
        "bound": incident.get("bound") is True,
        "message": text(incident.get("message")),
        "at_ms": _int(incident.get("at_ms")),
        "lease_version": _int(incident.get("lease_version")),
        "output_digest": text(digest, 100),
        "signed_report_seq": signed_at,
        "binding": binding,
        "tail": text(incident.get("tail"), 8192),
        "tail_cut": incident.get("tail_cut") is True,
        "label": "unsigned, for diagnosis: the tail is not covered by any signature",
    }


def _status(
    fleet: Fleet,
    view: RunView,
    queue: QueueFacts | None,
    incidents: list[dict[str, Any]],
    text: _Text,
) -> dict[str, Any]:
    snap, state = view.snapshot, view.state
    run_id = state.run_id
    out: dict[str, Any] = {
        "store_now_ms": snap.now_ms,
        "owner": None,
        "lease_version": snap.lease_version,
        "expires_in_ms": None,
        "worker": None,
        "queue": fleet.settings.queue,
        "queue_position": None,
        "queue_depth": None,
        "due_in_ms": None,
        "frozen": False,
        "why": None,
    }
    if queue is not None:
        out["queue"], out["queue_depth"] = queue.queue, queue.depth
        out["queue_position"] = queue.positions.get(run_id)
    if snap.lease_live:
        out.update(owner=snap.owner, expires_in_ms=snap.expires_at_ms - snap.now_ms)
        worker = queue.started.get(run_id) if queue is not None else None
        if worker and owner_of_worker(worker) == snap.owner:
            out.update(
                state="running",
                worker=worker,
                summary=f"running on {worker} (lease v{snap.lease_version} held by "
                f"{snap.owner}, expires in {out['expires_in_ms']} ms by the "
                "store's clock)",
            )
        else:
            out.update(
                state="leased",
                summary=f"leased by {snap.owner} (lease v{snap.lease_version}, "
                f"expires in {out['expires_in_ms']} ms by the store's clock)"
                "; no worker reports running its job",
            )
        return out
    recent = _since_retry(incidents)
    freezing = next(
        (
            i
            for i in recent
            if i.get("kind") in FREEZING_KINDS
            or (i.get("kind") == "job_error" and str(i.get("next", "")).startswith("frozen"))
        ),
        None,
    )
    if freezing is not None and _int(freezing.get("lease_version")) not in (
        None,
        snap.lease_version,
    ):
        freezing = None  # a later job took the run and got past it
    phase_why = _phase_why(view, text)
    if freezing is not None and state.phase not in TERMINAL_PHASES:
        phase_why = None  # waiting or not, the last job that took the run refused it
    pending_why = phase_why
    if pending_why is None and freezing is not None:
        pending_why = (
            f"its last job froze it ({_incident_line(freezing, text)}), but a "
            "job for it is still waiting"
        )
    if out["queue_position"] is not None:
        out.update(
            state="queued",
            why=pending_why,
            summary=f"queued at position {out['queue_position']} of "
            f"{out['queue_depth']} in {out['queue']}",
        )
        return out
    try:
        due = fleet.store.expiry.expiry_score(run_id)
    except (redis.RedisError, StoreUnavailableError):
        due = None
    if due is not None and state.phase not in TERMINAL_PHASES:
        out.update(
            state="scheduled",
            due_in_ms=int(due) - snap.now_ms,
            summary=f"scheduled: the reaper hands it to a worker in "
            f"{max(int(due) - snap.now_ms, 0)} ms",
        )
        error = next((i for i in recent if i.get("kind") == "job_error"), None)
        out["why"] = pending_why or (
            f"retry after a job error: {_incident_line(error, text)}" if error is not None else None
        )
        return out
    out["state"] = "idle"
    if phase_why is not None:
        out["why"] = phase_why
    elif freezing is not None:
        out.update(
            frozen=True, why=f"{_incident_line(freezing, text)}; {_remedy(freezing, run_id)}"
        )
    else:
        out["why"] = (
            "nothing holds, queues or schedules it: the agent proposed nothing "
            "more, or its job was lost (ratchet retry hands it back)"
        )
    out["summary"] = ("frozen by " if out["frozen"] else "idle: ") + str(out["why"])
    return out


def _placed(
    out: dict[str, Any],
    view: RunView,
    host: str | None,
    moved: dict[str, Any] | None,
    seen: HostSeen | None,
) -> dict[str, Any]:
    """``out`` with where the run's environment lives: its host (None: any host may take
    it; ``moved``: the signed placement that moved it there) and, for a run that is not
    running or ended, whether it waits for that host."""
    env = view.document.environment
    out["host"] = host
    out["host_note"] = (
        None
        if host is not None
        else "any host may take it: its environment is shared"
        if env.kind in ("git", "tools")
        else "any host may take it (recorded before hosts)"
    )
    out["moved"] = moved
    files = (
        {"git remote": "shared"}
        if env.kind == "git"
        else {"tools ledger": "shared"}
        if env.kind == "tools"
        else {
            "workspace": "host-local"
            if env.host is not None
            else "any host (recorded before hosts)"
        }
    )
    out["environment_parts"] = {
        **files,
        **{f"mcp:{name}": "shared" for name in env.mcp},
        **({"http": "shared"} if env.http_base_url is not None else {}),
    }
    out["host_last_seen_ms"] = seen.last_seen_ms if seen is not None else None
    out["host_alive"] = seen.alive if seen is not None else None
    # Waiting for its host: a run a worker would take now (not held, not ended, not
    # waiting for a person, not frozen) whose host has no live worker.
    waiting = (
        seen is not None
        and not seen.alive
        and out.get("state") not in ("running", "leased")
        and view.state.phase is Phase.RUNNING
        and not out.get("frozen")
    )
    out["waiting_for_host"] = waiting
    if waiting and seen is not None:
        out["summary"] = f"waiting for {seen.describe()}; " + str(out.get("summary") or "")
        out["why"] = (
            f"its workspace is on {seen.describe()}, and no worker of that host is alive: "
            "bring the host back, attach its disk elsewhere (ratchet attach RUN on the host "
            "that has it now), or cancel the run (docs/operator-guide.md, "
            '"Waiting for its host")'
        )
    return out


def _remedy(incident: dict[str, Any], run_id: str) -> str:
    """The command that resolves a freezing incident (docs/operator-guide.md)."""
    reason = str(incident.get("reason", ""))
    if incident.get("kind") == "environment_changed" or reason == "environment":
        return (
            f"the workspace changed behind the run: ratchet review {run_id} --decision "
            f"rebaseline (or ratchet cancel {run_id})"
        )
    return f"fix the cause, then: ratchet retry {run_id} --reason ... (or ratchet cancel {run_id})"


def _phase_why(view: RunView, text: _Text) -> str | None:
    """Why the run's phase keeps it from moving on its own (None while running)."""
    state = view.state
    if state.phase in TERMINAL_PHASES:
        return f"the run ended {state.phase.value}" + (
            f": {text(state.stop_reason)}" if state.stop_reason else ""
        )
    if state.phase is Phase.AWAITING_APPROVAL and state.pending is not None:
        return (
            f"waiting for a signed approval of {state.pending.action.action_id} (ratchet approve)"
        )
    if state.phase is Phase.NEEDS_REVIEW and state.review is not None:
        return f"waiting for a reviewer's decision on {state.review.case_id} (ratchet review)"
    return None


def _timeline(
    view: RunView, history: list[HistoryEntry], incidents: list[dict[str, Any]], text: _Text
) -> tuple[list[dict[str, Any]], int]:
    # Exact items (Redis ms): lease changes go in as early as the trace allows, incidents
    # as late (see _merge). ``early`` marks the former.
    exact: list[tuple[int, int, bool, dict[str, Any]]] = []
    takeovers = {
        _int(i.get("lease_version")): i for i in incidents if i.get("kind") == "lease_taken_over"
    }
    previous: HistoryEntry | None = None
    for entry in history:
        if previous is not None and entry.lease_version != previous.lease_version:
            taken = takeovers.pop(entry.lease_version, None)
            at = entry.at_ms
            if taken is not None:
                what = (
                    f"taken over from {text(previous.owner, 200)} after lease expiry"
                    if _int(taken.get("previous_lease_version")) == previous.lease_version
                    else "taken over after lease expiry (last commit before it by "
                    f"{text(previous.owner, 200)}, lease v{previous.lease_version})"
                )
                at = _int(taken.get("at_ms")) or at
            elif not previous.owner:  # the creation entry: no lease before
                what = "first lease"
            elif entry.owner == previous.owner:
                what = "lease taken again by the same owner"
            else:
                what = (
                    f"handed on from {text(previous.owner, 200)} (no takeover recorded: "
                    "it released the lease)"
                )
            exact.append(
                (
                    at,
                    0,
                    True,
                    {
                        "at_ms": at,
                        "source": "lease",
                        "lease_version": entry.lease_version,
                        "owner": text(entry.owner, 200),
                        "what": what,
                    },
                )
            )
        previous = entry
    for incident in incidents:
        kind = incident.get("kind")
        stamp = _int(incident.get("at_ms"))
        if stamp is None or (
            kind == "lease_taken_over" and _int(incident.get("lease_version")) not in takeovers
        ):
            continue  # no time, or already shown as its lease change
        early = kind == "lease_taken_over"
        exact.append(
            (
                stamp,
                0 if early else 1,
                early,
                {
                    "at_ms": stamp,
                    "source": "incident",
                    "kind": text(kind, 100),
                    "what": _incident_line(incident, text),
                },
            )
        )
    exact.sort(key=lambda t: t[:2])
    trace = []
    for event in view.state.trace:
        detail = ", ".join(f"{k}={text(v, 200)}" for k, v in sorted(event.detail.items()))
        what = event.outcome.value + (f" {event.action_id}" if event.action_id else "")
        if event.verifier is not None:
            what += f" ({event.verifier.target}: {'passed' if event.verifier.passed else 'failed'})"
        trace.append(
            {
                "at_ms": event.at * 1000,
                "source": "trace",
                "seq": event.seq,
                "what": what,
                "detail": detail,
            }
        )
    items = _merge(trace, exact)
    left_out = max(len(items) - TIMELINE_LIMIT, 0)
    return items[left_out:], left_out


# A trace time is the worker's StoreClock reading, in whole seconds rounded up, and that
# clock runs ahead of Redis' by its margin (1000 ms by default) plus drift: an event
# stamped U happened in (U*1000 - 2000, U*1000 - 1000] ms of Redis time, give or take
# the drift allowance.
_TRACE_AHEAD_MS = 1000


def _merge(
    trace: list[dict[str, Any]], exact: list[tuple[int, int, bool, dict[str, Any]]]
) -> list[dict[str, Any]]:
    """The trace in its own order, with each exact item placed among it: a lease change
    after the events that surely happened before it (their latest possible time is
    earlier), an incident after every event that may have happened before it (their
    earliest possible time is not later). A job records its incidents after its events
    and takes its lease before them, so each lands on the right side of its own job; the
    run's first event (its creation) precedes everything."""
    out: list[dict[str, Any]] = []
    index = 0
    if trace and trace[0].get("seq") == 1:  # the run's creation comes before any lease
        out.append(trace[0])
        index = 1
    for at_ms, _, early, item in exact:
        while index < len(trace):
            stamp = trace[index]["at_ms"]
            before = (
                stamp - _TRACE_AHEAD_MS < at_ms
                if early
                else stamp - _TRACE_AHEAD_MS - 1000 <= at_ms
            )
            if not before:
                break
            out.append(trace[index])
            index += 1
        out.append(item)
    out.extend(trace[index:])
    return out


def diagnose(fleet: Fleet, view: RunView) -> dict[str, Any]:
    """Status, incidents, verifier output, timeline and pending change of a verified run
    (see the module docstring). A queue or history that cannot be read leaves its part
    out with a note; raises nothing for junk records."""
    scrubber = Scrubber.from_settings(fleet.settings)
    text = _Text(scrubber)
    notes: list[str] = []
    queue: QueueFacts | None = None
    history: list[HistoryEntry] = []
    host = view.document.environment.host
    moved: dict[str, Any] | None = None
    try:
        host, placement = home_of(fleet.keyring, fleet.store, view.state.run_id, view.document)
        if placement is not None:
            moved = {
                "from": placement.moved_from,
                "seq": placement.seq,
                "by": placement.by,
                "at_ms": placement.at_ms,
            }
    except RatchetError as exc:
        notes.append(f"placement: {exc.message}")
    try:
        queue = queue_facts(fleet, host)
    except RatchetError as exc:
        notes.append(f"queue: {exc.message}")
    seen: HostSeen | None = None
    if host is not None:
        try:
            seen = fleet.host_seen(host)
        except RatchetError as exc:
            notes.append(f"hosts: {exc.message}")
    try:
        history = read_history(fleet, view.state.run_id)
    except RatchetError as exc:
        notes.append(f"history: {exc.message}")
    incidents = [i for i in view.incidents if isinstance(i, dict)]
    timeline, left_out = _timeline(view, history, incidents, text)
    return {
        "status": _placed(_status(fleet, view, queue, incidents, text), view, host, moved, seen),
        "current_incident": _incident_view(incidents[0] if incidents else None, text),
        "last_job_error": _job_error(incidents, text),
        "verifier_output": _verifier_output(view, incidents, text),
        "timeline": timeline,
        "timeline_left_out": left_out,
        "pending_change": _scrubbed_change(pending_change(view, fleet), scrubber),
        "notes": notes,
    }


def _scrubbed_change(change: dict[str, Any] | None, scrubber: Scrubber) -> dict[str, Any] | None:
    """The change with secret-looking text redacted, and marked when anything was: the
    approver sees that the write carries something that looks like a secret, not the
    secret itself."""
    if change is None:
        return None
    scrubbed = False
    content = change.get("content")
    if isinstance(content, dict) and isinstance(content.get("text"), str):
        clean = scrubber.scrub(content["text"])
        scrubbed |= clean != content["text"]
        change["content"] = {**content, "text": clean}
    if isinstance(change.get("diff"), str):
        clean = scrubber.scrub(change["diff"])
        scrubbed |= clean != change["diff"]
        change["diff"] = clean
    change["scrubbed"] = scrubbed
    return change
