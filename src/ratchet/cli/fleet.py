"""Fleet commands: demo, worker, submit, runs, show, approve, review, keys generate."""

from __future__ import annotations

import json
import os
import secrets
import time
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)
from rich.console import Console
from rich.table import Table

from ratchet.cli import keyfile
from ratchet.cli.common import (
    EXIT_CHECK_FAILED,
    JsonFlag,
    app,
    keys_app,
    print_json,
    ratchet_errors,
    store_app,
    write_private,
)
from ratchet.cli.console import page_runs
from ratchet.cli.local import local_demo
from ratchet.cli.render import render_run, run_to_json
from ratchet.console.data import RunQuery
from ratchet.demo.examples import greeting_document, make_greeting_workspace
from ratchet.demo.fleet import run_fleet_demo
from ratchet.demo.hosts import run_hosts_demo
from ratchet.errors import ConfigurationError, ContractError
from ratchet.fleet.context import Fleet
from ratchet.fleet.runs import RunDocument
from ratchet.fleet.settings import Settings
from ratchet.leasing.listing import MAX_PAGE
from ratchet.ops import approve as sign_approval_for
from ratchet.ops import cancel as cancel_run
from ratchet.ops import inspect_run, submit
from ratchet.ops import rebaseline as rebaseline_run
from ratchet.ops import retry as retry_run
from ratchet.ops import review as sign_review_for
from ratchet.ops.reindex import index_phases
from ratchet.ops.retention import start_retention
from ratchet.ops.taskfile import load_task_file
from ratchet.runtime import (
    ApprovalEvidence,
    Phase,
    RebaselineClaims,
    ReviewDecisionClaims,
)
from ratchet.worker.pool import run_pool

__all__: list[str] = []


# --- demo ------------------------------------------------------------------------------------


@app.command()
@ratchet_errors
def demo(
    local: Annotated[
        bool,
        typer.Option(
            "--local", help="One process, in-memory stand-ins, a crash injected in one window."
        ),
    ] = False,
    tools: Annotated[
        bool,
        typer.Option(
            "--tools",
            help="A tool-calling agent (a stub chat model) fixes the repository and files a "
            "ticket through a real MCP server, on 3 workers, one killed mid-run.",
        ),
    ] = False,
    hosts: Annotated[
        bool,
        typer.Option(
            "--hosts",
            help="Runs on a git workspace (a bare repository over file://) survive losing "
            "their host: host a is lost right after a push, host b finishes every run with "
            "one commit per write.",
        ),
    ] = False,
    runs: Annotated[int, typer.Option(min=1, max=50, help="Runs to submit.")] = 6,
    workers: Annotated[int, typer.Option(min=2, max=8, help="Worker processes.")] = 2,
    as_json: JsonFlag = False,
) -> None:
    """Start worker processes on the embedded Redis, submit runs of the example task,
    SIGKILL a worker while it holds a lease mid-run, and show that every run completes with
    each write done exactly once. Exits 1 if the demo's own checks fail."""
    if local:
        local_demo(as_json)
        return
    os.environ.setdefault("RATCHET_LOG_LEVEL", "WARNING")
    if tools:
        _tools_demo(runs=min(runs, 4), workers=max(workers, 3), as_json=as_json)
        return
    if hosts:
        _hosts_demo(runs=min(runs, 6), as_json=as_json)
        return
    report = run_fleet_demo(runs=runs, workers=workers)
    data = report.as_dict()
    if as_json:
        print_json(data)
    else:
        console = Console(highlight=False)
        table = Table(
            title="ratchet fleet demo (embedded Redis, real worker processes)", show_header=False
        )
        for name in (
            "runs",
            "completed",
            "duplicate_effects",
            "stale_writes_rejected",
            "takeovers",
            "workers_killed",
            "workers",
            "lease_ttl_ms",
            "elapsed_s",
        ):
            table.add_row(name, str(data[name]))
        table.add_row("killed while holding", ", ".join(report.killed_holding) or "-")
        table.add_row("verifier", report.sandbox)
        table.add_row("result", "ok" if report.ok else "FAILED")
        console.print(table)
    if not report.ok:
        typer.echo("ratchet: demo check failed", err=True)
        raise typer.Exit(EXIT_CHECK_FAILED)


