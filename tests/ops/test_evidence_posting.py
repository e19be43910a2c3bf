"""Evidence is checked when it is posted: an approval or decision the worker would refuse
is refused at once, with a typed error (one line and exit 2 on the command line), and
nothing reaches the run's inbox. Without a trust root the command says it did not verify."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

from ratchet.errors import ApprovalError, ReviewDecisionError
from ratchet.fleet.context import Fleet
from ratchet.ops import approve, inspect_run, post_approval, review
from ratchet.redis_server import RedisServer
from ratchet.runtime import ApprovalClaims, sign_approval
from ratchet.worker.job import execute_run
from tests.ops.helpers import (
    MakeWorkspace,
    run_awaiting_approval,
    run_in_review,
    trust_file,
    with_trust,
)
from tests.worker.conftest import CHECKPOINT_KEY_HEX

ALICE = Ed25519PrivateKey.generate()
RITA = Ed25519PrivateKey.generate()


@pytest.fixture
def approving(fleet: Fleet, tmp_path: Path) -> Fleet:
    return with_trust(
        fleet, approvers_file=trust_file(tmp_path / "approvers.json", {"alice": ALICE})
    )


def claims_for(fleet: Fleet, target: str, **changes: Any) -> ApprovalClaims:
    """Exact claims for ``target``'s pending write, with ``changes`` made."""
    run_id = target
    view = inspect_run(fleet, run_id)
    state, pending = view.state, view.state.pending
    assert pending is not None
    env = state.environment
    data: dict[str, Any] = {
        "task_id": state.task_id,
        "run_id": run_id,
        "policy_id": state.policy_id,
        "policy_version": state.policy_version,
        "action_id": pending.action.action_id,
        "idempotency_key": pending.action.idempotency_key,
        "intent_digest": pending.intent_digest,
        "env_instance_id": env.instance_id,
        "env_fingerprint": env.fingerprint,
        "env_version": env.version,
        "generation": view.generation,
        "nonce": f"n-{os.urandom(6).hex()}",
        "expires_at": fleet.store.server_time_ms() // 1000 + 600,
        "max_proposals": state.usage.proposals + 10,
    }
    data.update(changes)
    return ApprovalClaims.model_validate(data)


def test_an_approval_by_an_untrusted_key_is_refused_before_posting(
    approving: Fleet, workspace: MakeWorkspace
) -> None:
    run_id = run_awaiting_approval(approving, workspace, "r-post-untrusted")
    action_id = inspect_run(approving, run_id).state.pending.action.action_id  # type: ignore[union-attr]
    mallory = Ed25519PrivateKey.generate()
    with pytest.raises(ApprovalError) as err:
        approve(approving, run_id, action_id, key=mallory, approver_id="mallory")
    assert err.value.reason == "unknown_signer"
    with pytest.raises(ApprovalError) as err:  # a trusted name, the wrong key
        approve(approving, run_id, action_id, key=mallory, approver_id="alice")
    assert err.value.reason == "bad_signature"
    assert approving.store.records.inbox(run_id) == []
    assert inspect_run(approving, run_id).state.phase.value == "awaiting_approval"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("run_id", "r-another-run"),
        ("task_id", "another-task"),
        ("policy_version", "99"),
        ("intent_digest", "e" * 64),
        ("generation", 1),
        ("env_version", 999),
    ],
)
def test_an_approval_bound_to_anything_else_is_refused_before_posting(
    approving: Fleet, workspace: MakeWorkspace, field: str, value: Any
) -> None:
    run_id = run_awaiting_approval(approving, workspace, f"r-post-{field}")
    evidence = sign_approval(ALICE, "alice", claims_for(approving, run_id, **{field: value}))
    with pytest.raises(ApprovalError) as err:
        post_approval(approving, run_id, evidence)
    assert err.value.reason == "binding"
    assert approving.store.records.inbox(run_id) == []


