"""Retention on a real Redis: a run exports as one file that verifies offline with the key
ring only, a purge removes finished runs (exporting first when asked) and keeps everything
that is not finished, not verified or still holds unconsumed evidence, and a purged run's
id, keys and nonces are never reused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ratchet.errors import ApprovalError, IntegrityError, RunExistsError, RunNotFoundError
from ratchet.fleet.context import Fleet
from ratchet.leasing import run_keys
from ratchet.leasing.keyspace import INDEX_KEYS
from ratchet.ops import approve, inspect_run, post_approval, submit
from ratchet.ops.retention import (
    RetentionLoop,
    export_run,
    purge_finished,
    start_retention,
    verify_export,
    write_export,
)
from ratchet.redis_server import RedisServer
from ratchet.runtime import KeyRing
from ratchet.worker.job import execute_run
from tests.ops.helpers import (
    MakeWorkspace,
    poll,
    run_awaiting_approval,
    trust_file,
    with_trust,
)
from tests.worker.conftest import CHECKPOINT_KEY_HEX

ALICE = Ed25519PrivateKey.generate()


def finished(fleet: Fleet, workspace: MakeWorkspace, run_id: str) -> str:
    _root, document = workspace(runner="python")
    submit(fleet, document, run_id=run_id)
    if execute_run(fleet, run_id, owner="w").phase != "completed":
        raise AssertionError("the run did not complete")
    return run_id


def run_key_names(fleet: Fleet, run_id: str) -> set[str]:
    return {k.decode() for k in fleet.store.client.scan_iter(match=f"ratchet:{{{run_id}}}:*")}


def cli_env(redis_server: RedisServer | None, fleet: Fleet) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env.update(
        RATCHET_CHECKPOINT_KEY=CHECKPOINT_KEY_HEX,
        RATCHET_QUEUE=fleet.settings.queue,
        RATCHET_LOG_LEVEL="WARNING",
    )
    if redis_server is not None:
        env["RATCHET_REDIS_URL"] = redis_server.url
    return env


def ratchet(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ratchet.cli.entry", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_an_export_verifies_offline_and_any_change_to_it_is_refused(
    fleet: Fleet, workspace: MakeWorkspace, tmp_path: Path
) -> None:
    run_id = finished(fleet, workspace, "r-export")
    path = tmp_path / "out" / "r-export.ratchet-export"
    summary = write_export(fleet, run_id, path)
    assert (summary.run_id, summary.phase) == (run_id, "completed")
    assert summary.generation == inspect_run(fleet, run_id).generation
    assert path.stat().st_mode & 0o777 == 0o600
    # Offline: no store in the environment at all, only the key ring.
    done = ratchet(["verify", str(path), "--json"], cli_env(None, fleet), tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["verified"] is True
    blob = path.read_bytes()
    tampered = tmp_path / "tampered.ratchet-export"
    tampered.write_bytes(blob.replace(b'"history":["', b'"history":["9'))
    assert tampered.read_bytes() != blob
    refused = ratchet(["verify", str(tampered)], cli_env(None, fleet), tmp_path)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    other = KeyRing.from_secrets(
        {"k9": b"another-checkpoint-key-0123456789abcdef"}, signing_kid="k9"
    )
    with pytest.raises(IntegrityError):
        verify_export(other, blob)


def test_a_purge_exports_then_removes_a_finished_run_leaving_only_a_tombstone(
    fleet: Fleet, workspace: MakeWorkspace, tmp_path: Path
) -> None:
    run_id = finished(fleet, workspace, "r-purge")
    keep = finished(fleet, workspace, "r-young")
    assert len(run_key_names(fleet, run_id)) > 5
    assert run_keys(run_id).keys in run_key_names(fleet, run_id)  # its executed-key digests
    young = purge_finished(fleet, older_than_ms=3_600_000, export_dir=tmp_path / "x")
    assert young.purged == [] and inspect_run(fleet, run_id).state.phase.value == "completed"
    report = purge_finished(fleet, older_than_ms=0, export_dir=tmp_path / "exports", limit=1)
    assert report.purged == [run_id], report
    assert run_key_names(fleet, run_id) == {run_keys(run_id).tombstone}
    for index in INDEX_KEYS:
        assert fleet.store.client.zscore(index, run_id) is None, index
    assert verify_export(fleet.keyring, Path(report.exported[run_id]).read_bytes()).run_id == run_id
    with pytest.raises(RunNotFoundError, match="purged"):
        inspect_run(fleet, run_id)
    # A job for it (a stale queue entry) finds nothing and writes nothing.
    assert execute_run(fleet, run_id, owner="w").outcome == "no_run"
    assert run_key_names(fleet, run_id) == {run_keys(run_id).tombstone}
    # Its id is never issued again, so neither are the keys derived from it.
    _root, document = workspace(runner="python")
    with pytest.raises(RunExistsError):
        submit(fleet, document, run_id=run_id)
    assert inspect_run(fleet, keep).state.phase.value == "completed"


def test_a_purge_keeps_what_is_not_finished_held_or_holding_evidence(
    fleet: Fleet, workspace: MakeWorkspace, tmp_path: Path
) -> None:
    approving = with_trust(fleet, approvers_file=trust_file(tmp_path / "a.json", {"alice": ALICE}))
    waiting = run_awaiting_approval(approving, workspace, "r-waiting")
    held = finished(fleet, workspace, "r-held")
    assert fleet.store.acquire(held, owner="w-live", ttl_ms=60_000) is not None
    pending = finished(fleet, workspace, "r-evidence")
    waiting_view = inspect_run(approving, waiting)
    assert waiting_view.state.pending is not None
    # An approval left in a finished run's inbox that it never consumed is evidence.
    posted = approve(
        approving,
        waiting,
        waiting_view.state.pending.action.action_id,
        key=ALICE,
        approver_id="alice",
    )
    fleet.store.records.post_evidence(pending, posted.evidence.model_dump_json().encode())
    report = purge_finished(fleet, older_than_ms=0)
    assert report.purged == []
    assert report.kept[held].startswith("held by w-live")
    assert report.kept[pending].startswith("unconsumed evidence")
    assert waiting not in report.kept  # not finished: never even a candidate
    assert inspect_run(fleet, waiting).state.phase.value == "awaiting_approval"


def test_a_purged_runs_nonces_are_never_consumed_again(
    fleet: Fleet, workspace: MakeWorkspace, tmp_path: Path
) -> None:
    approving = with_trust(fleet, approvers_file=trust_file(tmp_path / "a.json", {"alice": ALICE}))
    first = run_awaiting_approval(approving, workspace, "r-nonce-1")
    view = inspect_run(approving, first)
    assert view.state.pending is not None
    posted = approve(
        approving, first, view.state.pending.action.action_id, key=ALICE, approver_id="alice"
    )
    assert execute_run(approving, first, owner="w").phase == "completed"
    assert purge_finished(approving, older_than_ms=0).purged == [first]
    second = run_awaiting_approval(approving, workspace, "r-nonce-2")
    replay = posted.evidence.model_copy(
        update={"claims": posted.evidence.claims.model_copy(update={"run_id": second})}
    )
    with pytest.raises(ApprovalError):
        post_approval(approving, second, replay)  # type: ignore[arg-type]
    assert fleet.store.nonce_claimed_by(posted.evidence.claims.nonce) == first


def test_the_purge_command_dry_runs_and_refuses_a_bad_duration_in_one_line(
    fleet: Fleet, workspace: MakeWorkspace, redis_server: RedisServer, tmp_path: Path
) -> None:
    run_id = finished(fleet, workspace, "r-cli-purge")
    env = cli_env(redis_server, fleet)
    dry = ratchet(["purge", "--finished-before", "0s", "--dry-run", "--json"], env, tmp_path)
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout)["purged"] == [run_id]
    assert inspect_run(fleet, run_id).state.phase.value == "completed"
    bad = ratchet(["purge", "--finished-before", "30 days"], env, tmp_path)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "duration" in bad.stderr
    exported = ratchet(
        ["export", run_id, "--out", str(tmp_path / "e.ratchet-export"), "--json"], env, tmp_path
    )
    assert exported.returncode == 0, exported.stderr
    assert json.loads(exported.stdout)["verified"] is True
    done = ratchet(["purge", "--finished-before", "0s", "--json"], env, tmp_path)
    assert json.loads(done.stdout)["purged"] == [run_id]
    shown = ratchet(["show", run_id], env, tmp_path)
    assert shown.returncode == 2 and "purged" in shown.stderr


def test_an_export_of_a_run_that_does_not_verify_is_refused(
    fleet: Fleet, workspace: MakeWorkspace
) -> None:
    run_id = finished(fleet, workspace, "r-bad-export")
    fleet.store.client.set(run_keys(run_id).ckpt, b"junk")
    with pytest.raises(IntegrityError):
        export_run(fleet, run_id)


def test_a_workers_retention_loop_purges_finished_runs_on_its_own(
    fleet: Fleet, workspace: MakeWorkspace, tmp_path: Path
) -> None:
    assert start_retention(fleet) is None  # off unless RATCHET_RETENTION_S is set
    run_id = finished(fleet, workspace, "r-loop")
    loop = RetentionLoop(fleet, older_than_ms=0, every_s=0.05, export_dir=tmp_path / "kept").start()
    try:
        poll(
            lambda: fleet.store.tombstone(run_id) is not None,
            deadline_s=30,
            what="the worker's retention purged the finished run",
        )
    finally:
        loop.stop()
    assert (tmp_path / "kept" / f"{run_id}.ratchet-export").exists()
    on = Fleet.connect(fleet.settings.model_copy(update={"retention_s": 3600}))
    started = start_retention(on)
    assert started is not None
    started.stop()