def _tools_demo(*, runs: int, workers: int, as_json: bool) -> None:
    try:
        from ratchet.demo.tools import run_tools_demo  # noqa: PLC0415 - needs the mcp extra
    except ImportError as exc:
        raise ConfigurationError(
            f"the tools demo needs the mcp and openai extras ({exc.name}): "
            "pip install -e '.[mcp,openai]'"
        ) from None
    report = run_tools_demo(runs=runs, workers=workers)
    data = report.as_dict()
    if as_json:
        print_json(data)
    else:
        console = Console(highlight=False)
        table = Table(
            title="ratchet tools demo (tool-calling agent, MCP tickets server, real workers)",
            show_header=False,
        )
        for name in (
            "runs",
            "completed",
            "tickets_created",
            "duplicate_effects",
            "greeting_fixed",
            "takeovers",
            "workers_killed",
            "workers",
            "model_requests",
            "elapsed_s",
        ):
            table.add_row(name, str(data[name]))
        table.add_row("killed while holding", ", ".join(report.killed_holding) or "-")
        table.add_row("result", "ok" if report.ok else "FAILED")
        console.print(table)
    if not report.ok:
        typer.echo("ratchet: demo check failed", err=True)
        raise typer.Exit(EXIT_CHECK_FAILED)


def _hosts_demo(*, runs: int, as_json: bool) -> None:
    report = run_hosts_demo(runs=runs)
    data = report.as_dict()
    if as_json:
        print_json(data)
    else:
        table = Table(
            title="ratchet hosts demo (git workspace, a host lost after its push)",
            show_header=False,
        )
        for name in ("runs", "completed", "duplicate_commits", "greeting_fixed"):
            table.add_row(name, str(data[name]))
        table.add_row("host lost", f"{report.host_lost} ({report.workers_killed} workers killed)")
        table.add_row("lost right after a push", "yes" if report.lost_after_push else "no")
        table.add_row("runs finished on host b", str(report.continued_on_survivor))
        per_write = {counts for c in report.commits_per_write.values() for counts in c}
        table.add_row("commits per write on the remote", ", ".join(map(str, sorted(per_write))))
        table.add_row("elapsed_s", str(report.elapsed_s))
        table.add_row("result", "ok" if report.ok else "FAILED")
        Console(highlight=False).print(table)
    if not report.ok:
        typer.echo("ratchet: demo check failed", err=True)
        raise typer.Exit(EXIT_CHECK_FAILED)


# --- worker ----------------------------------------------------------------------------------


@app.command()
@ratchet_errors
def worker(
    concurrency: Annotated[int, typer.Option(min=1, max=64, help="Worker processes.")] = 1,
    burst: Annotated[bool, typer.Option(help="Exit when the queue is empty.")] = False,
) -> None:
    """Run worker processes (RQ SimpleWorker + reaper each) until SIGTERM.

    The first SIGTERM finishes each current step, commits, releases the lease and exits;
    a second one stops at once (leases then expire and other workers take over).
    """
    raise typer.Exit(
        run_pool(
            Settings(),
            concurrency=concurrency,
            burst=burst,
            background=start_retention,  # RATCHET_RETENTION_S, if set
        )
    )


# --- store -------------------------------------------------------------------------------------


