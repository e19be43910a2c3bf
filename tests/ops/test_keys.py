"""Key rotation, retirement and revocation, with real runs on a real Redis."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ratchet.errors import ApprovalError, CheckpointError, ReviewDecisionError
from ratchet.fleet.context import Fleet
from ratchet.fleet.settings import Settings
from ratchet.ops import approve, inspect_run, review, submit
from ratchet.redis_server import RedisServer
from ratchet.runtime.signing import parse_envelope
from ratchet.worker.job import execute_run
from tests.ops.helpers import (
    MakeWorkspace,
    run_awaiting_approval,
    run_in_review,
    trust_file,
    with_trust,
)

pytestmark = pytest.mark.slow

RATCHET = [sys.executable, "-m", "ratchet.cli.entry"]


def ratchet(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*RATCHET, *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture
def keyed(
    redis_server: RedisServer, settings: Settings, tmp_path: Path
) -> tuple[Settings, dict[str, str], Path]:
    """Settings and a CLI environment using a checkpoint key file (not the env key)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env.update(
        RATCHET_REDIS_URL=redis_server.url,
        RATCHET_QUEUE=settings.queue,
        RATCHET_LOG_LEVEL="WARNING",
    )
    made = ratchet(
        "keys",
        "generate",
        "--kind",
        "checkpoint",
        "--out",
        str(tmp_path / "k"),
        "--json",
        env=env,
        cwd=tmp_path,
    )
    assert made.returncode == 0, made.stderr
    path = Path(json.loads(made.stdout)["path"])
    env["RATCHET_CHECKPOINT_KEYS_FILE"] = str(path)
    keyed_settings = settings.model_copy(
        update={"checkpoint_key": None, "checkpoint_keys_file": path}
    )
    return keyed_settings, env, path


def kid_of(fleet: Fleet, run_id: str) -> str:
    blob = fleet.store.read_run(run_id, with_checkpoint=True).checkpoint
    assert blob is not None
    return parse_envelope(blob)[0].kid


def test_a_run_restores_across_a_rotation_and_re_signs_with_the_new_key(
    keyed: tuple[Settings, dict[str, str], Path], workspace: MakeWorkspace, tmp_path: Path
) -> None:
    settings, env, path = keyed
    old = Fleet.connect(settings)
    _root, document = workspace()
    run_id = submit(old, document, run_id="r-rotate-1")
    first_kid = kid_of(old, run_id)
    rotated = ratchet("keys", "rotate", "--json", env=env, cwd=tmp_path)
    assert rotated.returncode == 0, rotated.stderr
    info = json.loads(rotated.stdout)
    assert info["previous"] == first_kid and info["signing"] != first_kid
    assert set(info["kids"]) == {first_kid, info["signing"]}
    assert (path.stat().st_mode & 0o777) == 0o600
    key_material = json.loads(path.read_text())["keys"][info["signing"]]
    assert key_material not in rotated.stdout + rotated.stderr
    new = Fleet.connect(settings)  # a worker restarted after the rotation
    report = execute_run(new, run_id, owner="w-rotated")
    assert (report.outcome, report.phase) == ("finished", "completed")
    assert kid_of(new, run_id) == info["signing"]
    # Every run now verifies under the new key: the old one can be retired safely.
    retired = ratchet("keys", "retire", first_kid, "--json", env=env, cwd=tmp_path)
    assert retired.returncode == 0, retired.stderr
    assert json.loads(retired.stdout)["retired"] == [first_kid]
    assert inspect_run(Fleet.connect(settings), run_id).state.phase.value == "completed"


def test_retiring_a_key_still_in_use_is_refused_and_forced_retirement_fails_closed_visibly(
    keyed: tuple[Settings, dict[str, str], Path], workspace: MakeWorkspace, tmp_path: Path
) -> None:
    settings, env, _path = keyed
    fleet = Fleet.connect(settings)
    run_id = run_awaiting_approval(fleet, workspace, "r-retire-1")
    old_kid = kid_of(fleet, run_id)
    assert ratchet("keys", "rotate", env=env, cwd=tmp_path).returncode == 0
    refused = ratchet("keys", "retire", old_kid, env=env, cwd=tmp_path)
    assert refused.returncode == 2
    assert run_id in refused.stderr and "still have a current checkpoint" in refused.stderr
    signing = ratchet(
        "keys",
        "retire",
        json.loads(ratchet("keys", "list", "--json", env=env, cwd=tmp_path).stdout)["checkpoint"][
            "signing"
        ],
        env=env,
        cwd=tmp_path,
    )
    assert signing.returncode == 2 and "signing key" in signing.stderr
    forced = ratchet("keys", "retire", old_kid, "--force", env=env, cwd=tmp_path)
    assert forced.returncode == 0, forced.stderr
    shown = ratchet("show", run_id, env=env, cwd=tmp_path)
    assert shown.returncode == 2
    assert "checkpoint was signed with a retired key" in shown.stderr
    listed = json.loads(ratchet("runs", "--json", env=env, cwd=tmp_path).stdout)["runs"]
    assert run_id in {r["run_id"] for r in listed}  # listed unverified: show verifies
    # A worker refuses to restore it and records why; nothing runs.
    with pytest.raises(CheckpointError) as refused_restore:
        inspect_run(Fleet.connect(settings), run_id)
    assert refused_restore.value.reason == "retired_kid"
    report = execute_run(Fleet.connect(settings), run_id, owner="w-after-retire")
    assert report.outcome == "restore_refused" and report.detail.startswith("retired_kid")
    incidents = Fleet.connect(settings).store.records.incidents(run_id)
    assert incidents[0]["reason"] == "retired_kid"


