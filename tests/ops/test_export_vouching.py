"""What `ratchet export` and `ratchet verify` vouch for, on a real Redis and through the
real CLI: the signed parts whole; history, incidents and inbox record by record, each only
by its own seal or signature. A record pushed into Redis by hand (an ``operator_retry``
"by alice", a forged incident, a forged inbox entry) never reads as authentic; a sealed
record changed in Redis refuses the export; nothing stored is changed by either."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ratchet.errors import IntegrityError
from ratchet.fleet.context import Fleet
from ratchet.leasing import RedisStore, run_keys
from ratchet.ops import approve, cancel, inspect_run, retry, submit
from ratchet.ops.retention import export_run, verify_export, write_export
from ratchet.redis_server import RedisServer
from ratchet.runtime import ApprovalClaims, sign_approval
from ratchet.runtime.canonical import Domain, canonical_json, strict_json_loads
from ratchet.runtime.signing import open_envelope, seal_envelope
from ratchet.worker.job import execute_run
from tests.ops.helpers import MakeWorkspace, run_awaiting_approval, trust_file, with_trust
from tests.worker.conftest import CHECKPOINT_KEY_HEX

ALICE = Ed25519PrivateKey.generate()
MALLORY = Ed25519PrivateKey.generate()
SIGNED_PARTS = {"document", "checkpoint", "archive", "consumed_nonces"}


def finished(fleet: Fleet, workspace: MakeWorkspace, run_id: str) -> str:
    _root, document = workspace(runner="python")
    submit(fleet, document, run_id=run_id)
    if execute_run(fleet, run_id, owner="w").phase != "completed":
        raise AssertionError("the run did not complete")
    return run_id


def cli_env(redis_server: RedisServer | None, fleet: Fleet, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env.update(
        RATCHET_CHECKPOINT_KEY=CHECKPOINT_KEY_HEX,
        RATCHET_QUEUE=fleet.settings.queue,
        RATCHET_LOG_LEVEL="WARNING",
        **extra,
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


def verified(path: Path, env: dict[str, str], cwd: Path) -> tuple[str, dict[str, Any]]:
    """`ratchet verify` of ``path`` (offline: no store in ``env``), as text and as JSON."""
    text = ratchet(["verify", str(path)], env, cwd)
    assert text.returncode == 0, text.stderr
    as_json = ratchet(["verify", str(path), "--json"], env, cwd)
    assert as_json.returncode == 0, as_json.stderr
    for out in (text.stdout, as_json.stdout):
        assert CHECKPOINT_KEY_HEX[:16] not in out.lower()  # no key material, ever
    return text.stdout, json.loads(as_json.stdout)


def part_line(text: str, name: str) -> str:
    lines = [line for line in text.splitlines() if line.startswith(f"  {name} ")]
    assert len(lines) == 1, text
    return lines[0]


def records(report: dict[str, Any], part: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = report["parts"][part]["records"]
    return found


def snapshot(client: redis.Redis) -> dict[bytes, bytes | None]:
    """Every key of the store with its serialised value: what export and verify may not
    change."""
    return {key: client.dump(key) for key in client.scan_iter()}


def refused_in_one_line(done: subprocess.CompletedProcess[str], *words: str) -> None:
    assert done.returncode == 2, done.stdout
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    for word in words:
        assert word in done.stderr, done.stderr


def newest(client: redis.Redis, key: str) -> bytes:
    """The newest entry of a list as stored."""
    item = client.lindex(key, 0)
    assert isinstance(item, bytes), item
    return item


def forged_approval(run_id: str) -> bytes:
    """Approval-shaped evidence "by alice", signed with another key."""
    claims = ApprovalClaims(
        task_id="t",
        run_id=run_id,
        policy_id="p",
        policy_version="1",
        action_id="a-1",
        idempotency_key="k-1",
        intent_digest="0" * 64,
        env_instance_id="e",
        env_fingerprint="0" * 64,
        env_version=1,
        generation=1,
        nonce="n-forged",
        expires_at=2**40,
        max_proposals=10,
    )
    return sign_approval(MALLORY, "alice", claims).model_dump_json().encode()


def test_a_genuine_export_says_what_it_vouches_for_part_by_part(
    fleet: Fleet, workspace: MakeWorkspace, redis_server: RedisServer, tmp_path: Path
) -> None:
    approvers = trust_file(tmp_path / "approvers.json", {"alice": ALICE})
    approving = with_trust(fleet, approvers_file=approvers)
    run_id = run_awaiting_approval(approving, workspace, "r-genuine")
    retry(fleet, run_id, reason="the agent's host is back", operator="bob")
    pending = inspect_run(fleet, run_id).state.pending
    assert pending is not None
    approve(approving, run_id, pending.action.action_id, key=ALICE, approver_id="alice")
    cancel(fleet, run_id, reason="not needed any more", operator="carol")
    stored_incident = newest(fleet.store.client, run_keys(run_id).incidents)
    assert b'"seal":{"kid":"env","mac":"' in stored_incident  # sealed as it was written
    path = tmp_path / "genuine.ratchet-export"
    with_roots = cli_env(redis_server, fleet, RATCHET_APPROVERS_FILE=str(approvers))
    exported = ratchet(["export", run_id, "--out", str(path)], with_roots, tmp_path)
    assert exported.returncode == 0, exported.stderr
    assert "NOT vouched for" in part_line(exported.stdout, "history")

    offline = cli_env(None, fleet, RATCHET_APPROVERS_FILE=str(approvers))
    text, report = verified(path, offline, tmp_path)
    assert report["verified"] is True and report["format"] == 2
    assert set(report["vouched_for"]) == SIGNED_PARTS | {"incidents", "inbox"}
    assert report["not_vouched_for"] == ["history"]
    for name in SIGNED_PARTS:
        assert report["parts"][name]["vouched"] and report["parts"][name]["complete"]
    for name in ("history", "incidents", "inbox"):
        assert report["parts"][name]["complete"] is False  # which records exist: as stored
    (retried,) = [r for r in records(report, "incidents") if r["kind"] == "operator_retry"]
    assert (retried["status"], retried["by"], retried["vouched"]) == ("sealed", "bob", True)
    inbox = {r["kind"]: r for r in records(report, "inbox")}
    assert (inbox["cancel"]["status"], inbox["cancel"]["by"]) == ("sealed", "carol")
    assert (inbox["approval"]["status"], inbox["approval"]["by"]) == ("signed", "alice")
    assert {r["status"] for r in records(report, "history")} == {"unsigned"}
    assert "NOT vouched for" in part_line(text, "history")
    for name in ("document", "checkpoint", "archive", "incidents", "inbox"):
        assert part_line(text, name).split()[1:3] == ["vouched", "for:"], text
    assert "consumed nonces  vouched for:" in text

    # Without the approvers' public keys the approval cannot be checked: not vouched for.
    text, report = verified(path, cli_env(None, fleet), tmp_path)
    assert "inbox" in report["not_vouched_for"]
    (approval,) = [r for r in records(report, "inbox") if r["kind"] == "approval"]
    assert approval["status"] == "unchecked" and "no approver trust roots" in approval["note"]
    assert "NOT vouched for" in part_line(text, "inbox")
    assert "by alice" in text and "unchecked: no approver trust roots given" in text


def test_records_forged_in_redis_by_hand_never_read_as_authentic(
    fleet: Fleet, workspace: MakeWorkspace, redis_server: RedisServer, tmp_path: Path
) -> None:
    run_id = finished(fleet, workspace, "r-forged")
    fleet.store.records.record_incident(
        run_id, {"kind": "note", "message": "a worker's own record"}
    )
    keys = run_keys(run_id)
    hand = redis.Redis.from_url(redis_server.url)  # a raw client: no key ring at all
    retry_by_alice = {
        "id": "inc-forged",
        "kind": "operator_retry",
        "operator": "alice",
        "reason": "approved by alice",
    }
    hand.lpush(keys.history, json.dumps(retry_by_alice))
    hand.lpush(keys.history, "99|99|9|alice|c-forged|" + "0" * 64 + "|1700000000000")
    hand.lpush(keys.incidents, "1700000000000|" + json.dumps(retry_by_alice))
    hand.lpush(keys.inbox, json.dumps({"kind": "approval", "approver_id": "alice"}))
    hand.lpush(keys.inbox, forged_approval(run_id))
    approvers = trust_file(tmp_path / "approvers.json", {"alice": ALICE})
    before = snapshot(hand)

    path = tmp_path / "forged.ratchet-export"
    exported = ratchet(
        ["export", run_id, "--out", str(path)], cli_env(redis_server, fleet), tmp_path
    )
    assert exported.returncode == 0, exported.stderr
    for roots in ({}, {"RATCHET_APPROVERS_FILE": str(approvers)}):
        text, report = verified(path, cli_env(None, fleet, **roots), tmp_path)
        assert set(report["not_vouched_for"]) == {"history", "incidents", "inbox"}
        assert set(report["vouched_for"]) == SIGNED_PARTS
        by_alice = [
            (part, r)
            for part in ("history", "incidents", "inbox")
            for r in records(report, part)
            if "alice" in json.dumps(r)
        ]
        assert {part for part, _ in by_alice} == {"history", "incidents", "inbox"}
        for part, record in by_alice:
            assert record["vouched"] is False, (part, record)
            assert record["status"] in {"unsigned", "unchecked", "forged"}, (part, record)
        (forged_retry,) = [r for r in records(report, "incidents") if r["id"] == "inc-forged"]
        assert forged_retry["status"] == "unsigned" and forged_retry["note"].startswith("unsigned")
        (own,) = [r for r in records(report, "incidents") if r["kind"] == "note"]
        assert own["status"] == "sealed"  # the genuine record beside it still reads as such
        # Every line of the text that names alice says the record is not authentic.
        alice_lines = [line for line in text.splitlines() if "alice" in line]
        assert len(alice_lines) >= 4, text
        for line in alice_lines:
            assert any(w in line for w in (": unsigned", ": forged", ": unchecked")), line
        for name in ("history", "incidents", "inbox"):
            assert "NOT vouched for" in part_line(text, name)
    (approval,) = [r for r in records(report, "inbox") if r["kind"] == "approval"]
    assert approval["status"] == "forged" and "does not verify" in approval["note"]
    # Neither the export nor the verifications changed anything stored.
    assert snapshot(hand) == before


def test_a_sealed_incident_changed_in_redis_refuses_the_export(
    fleet: Fleet, workspace: MakeWorkspace, redis_server: RedisServer, tmp_path: Path
) -> None:
    run_id = run_awaiting_approval(fleet, workspace, "r-tampered")
    retry(fleet, run_id, reason="the agent's host is back", operator="bob")
    keys = run_keys(run_id)
    hand = redis.Redis.from_url(redis_server.url)
    genuine = newest(hand, keys.incidents)
    assert b'"operator":"bob"' in genuine
    by_alice = genuine.replace(b'"operator":"bob"', b'"operator":"alice"')
    hand.lset(keys.incidents, 0, by_alice)  # type: ignore[arg-type]  # bytes, as stored
    path = tmp_path / "tampered.ratchet-export"
    done = ratchet(["export", run_id, "--out", str(path)], cli_env(redis_server, fleet), tmp_path)
    refused_in_one_line(done, "incident #0", "seal does not verify")
    assert not path.exists()
    with pytest.raises(IntegrityError) as caught:
        write_export(fleet, run_id, path)
    assert caught.value.context["check"] == "incident_seal" and not path.exists()
    # The file as an exporter that skipped the check would write it: verify refuses it.
    path.write_bytes(export_run(fleet, run_id))
    refused_in_one_line(ratchet(["verify", str(path)], cli_env(None, fleet), tmp_path), "seal")
    with pytest.raises(IntegrityError, match="incident #0"):
        verify_export(fleet.keyring, path.read_bytes())

    # A genuine sealed incident copied from another run is refused the same way.
    hand.lset(keys.incidents, 0, genuine)  # type: ignore[arg-type]  # bytes, as stored
    assert write_export(fleet, run_id, path).run_id == run_id
    other = run_awaiting_approval(fleet, workspace, "r-other")
    hand.lpush(run_keys(other).incidents, genuine)
    with pytest.raises(IntegrityError, match="seal does not verify"):
        write_export(fleet, other, tmp_path / "other.ratchet-export")


def test_a_cancel_request_changed_in_redis_refuses_the_export(
    fleet: Fleet, workspace: MakeWorkspace, redis_server: RedisServer, tmp_path: Path
) -> None:
    run_id = run_awaiting_approval(fleet, workspace, "r-cancel-tampered")
    cancel(fleet, run_id, reason="not needed any more", operator="carol")
    keys = run_keys(run_id)
    hand = redis.Redis.from_url(redis_server.url)
    genuine = newest(hand, keys.inbox)
    assert b'"by":"carol"' in genuine
    by_alice = genuine.replace(b'"by":"carol"', b'"by":"alice"')
    hand.lset(keys.inbox, 0, by_alice)  # type: ignore[arg-type]  # bytes, as stored
    done = ratchet(
        ["export", run_id, "--out", str(tmp_path / "c.ratchet-export")],
        cli_env(redis_server, fleet),
        tmp_path,
    )
    refused_in_one_line(done, "inbox entry #0", "does not verify")
    with pytest.raises(IntegrityError) as caught:
        verify_export(fleet.keyring, export_run(fleet, run_id))
    assert caught.value.context["check"] == "inbox_seal"


def test_records_stored_before_they_were_sealed_export_as_unsigned_and_old_files_verify(
    fleet: Fleet, workspace: MakeWorkspace
) -> None:
    run_id = finished(fleet, workspace, "r-legacy")
    # As a worker of the previous version wrote it: a store without a key ring.
    RedisStore(fleet.store.client).records.record_incident(
        run_id, {"kind": "job_error", "attempt": 1}
    )
    blob = export_run(fleet, run_id)
    summary = verify_export(fleet.keyring, blob)
    incidents = summary.as_dict()["parts"]["incidents"]
    assert [r["status"] for r in incidents["records"]] == ["unsigned"]
    assert incidents["vouched"] is False and summary.export_format == 2

    # A format 1 file (made before records were sealed: incidents as read, with at_ms).
    body = strict_json_loads(open_envelope(fleet.keyring, blob, domain=Domain.EXPORT))
    assert isinstance(body, dict)
    old_incidents = []
    for raw in body["incidents"]:
        at, _, record = raw.partition("|")
        old_incidents.append({**json.loads(record), "at_ms": int(at)})
    old = {**body, "format": 1, "incidents": old_incidents}
    old_blob = seal_envelope(fleet.keyring, canonical_json(old), domain=Domain.EXPORT)
    old_summary = verify_export(fleet.keyring, old_blob)
    report = old_summary.as_dict()
    assert report["format"] == 1 and report["verified"] is True
    assert set(report["not_vouched_for"]) == {"history", "incidents"}
    assert [r["status"] for r in report["parts"]["incidents"]["records"]] == ["unsigned"]
    assert report["parts"]["incidents"]["records"][0]["kind"] == "job_error"
    assert old_summary.generation == summary.generation


def test_an_export_whose_consumed_nonces_are_not_the_checkpoints_is_refused(
    fleet: Fleet, workspace: MakeWorkspace
) -> None:
    run_id = finished(fleet, workspace, "r-nonces")
    body = strict_json_loads(
        open_envelope(fleet.keyring, export_run(fleet, run_id), domain=Domain.EXPORT)
    )
    assert isinstance(body, dict)
    claimed = {**body, "consumed_nonces": [*body["consumed_nonces"], "n-never-consumed"]}
    blob = seal_envelope(fleet.keyring, canonical_json(claimed), domain=Domain.EXPORT)
    with pytest.raises(IntegrityError) as caught:
        verify_export(fleet.keyring, blob)
    assert caught.value.context["check"] == "nonces"
    inbox = [base64.b64encode(b"\xff not base64 inside").decode()[:-1] + "!"]
    broken = {**body, "inbox": inbox}
    with pytest.raises(IntegrityError, match="not base64"):
        verify_export(
            fleet.keyring,
            seal_envelope(fleet.keyring, canonical_json(broken), domain=Domain.EXPORT),
        )