def test_an_expired_approval_is_refused_by_the_stores_clock(
    approving: Fleet, workspace: MakeWorkspace
) -> None:
    run_id = run_awaiting_approval(approving, workspace, "r-post-expired")
    past = approving.store.server_time_ms() // 1000 - 1
    evidence = sign_approval(ALICE, "alice", claims_for(approving, run_id, expires_at=past))
    with pytest.raises(ApprovalError) as err:
        post_approval(approving, run_id, evidence)
    assert err.value.reason == "expired"


def test_a_replayed_approval_nonce_is_refused_before_posting(
    approving: Fleet, workspace: MakeWorkspace
) -> None:
    first = run_awaiting_approval(approving, workspace, "r-post-nonce-a")
    used = sign_approval(ALICE, "alice", claims_for(approving, first))
    assert post_approval(approving, first, used).verified is True
    assert execute_run(approving, first, owner="w-nonce").phase == "completed"
    # The same nonce, on another run's otherwise exact approval: the store remembers it.
    second = run_awaiting_approval(approving, workspace, "r-post-nonce-b")
    replay = sign_approval(ALICE, "alice", claims_for(approving, second, nonce=used.claims.nonce))
    with pytest.raises(ApprovalError) as err:
        post_approval(approving, second, replay)
    assert err.value.reason == "replayed_nonce"
    assert approving.store.records.inbox(second) == []


def test_a_decision_by_an_untrusted_reviewer_is_refused_before_posting(
    fleet: Fleet, workspace: MakeWorkspace, tmp_path: Path
) -> None:
    reviewing = with_trust(
        fleet, reviewers_file=trust_file(tmp_path / "reviewers.json", {"rita": RITA})
    )
    run_id = run_in_review(reviewing, workspace, "r-post-reviewer")
    with pytest.raises(ReviewDecisionError) as err:
        review(reviewing, run_id, "replan", key=Ed25519PrivateKey.generate(), reviewer_id="rita")
    assert err.value.reason == "bad_signature"
    assert reviewing.store.records.inbox(run_id) == []
    assert review(reviewing, run_id, "replan", key=RITA, reviewer_id="rita").verified


def test_without_a_trust_root_the_evidence_is_posted_and_marked_unverified(
    fleet: Fleet, workspace: MakeWorkspace
) -> None:
    run_id = run_awaiting_approval(fleet, workspace, "r-post-unverified")
    action_id = inspect_run(fleet, run_id).state.pending.action.action_id  # type: ignore[union-attr]
    posted = approve(fleet, run_id, action_id, key=ALICE, approver_id="alice")
    assert posted.verified is False
    assert len(fleet.store.records.inbox(run_id)) == 1


def test_the_approve_command_refuses_an_untrusted_key_in_one_line_with_exit_two(
    approving: Fleet, workspace: MakeWorkspace, redis_server: RedisServer, tmp_path: Path
) -> None:
    run_id = run_awaiting_approval(approving, workspace, "r-post-cli")
    action_id = inspect_run(approving, run_id).state.pending.action.action_id  # type: ignore[union-attr]
    pem = tmp_path / "approver-mallory.pem"
    pem.write_bytes(
        Ed25519PrivateKey.generate().private_bytes(
            Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env.update(
        RATCHET_REDIS_URL=redis_server.url,
        RATCHET_CHECKPOINT_KEY=CHECKPOINT_KEY_HEX,
        RATCHET_QUEUE=approving.settings.queue,
        RATCHET_APPROVERS_FILE=str(approving.settings.approvers_file),
    )

    def run(*args: str, trusted: bool = True) -> subprocess.CompletedProcess[str]:
        used = env if trusted else {k: v for k, v in env.items() if k != "RATCHET_APPROVERS_FILE"}
        return subprocess.run(
            [sys.executable, "-m", "ratchet.cli.entry", *args],
            env=used,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    refused = run("approve", run_id, action_id, "--key", str(pem))
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert refused.stderr.startswith("ratchet: error:") and "mallory" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    assert "Traceback" not in refused.stderr
    assert approving.store.records.inbox(run_id) == []
    unverified = run("approve", run_id, action_id, "--key", str(pem), trusted=False)
    assert unverified.returncode == 0, unverified.stderr
    assert "NOT verified" in unverified.stdout