@store_app.command("init")
@ratchet_errors
def store_init_command(as_json: JsonFlag = False) -> None:
    """Give a new store its epoch (an initialised store keeps its own).

    Every worker and command checks the epoch and refuses a store without one: a Redis
    that was wiped, restarted without its AOF or evicted keys is not the store the runs
    were made in. Run this once for a new store, never to get past that refusal for an
    old one (its runs and their high-water marks are gone). The embedded default does it
    when it creates its store.
    """
    fleet = Fleet.connect(check_store=False)
    before = fleet.store.identity.read_epoch()
    epoch = fleet.store.identity.init_epoch()
    indexed = index_phases(fleet)  # runs made before phase indexes join their phase's
    info = {"epoch": epoch, "created": before is None, "phase_index": indexed.as_dict()}
    if as_json:
        print_json(info)
    else:
        typer.echo(
            f"store epoch {epoch}" + (" (new)" if before is None else " (already initialised)")
        )
        if indexed.migrated:
            typer.echo(
                f"index entries moved into their shards: {indexed.migrated} "
                "(a Cluster store written before the indexes were sharded)"
            )
        if indexed.indexed or indexed.unverifiable:
            typer.echo(
                f"phase indexes: {indexed.indexed} runs indexed, "
                f"{len(indexed.unverifiable)} left out (they do not verify: "
                "ratchet show RUN_ID says why)"
            )


# --- submit ------------------------------------------------------------------------------------


def _document_from_task(task_file: Path, agent: str) -> RunDocument:
    """The run document of a task file; every bad file is one typed error (see
    :func:`ratchet.ops.taskfile.load_task_file`)."""
    return load_task_file(task_file, agent)