def test_a_revoked_approvers_approval_is_refused_and_the_run_keeps_waiting(
    fleet: Fleet, workspace: MakeWorkspace, tmp_path: Path
) -> None:
    alice = Ed25519PrivateKey.generate()
    trust = trust_file(tmp_path / "approvers.json", {"alice": alice})
    fleet = with_trust(fleet, approvers_file=trust)
    run_id = run_awaiting_approval(fleet, workspace, "r-revoke-approver")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    revoked = ratchet(
        "keys",
        "revoke",
        "--role",
        "approver",
        "--id",
        "alice",
        "--file",
        str(trust),
        "--json",
        env=env,
        cwd=tmp_path,
    )
    assert revoked.returncode == 0, revoked.stderr
    assert json.loads(trust.read_text())["_revoked"] == ["alice"]
    fleet = with_trust(fleet, approvers_file=trust)  # workers restarted with the new file
    assert fleet.approvers is not None and "alice" in fleet.approvers.revoked
    pending = inspect_run(fleet, run_id).state.pending
    assert pending is not None
    with pytest.raises(ApprovalError) as err:  # refused before it is posted
        approve(fleet, run_id, pending.action.action_id, key=alice, approver_id="alice")
    assert err.value.reason == "revoked_signer"
    assert fleet.store.records.inbox(run_id) == []
    # Posted from somewhere that cannot check it: the worker's own check refuses it.
    unchecked = with_trust(fleet, approvers_file=None)
    posted = approve(unchecked, run_id, pending.action.action_id, key=alice, approver_id="alice")
    assert posted.verified is False
    report = execute_run(fleet, run_id, owner="w-after-revoke")
    assert report.phase == "awaiting_approval"
    view = inspect_run(fleet, run_id)
    assert view.state.phase.value == "awaiting_approval" and not view.state.executed
    assert view.incidents[0]["kind"] == "evidence_refused"
    assert view.incidents[0]["reason"] == "revoked_signer"


def test_a_revoked_reviewers_decision_keeps_the_run_frozen(
    fleet: Fleet, workspace: MakeWorkspace, tmp_path: Path
) -> None:
    rita = Ed25519PrivateKey.generate()
    trust = trust_file(tmp_path / "reviewers.json", {"rita": rita})
    fleet = with_trust(fleet, reviewers_file=trust)
    run_id = run_in_review(fleet, workspace, "r-revoke-reviewer")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env["RATCHET_REVIEWERS_FILE"] = str(trust)
    assert (
        ratchet(
            "keys", "revoke", "--role", "reviewer", "--id", "rita", env=env, cwd=tmp_path
        ).returncode
        == 0
    )
    unknown = ratchet(
        "keys", "revoke", "--role", "reviewer", "--id", "nobody", env=env, cwd=tmp_path
    )
    assert unknown.returncode == 2 and "no reviewer 'nobody'" in unknown.stderr
    fleet = with_trust(fleet, reviewers_file=trust)
    with pytest.raises(ReviewDecisionError) as err:  # refused before it is posted
        review(fleet, run_id, "replan", key=rita, reviewer_id="rita")
    assert err.value.reason == "revoked_signer"
    assert fleet.store.records.inbox(run_id) == []
    assert (
        review(
            with_trust(fleet, reviewers_file=None), run_id, "replan", key=rita, reviewer_id="rita"
        ).verified
        is False
    )
    report = execute_run(fleet, run_id, owner="w-after-revoke")
    assert report.phase == "needs_review"
    view = inspect_run(fleet, run_id)
    assert view.state.review is not None and view.state.review.decision is None
    assert view.incidents[0]["reason"] == "revoked_signer"
