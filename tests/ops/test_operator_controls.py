"""Ending and re-baselining runs on a real Redis with real workers' jobs: a cancel ends a
running, waiting, queued or frozen run at its next safe point through the fenced path,
never abandoning a write in an unknown state; a reviewer's signed rebaseline makes a
workspace a human edited the run's new baseline and voids the approvals of the old one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

from ratchet.adapters.workspace import WorkspaceAdapter
from ratchet.chaos.failpoints import FailpointFired
from ratchet.chaos.hooks import DrillHooks
from ratchet.demo.examples import RIGHT_GREETING
from ratchet.errors import ContractError, ReviewDecisionError, RunNotFoundError
from ratchet.fleet.context import Fleet
from ratchet.fleet.control import new_cancel_request, seal_cancel
from ratchet.ops import approve, cancel, inspect_run, rebaseline, review, submit
from ratchet.ops.diagnosis import diagnose
from ratchet.redis_server import RedisServer
from ratchet.runtime import CrashWindow, KeyRing, TraceOutcome
from ratchet.worker.job import execute_run
from ratchet.worker.jobprotocol import JobReport
from tests.ops.helpers import (
    MakeWorkspace,
    poll,
    run_awaiting_approval,
    run_in_review,
    trust_file,
    with_trust,
)
from tests.worker.conftest import CHECKPOINT_KEY_HEX

ALICE = Ed25519PrivateKey.generate()
RITA = Ed25519PrivateKey.generate()


@pytest.fixture
def trusted(fleet: Fleet, tmp_path: Path) -> Fleet:
    return with_trust(
        fleet,
        approvers_file=trust_file(tmp_path / "approvers.json", {"alice": ALICE}),
        reviewers_file=trust_file(tmp_path / "reviewers.json", {"rita": RITA}),
    )


def effects(root: Path) -> int:
    with WorkspaceAdapter(root, ["app.py"]) as adapter:
        return adapter.effects


def last_event(fleet: Fleet, run_id: str) -> dict[str, Any]:
    event = inspect_run(fleet, run_id).state.trace[-1]
    return {"outcome": event.outcome, **event.detail}


# --- cancel --------------------------------------------------------------------------------


def test_a_run_waiting_for_approval_is_cancelled_attributed_and_its_write_dropped(
    trusted: Fleet, workspace: MakeWorkspace
) -> None:
    run_id = run_awaiting_approval(trusted, workspace, "r-wait")
    posted = cancel(trusted, run_id, reason="task withdrawn", operator="olga")
    assert posted.phase == "awaiting_approval" and posted.held_by == ""
    report = execute_run(trusted, run_id, owner="w-2")
    assert (report.outcome, report.phase) == ("cancelled", "cancelled")
    event = last_event(trusted, run_id)
    assert event["outcome"] is TraceOutcome.CANCELLED
    assert (event["by"], event["request_id"], event["reason"]) == (
        "olga",
        posted.request.request_id,
        "task withdrawn",
    )
    assert "dropped_key" in event
    view = inspect_run(trusted, run_id)
    assert view.state.pending is None and view.snapshot.owner in ("", None)
    # A cancelled run stays cancelled: a later job leaves it untouched.
    assert execute_run(trusted, run_id, owner="w-3").outcome == "terminal"


def test_a_run_a_worker_is_stepping_stops_at_its_next_guard(
    fleet: Fleet, workspace: MakeWorkspace
) -> None:
    allowing = Fleet.connect(
        fleet.settings.model_copy(update={"agents": ("tests.worker",), "max_steps_per_job": 5000})
    )
    root, document = workspace()
    scenario = document.scenario.model_copy(
        update={
            "budgets": document.scenario.budgets.model_copy(
                update={"proposals": 5000, "steps": 5000}
            )
        }
    )
    run_id = submit(
        allowing,
        document.model_copy(
            update={"agent": "tests.worker.agent_probe:reader", "scenario": scenario}
        ),
    )
    reports: list[JobReport] = []
    job = threading.Thread(
        target=lambda: reports.append(execute_run(allowing, run_id, owner="w-busy")), daemon=True
    )
    job.start()
    poll(
        lambda: inspect_run(allowing, run_id).generation >= 4,
        deadline_s=60,
        what="the worker stepping the run",
    )
    posted = cancel(allowing, run_id, reason="stop it", operator="olga")
    assert posted.held_by.startswith("w-busy")
    job.join(timeout=60)
    assert not job.is_alive() and reports[0].outcome == "cancelled"
    view = inspect_run(allowing, run_id)
    assert view.state.phase.value == "cancelled"
    assert view.state.trace[-1].detail["by"] == "olga"
    assert not view.snapshot.lease_live
    assert effects(root) == 0


def test_a_run_whose_agent_cannot_be_loaded_is_cancelled_without_loading_it(
    fleet: Fleet, workspace: MakeWorkspace
) -> None:
    _root, document = workspace()
    run_id = submit(
        Fleet.connect(fleet.settings.model_copy(update={"agents": ("tests.worker",)})),
        document.model_copy(update={"agent": "tests.worker.agent_probe:make"}),
    )
    assert execute_run(fleet, run_id, owner="w").outcome == "restore_refused"
    cancel(fleet, run_id, reason="agent retired", operator="olga")
    assert execute_run(fleet, run_id, owner="w").outcome == "cancelled"


def test_a_run_frozen_by_a_human_edit_is_cancelled_and_the_edit_recorded(
    trusted: Fleet, workspace: MakeWorkspace
) -> None:
    run_id = run_awaiting_approval(trusted, workspace, "r-edited")
    root = Path(inspect_run(trusted, run_id).document.environment.root)
    (root / "app.py").write_text("print('edited by a human')\n")
    assert execute_run(trusted, run_id, owner="w").outcome == "restore_refused"
    cancel(trusted, run_id, reason="edited by hand", operator="olga")
    assert execute_run(trusted, run_id, owner="w").outcome == "cancelled"
    event = last_event(trusted, run_id)
    with WorkspaceAdapter(root, ["app.py"]) as adapter:
        assert event["env_version_now"] == adapter.observe().version
    # Ended, and said so: the run's checkpoint does not explain this environment.
    assert "not reconciled" in str(event["environment"])
    stop = inspect_run(trusted, run_id).state.stop_reason or ""
    assert "changed behind the run" in stop


@pytest.mark.parametrize(
    ("window", "written"),
    [
        (CrashWindow.AFTER_PENDING_BEFORE_ADAPTER, 0),
        (CrashWindow.AFTER_ADAPTER_BEFORE_RECEIPT, 1),
    ],
)
def test_a_write_of_unknown_outcome_is_settled_by_its_key_before_the_run_ends(
    fleet: Fleet, workspace: MakeWorkspace, window: CrashWindow, written: int
) -> None:
    root, document = workspace(runner="python")
    run_id = submit(fleet, document)

    def die(seen: CrashWindow) -> None:
        if seen is window:
            raise FailpointFired(seen.value)

    with pytest.raises(FailpointFired):
        execute_run(fleet, run_id, owner="w-dead", hooks=DrillHooks(probe=die))
    poll(
        lambda: not fleet.store.read_run(run_id).lease_live,
        deadline_s=30,
        what="the dead worker's lease to expire",
    )
    cancel(fleet, run_id, reason="stop", operator="olga")
    assert execute_run(fleet, run_id, owner="w-next").outcome == "cancelled"
    event = last_event(fleet, run_id)
    view = inspect_run(fleet, run_id)
    if written:
        assert event["executed_key"] == view.state.executed[-1].idempotency_key
        assert (root / "app.py").read_text() == RIGHT_GREETING
    else:
        assert event["looked_up"] == "absent" and not view.state.executed
    assert effects(root) == written


def test_a_cancel_request_that_does_not_verify_is_never_acted_on(
    fleet: Fleet, workspace: MakeWorkspace
) -> None:
    _root, document = workspace(runner="python")
    run_id = submit(fleet, document)
    other_ring = KeyRing.from_secrets(
        {"k9": b"not-the-fleet-key-0123456789abcdef"}, signing_kid="k9"
    )
    forged = new_cancel_request(run_id, by="mallory", reason="forged", now_ms=1)
    fleet.store.records.post_evidence(run_id, seal_cancel(other_ring, forged))
    assert execute_run(fleet, run_id, owner="w").phase == "completed"
    kinds = [i["kind"] for i in inspect_run(fleet, run_id).incidents]
    assert "control_refused" in kinds


def test_what_cannot_be_cancelled_is_refused_with_nothing_posted(
    fleet: Fleet, workspace: MakeWorkspace
) -> None:
    _root, document = workspace(runner="python")
    done = submit(fleet, document)
    assert execute_run(fleet, done, owner="w").phase == "completed"
    with pytest.raises(ContractError, match="completed"):
        cancel(fleet, done, reason="late", operator="olga")
    frozen = run_in_review(fleet, workspace, "r-review")
    with pytest.raises(ContractError, match="review"):
        cancel(fleet, frozen, reason="stop", operator="olga")
    assert fleet.store.records.inbox(frozen) == []
    with pytest.raises(ContractError):
        cancel(fleet, done, reason="  ", operator="olga")
    with pytest.raises(RunNotFoundError):
        cancel(fleet, "r-missing", reason="stop", operator="olga")


def test_the_cancel_command_waits_for_the_worker_and_answers_in_json(
    fleet: Fleet, workspace: MakeWorkspace, redis_server: RedisServer, tmp_path: Path
) -> None:
    _root, document = workspace(approval_required=("write_file",))
    run_id = submit(fleet, document)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env.update(
        RATCHET_REDIS_URL=redis_server.url,
        RATCHET_CHECKPOINT_KEY=CHECKPOINT_KEY_HEX,
        RATCHET_QUEUE=fleet.settings.queue,
        RATCHET_LOG_LEVEL="WARNING",
    )
    command = [
        sys.executable,
        "-m",
        "ratchet.cli.entry",
        "cancel",
        run_id,
        "--reason",
        "not wanted",
        "--json",
    ]
    done = subprocess.run(
        command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["run_id"] == run_id and info["request_id"].startswith("cx-")
    assert execute_run(fleet, run_id, owner="w").outcome == "cancelled"
    again = subprocess.run(
        command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )
    assert again.returncode == 2 and again.stderr.startswith("ratchet: error:")
    assert len(again.stderr.strip().splitlines()) == 1 and "cancelled" in again.stderr


# --- rebaseline ----------------------------------------------------------------------------


def frozen_by_edit(trusted: Fleet, workspace: MakeWorkspace, run_id: str) -> Path:
    run_awaiting_approval(trusted, workspace, run_id)
    root = Path(inspect_run(trusted, run_id).document.environment.root)
    app = root / "app.py"
    app.write_text(app.read_text() + "# a note a human added while the run waited\n")
    assert execute_run(trusted, run_id, owner="w").outcome == "restore_refused"
    return root


def test_a_rebaseline_unfreezes_an_edited_run_which_then_needs_a_fresh_approval(
    trusted: Fleet, workspace: MakeWorkspace
) -> None:
    root = frozen_by_edit(trusted, workspace, "r-rebase")
    old_state = inspect_run(trusted, "r-rebase").state
    posted = rebaseline(trusted, "r-rebase", key=RITA, reviewer_id="rita")
    assert posted.verified
    report = execute_run(trusted, "r-rebase", owner="w")
    assert report.phase == "awaiting_approval", report  # proposed again, approval again
    view = inspect_run(trusted, "r-rebase")
    rebased = next(e for e in view.state.trace if e.outcome is TraceOutcome.REBASELINED)
    assert rebased.detail["old_env_fingerprint"] == old_state.environment.fingerprint
    assert rebased.detail["new_env_fingerprint"] != old_state.environment.fingerprint
    assert view.state.environment.version > old_state.environment.version
    pending = view.state.pending
    assert pending is not None and pending.env_before == view.state.environment
    approve(trusted, "r-rebase", pending.action.action_id, key=ALICE, approver_id="alice")
    assert execute_run(trusted, "r-rebase", owner="w").phase == "completed"
    assert effects(root) == 1


def test_a_rebaseline_is_refused_for_an_untrusted_reviewer_or_a_later_edit(
    trusted: Fleet, workspace: MakeWorkspace
) -> None:
    frozen_by_edit(trusted, workspace, "r-rebase-bad")
    with pytest.raises(ReviewDecisionError):
        rebaseline(trusted, "r-rebase-bad", key=Ed25519PrivateKey.generate(), reviewer_id="rita")
    assert trusted.store.records.inbox("r-rebase-bad") == []
    rebaseline(trusted, "r-rebase-bad", key=RITA, reviewer_id="rita")
    root = Path(inspect_run(trusted, "r-rebase-bad").document.environment.root)
    (root / "app.py").write_text("print('edited again after the decision')\n")
    assert execute_run(trusted, "r-rebase-bad", owner="w").outcome == "restore_refused"
    assert inspect_run(trusted, "r-rebase-bad").state.phase.value == "awaiting_approval"


def test_there_is_nothing_to_rebaseline_without_an_environment_incident(
    trusted: Fleet, workspace: MakeWorkspace
) -> None:
    run_id = run_awaiting_approval(trusted, workspace, "r-rebase-none")
    with pytest.raises(ContractError, match="changed environment"):
        rebaseline(trusted, run_id, key=RITA, reviewer_id="rita")


@pytest.mark.sandbox
def test_the_review_command_signs_a_rebaseline(
    trusted: Fleet, workspace: MakeWorkspace, redis_server: RedisServer, tmp_path: Path
) -> None:
    frozen_by_edit(trusted, workspace, "r-rebase-cli")
    pem = tmp_path / "reviewer-rita.pem"
    pem.write_bytes(RITA.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env.update(
        RATCHET_REDIS_URL=redis_server.url,
        RATCHET_CHECKPOINT_KEY=CHECKPOINT_KEY_HEX,
        RATCHET_QUEUE=trusted.settings.queue,
        RATCHET_LOG_LEVEL="WARNING",
        RATCHET_REVIEWERS_FILE=str(trusted.settings.reviewers_file),
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ratchet.cli.entry",
            "review",
            "r-rebase-cli",
            "--decision",
            "rebaseline",
            "--key",
            str(pem),
            "--json",
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["verified"] is True and info["incident_id"].startswith("inc-")
    assert info["new_env_version"] > info["old_env_version"]
    assert execute_run(trusted, "r-rebase-cli", owner="w").phase == "awaiting_approval"


def test_a_run_under_review_whose_workspace_a_person_edited_can_still_be_decided(
    trusted: Fleet, workspace: MakeWorkspace
) -> None:
    """Before, the decision was bound to the environment the case recorded, which the
    edit had moved past: every decision was refused and the run could never leave review."""
    run_id = run_in_review(trusted, workspace, "r-review-edited")
    root = Path(inspect_run(trusted, run_id).document.environment.root)
    (root / "app.py").write_text("print('a person fixed it by hand')\n")
    assert execute_run(trusted, run_id, owner="w").outcome == "restore_refused"
    review(trusted, run_id, "abort", key=RITA, reviewer_id="rita")
    report = execute_run(trusted, run_id, owner="w")
    assert report.phase == "failed", report
    view = inspect_run(trusted, run_id)
    assert view.state.closed_reviews[-1].decision is not None  # the evidence is kept


def test_show_says_a_waiting_run_a_worker_refused_is_frozen_and_names_the_remedy(
    trusted: Fleet, workspace: MakeWorkspace
) -> None:
    frozen_by_edit(trusted, workspace, "r-frozen-status")
    for queue in trusted.served_queues():
        queue.empty()  # the jobs submit queued were the ones run here in-process
    fleet_status = diagnose(trusted, inspect_run(trusted, "r-frozen-status"))["status"]
    assert fleet_status["frozen"] is True, fleet_status
    assert "--decision rebaseline" in fleet_status["why"]
    rebaseline(trusted, "r-frozen-status", key=RITA, reviewer_id="rita")
    assert execute_run(trusted, "r-frozen-status", owner="w").phase == "awaiting_approval"
    for queue in trusted.served_queues():
        queue.empty()
    # A later job got past the refusal: the run waits for a person, it is not frozen.
    status = diagnose(trusted, inspect_run(trusted, "r-frozen-status"))["status"]
    assert status["frozen"] is False and "approval" in status["why"], status