@app.command("submit")
@ratchet_errors
def submit_command(
    task_file: Annotated[
        Path | None,
        typer.Argument(
            help="Task file (JSON/YAML): scenario (or scenario_file), environment, agent_config."
        ),
    ] = None,
    agent: Annotated[
        str,
        typer.Option(
            help="Built-in agent (greeting, scripted, tool_calling), package.module:factory, "
            "or a plan file."
        ),
    ] = "greeting",
    run_id: Annotated[str | None, typer.Option("--run-id", help="Run id to use.")] = None,
    example: Annotated[
        str | None,
        typer.Option(help="Submit the built-in example task ('greeting') instead of a task file."),
    ] = None,
    workspace: Annotated[
        Path | None, typer.Option(help="Workspace folder for --example (created if missing).")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Create a run (document + signed generation 1) and enqueue it. Prints the run id."""
    if example is not None:
        if example != "greeting":
            raise ConfigurationError("the only built-in example is 'greeting'", field="example")
        root = workspace or Path(f"ratchet-example-{secrets.token_hex(3)}")
        if not (root / "app.py").exists():
            make_greeting_workspace(root)
        document = greeting_document(root)
    elif task_file is not None:
        document = _document_from_task(task_file, agent)
    else:
        raise ContractError("give a task file or --example greeting", field="task_file")
    fleet = Fleet.connect()
    new_id = submit(fleet, document, run_id=run_id)
    if as_json:
        print_json({"run_id": new_id, "queue": fleet.settings.queue})
    else:
        typer.echo(new_id)


# --- runs and show -------------------------------------------------------------------------------


@app.command("runs")
@ratchet_errors
def runs_command(
    phase: Annotated[
        Phase | None, typer.Option(help="Only runs in this phase, by when they entered it.")
    ] = None,
    limit: Annotated[int, typer.Option(min=1, max=MAX_PAGE, help="Runs per page.")] = 50,
    after: Annotated[
        str | None,
        typer.Option(help="Continue after this cursor (the one the previous page printed)."),
    ] = None,
    search: Annotated[
        str | None,
        typer.Option(help="Only runs whose id, task id or lease owner starts with this."),
    ] = None,
    oldest: Annotated[bool, typer.Option("--oldest", help="Oldest first.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """List runs newest first, a page at a time, with exact counts per phase.

    Reads the store's indexes and each listed run's hashes (no checkpoint is verified:
    `ratchet show RUN_ID` does); prints the counts, the page, and the cursor of the next
    page (`--after CURSOR`).
    """
    fleet = Fleet.connect()
    query = RunQuery(
        phase=phase.value if phase is not None else None,
        search=search,
        after=after,
        oldest_first=oldest,
        limit=limit,
    )
    rows, cursor, scanned = page_runs(fleet, query)
    counts, total = fleet.store.phase_counts(), fleet.store.run_count()
    unindexed = max(0, total - sum(counts.values()))
    if as_json:
        print_json(
            {
                "counts": counts,
                "total": total,
                "unindexed": unindexed,
                "phase": query.phase,
                "runs": rows,
                "scanned": scanned,
                "next_cursor": cursor,
            }
        )
        return
    console = Console(highlight=False)
    console.print(
        "  ".join([f"all {total}"] + [f"{name} {n}" for name, n in counts.items()])
        + (
            f"  (in no phase list: {unindexed}; `ratchet store init` indexes them)"
            if unindexed
            else ""
        ),
        markup=False,
    )
    title = (
        f"{len(rows)} runs"
        + (f" in {query.phase}" if query.phase else "")
        + (f" matching {search!r} ({scanned} examined)" if search else "")
    )
    table = Table(title=title)
    columns = (
        "run_id",
        "phase",
        "task",
        "host",
        "owner",
        "lease",
        "generation",
        "failures",
        "note",
    )
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(
            row["run_id"],
            row.get("phase") or "?",
            row.get("task_id") or "-",
            (row.get("host") or "-") + (" (gone)" if row.get("waiting_for_host") else ""),
            row.get("owner") or "-",
            row.get("lease") or "-",
            str(row.get("generation")),
            str(row.get("failures") or 0),
            row.get("note") or "",
        )
    console.print(table)
    if cursor is not None:
        console.print(f"next page: --after {cursor}", markup=False)


@app.command("show")
@ratchet_errors
def show_command(run_id: str, as_json: JsonFlag = False) -> None:
    """Show one run: where it is (queued, leased or running and by whom, with the lease
    expiry by the store's clock, or idle and why: ended, waiting, frozen), the current
    incident and the last job error, the verifier's last failed output (scrubbed, marked
    unsigned), phase and stop reason, budgets, the pending intent with its approval
    evidence (expired evidence marked) and its content and diff against the current file,
    any review case with both digests and the receipt, executed writes with their
    receipts, incidents, and a timeline of the trace with lease changes and incidents."""
    fleet = Fleet.connect()
    view = inspect_run(fleet, run_id)
    now = int(time.time())
    if as_json:
        print_json(run_to_json(view, now, fleet=fleet))
    else:
        render_run(Console(highlight=False), view, now, fleet=fleet)


# --- approvals and reviews ---------------------------------------------------------------------


@app.command("approve")
@ratchet_errors
def approve_command(
    run_id: str,
    action_id: str,
    key: Annotated[
        Path, typer.Option("--key", help="Approver private key (PEM); - reads it from stdin.")
    ],
    signer_id: Annotated[
        str | None, typer.Option("--id", help="Approver id (default: from the key file name).")
    ] = None,
    ttl: Annotated[
        int, typer.Option(min=1, max=30 * 24 * 3600, help="Seconds the approval stays valid.")
    ] = 3600,
    as_json: JsonFlag = False,
) -> None:
    """Sign an approval of exactly the pending write `show` displays, and re-enqueue."""
    private, signer = keyfile.signer(key, signer_id, "approver")
    posted = sign_approval_for(
        Fleet.connect(), run_id, action_id, key=private, approver_id=signer, ttl_s=ttl
    )
    evidence = posted.evidence
    if not isinstance(evidence, ApprovalEvidence):  # for the type checker
        raise ContractError("posted evidence is not an approval")
    info = {
        "run_id": run_id,
        "action_id": action_id,
        "approver_id": signer,
        "nonce": evidence.claims.nonce,
        "expires_at": evidence.claims.expires_at,
        "approval_digest": evidence.digest,
        "verified": posted.verified,
    }
    if as_json:
        print_json(info)
    else:
        typer.echo(
            f"approved {action_id} of {run_id} as {signer}; run re-enqueued"
            + _unverified_note(posted.verified, "approver")
        )


@app.command("retry")
@ratchet_errors
def retry_command(
    run_id: str,
    reason: Annotated[str, typer.Option("--reason", help="Why (recorded with the run).")],
    as_json: JsonFlag = False,
) -> None:
    """Hand a run frozen by an outside cause back to the workers, once that cause is
    fixed. The worker restores it with every check; nothing is bypassed."""
    operator = _operator()
    retry_run(Fleet.connect(), run_id, reason=reason, operator=operator)
    if as_json:
        print_json({"run_id": run_id, "retried": True, "operator": operator})
    else:
        typer.echo(f"{run_id} handed back to the workers by {operator}")


def _operator() -> str:
    return os.environ.get("USER") or os.environ.get("LOGNAME") or "operator"


@app.command("cancel")
@ratchet_errors
def cancel_command(
    run_id: str,
    reason: Annotated[str, typer.Option("--reason", help="Why (recorded with the run).")],
    wait: Annotated[
        float,
        typer.Option(
            min=0, max=3600, help="Seconds to wait for a worker to end the run (0: do not wait)."
        ),
    ] = 0,
    as_json: JsonFlag = False,
) -> None:
    """End a run at its next safe point: a worker settles any pending write by its key,
    then commits `cancelled`, attributed to you. A run under review is ended by a
    reviewer instead (review --decision abort). With --wait, exits 1 if the run has not
    ended in time (the request stays)."""
    fleet = Fleet.connect()
    operator = _operator()
    posted = cancel_run(fleet, run_id, reason=reason, operator=operator)
    info: dict[str, Any] = {
        "run_id": run_id,
        "request_id": posted.request.request_id,
        "operator": operator,
        "phase_before": posted.phase,
        "held_by": posted.held_by or None,
        "phase": posted.phase,
    }
    ended = False
    if wait > 0:
        deadline = time.monotonic() + wait
        while True:
            phase = inspect_run(fleet, run_id).state.phase
            info["phase"] = phase.value
            if phase in (Phase.CANCELLED, Phase.COMPLETED, Phase.FAILED, Phase.NEEDS_REVIEW):
                ended = phase is not Phase.NEEDS_REVIEW
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(0.2)  # polling the store with a deadline, for a person waiting
    if as_json:
        print_json(info)
    elif wait > 0:
        typer.echo(
            f"{run_id} is {info['phase']}"
            + ("" if ended else f" (cancel {posted.request.request_id} requested; not applied yet)")
        )
    else:
        held = f"; {posted.held_by} stops at its next guard" if posted.held_by else ""
        typer.echo(f"cancel {posted.request.request_id} of {run_id} requested by {operator}{held}")
    if wait > 0 and not ended:
        raise typer.Exit(EXIT_CHECK_FAILED)


class Decision(StrEnum):
    REPLAN = "replan"
    ABORT = "abort"
    REBASELINE = "rebaseline"


@app.command("review")
@ratchet_errors
def review_command(
    run_id: str,
    decision: Annotated[Decision, typer.Option("--decision")],
    key: Annotated[
        Path,
        typer.Option(
            "--key",
            help="Reviewer private key (PEM); - reads it from stdin. Read only after the "
            "environment was observed.",
        ),
    ],
    signer_id: Annotated[str | None, typer.Option("--id", help="Reviewer id.")] = None,
    incident: Annotated[
        str | None,
        typer.Option(
            help="rebaseline: the incident it resolves (default: the newest that reports a "
            "changed environment)."
        ),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Sign a decision on the run's open review case (replan | abort), or rebaseline a run
    frozen because its environment was changed behind it (the environment as observed
    now becomes its baseline; every approval of the old state is void), and re-enqueue."""
    # The key is read only once the environment was observed (nothing the observation
    # started is alive then); `--key -` reads it from stdin (no path on a command line).
    signer = keyfile.signer_id(key, signer_id, "reviewer")
    loader = keyfile.key_loader(key)
    if decision is Decision.REBASELINE:
        posted = rebaseline_run(
            Fleet.connect(), run_id, key=loader, reviewer_id=signer, incident_id=incident
        )
        claims_rb = posted.evidence.claims
        if not isinstance(claims_rb, RebaselineClaims):  # for the type checker
            raise ContractError("posted evidence is not a rebaseline decision")
        info_rb = {
            "run_id": run_id,
            "decision": decision.value,
            "reviewer_id": signer,
            "incident_id": claims_rb.incident_id,
            "nonce": claims_rb.nonce,
            "old_env_version": claims_rb.old_env_version,
            "new_env_version": claims_rb.new_env_version,
            "verified": posted.verified,
        }
        if as_json:
            print_json(info_rb)
        else:
            typer.echo(
                f"rebaseline signed for {run_id} ({claims_rb.incident_id}: version "
                f"{claims_rb.old_env_version} -> {claims_rb.new_env_version}) as "
                f"{signer}; run re-enqueued" + _unverified_note(posted.verified, "reviewer")
            )
        return
    posted = sign_review_for(
        Fleet.connect(), run_id, decision.value, key=loader, reviewer_id=signer
    )
    claims = posted.evidence.claims
    if not isinstance(claims, ReviewDecisionClaims):  # for the type checker
        raise ContractError("posted evidence is not a review decision")
    info = {
        "run_id": run_id,
        "decision": decision.value,
        "reviewer_id": signer,
        "case_id": claims.case_id,
        "nonce": claims.nonce,
        "verified": posted.verified,
    }
    if as_json:
        print_json(info)
    else:
        typer.echo(
            f"{decision.value} signed for {run_id} ({claims.case_id}) as "
            f"{signer}; run re-enqueued" + _unverified_note(posted.verified, "reviewer")
        )


def _unverified_note(verified: bool, role: str) -> str:
    if verified:
        return " (verified against the trust root)"
    env = f"RATCHET_{role.upper()}S_FILE"
    return (
        f"\nwarning: signed but NOT verified: no {role} trust root here (set {env}); "
        "a worker will refuse it if the signer is not trusted"
    )


# --- keys generate -------------------------------------------------------------------------------


class KeyKind(StrEnum):
    CHECKPOINT = "checkpoint"
    APPROVER = "approver"
    REVIEWER = "reviewer"


@keys_app.command("generate")
@ratchet_errors
def keys_generate(
    kind: Annotated[KeyKind, typer.Option("--kind")],
    out: Annotated[Path, typer.Option("--out", help="Folder to write into.")],
    signer_id: Annotated[
        str | None, typer.Option("--id", help="Signer id (approver or reviewer).")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Write a checkpoint key file, or an Ed25519 key pair, with owner-only permissions.

    checkpoint: OUT/checkpoint-keys.json ({"signing", "keys", "retired"}), for
    RATCHET_CHECKPOINT_KEYS_FILE. approver / reviewer: OUT/ROLE-ID.pem (private, for the
    signer only) and the public key added to OUT/ROLEs.json (for RATCHET_APPROVERS_FILE or
    RATCHET_REVIEWERS_FILE on the workers).
    """
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    if kind is KeyKind.CHECKPOINT:
        path = out / "checkpoint-keys.json"
        kid = f"k-{secrets.token_hex(4)}"
        doc = {"signing": kid, "keys": {kid: secrets.token_hex(32)}, "retired": []}
        write_private(path, json.dumps(doc).encode())
        info: dict[str, Any] = {"kind": kind.value, "path": str(path), "kid": kid}
    else:
        if not signer_id:
            raise ConfigurationError("--id is required for signer keys", field="id")
        private = Ed25519PrivateKey.generate()
        path = out / f"{kind.value}-{signer_id}.pem"
        write_private(
            path, private.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
        )
        public_hex = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()
        trust = out / f"{kind.value}s.json"
        roots = json.loads(trust.read_text()) if trust.exists() else {}
        roots[signer_id] = public_hex
        trust.write_text(json.dumps(roots, indent=2, sort_keys=True) + "\n")
        info = {
            "kind": kind.value,
            "id": signer_id,
            "private_key_path": str(path),
            "trust_file": str(trust),
            "public_key_hex": public_hex,
        }
    if as_json:
        print_json(info)
    else:
        typer.echo(
            f"wrote {info['path'] if 'path' in info else info['private_key_path']} (mode 0600)"
        )
