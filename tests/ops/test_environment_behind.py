"""An environment restored from an older copy is never run on, nor accepted as a baseline.

A workspace's journal is its own record of what it did: receipts, the version. Restored
from a backup taken before a write the run recorded, it no longer holds that write's
receipt, so "no receipt for this key" would prove nothing. The restore refuses it by name
(behind the checkpoint's record of it), and a rebaseline, which would make the older copy
the run's new truth, is refused too: by the operator command, and by the worker's own
check of a decision signed anyway.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ratchet.demo.examples import RIGHT_GREETING
from ratchet.errors import ContractError, ReviewDecisionError
from ratchet.fleet.context import Fleet
from ratchet.ops import inspect_run, rebaseline, submit
from ratchet.runtime import RebaselineClaims, decisions, sign_rebaseline
from ratchet.worker.job import execute_run
from tests.ops.helpers import MakeWorkspace, trust_file, with_trust

RITA = Ed25519PrivateKey.generate()
PLAN = [
    {"kind": "write_file", "args": {"path": "app.py", "content": RIGHT_GREETING}},
    {"kind": "run_verifier", "args": {"target": "unit"}},
    {"kind": "finish", "args": {"summary": "fixed"}},
]


@pytest.fixture
def trusted(fleet: Fleet, tmp_path: Path) -> Fleet:
    made = with_trust(fleet, reviewers_file=trust_file(tmp_path / "reviewers.json", {"rita": RITA}))
    # One step per job: the run stops right after its write, still running.
    return Fleet.connect(made.settings.model_copy(update={"max_steps_per_job": 1}))


def test_a_workspace_restored_from_before_a_recorded_write_is_refused_and_never_rebaselined(
    trusted: Fleet, workspace: MakeWorkspace, tmp_path: Path
) -> None:
    root, document = workspace()
    document = document.model_copy(update={"agent": "scripted", "agent_config": {"steps": PLAN}})
    run_id = submit(trusted, document, run_id="r-behind")
    backup = tmp_path / "backup"
    shutil.copytree(root, backup, symlinks=True)  # before the write
    execute_run(trusted, run_id, owner="w1")
    view = inspect_run(trusted, run_id)
    assert len(view.state.executed) == 1 and view.state.environment.version == 2
    shutil.rmtree(root)
    shutil.copytree(backup, root, symlinks=True)
    report = execute_run(trusted, run_id, owner="w2")
    assert report.outcome == "restore_refused", report
    incident = trusted.store.records.incidents(run_id)[0]
    assert "behind the checkpoint's record" in incident["message"], incident
    with pytest.raises(ContractError, match="never moves it back"):
        rebaseline(trusted, run_id, key=RITA, reviewer_id="rita")
    # A decision signed anyway (by hand, around the command) is refused by the check the
    # worker makes before it applies one.
    state = inspect_run(trusted, run_id).state
    env = state.environment
    claims = RebaselineClaims(
        task_id=state.task_id,
        run_id=run_id,
        policy_id=state.policy_id,
        policy_version=state.policy_version,
        incident_id=str(incident["id"]),
        generation=inspect_run(trusted, run_id).generation,
        old_env_instance_id=env.instance_id,
        old_env_version=env.version,
        old_env_fingerprint=env.fingerprint,
        new_env_instance_id=env.instance_id,
        new_env_version=1,
        new_env_fingerprint=env.fingerprint,
        nonce="rb-behind-0001",
    )
    decision = sign_rebaseline(RITA, "rita", claims)
    assert trusted.reviewers is not None
    with pytest.raises(ReviewDecisionError) as caught:
        decisions.check_rebaseline(
            state,
            inspect_run(trusted, run_id).document.scenario,
            decision,
            trusted.reviewers,
            generation=inspect_run(trusted, run_id).generation,
        )
    assert caught.value.reason == "behind"
