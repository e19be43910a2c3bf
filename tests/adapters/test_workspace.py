"""The workspace adapter on its own: crash consistency of the journal and the files,
several handles (processes) on one directory, allowed paths, git facts."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ratchet.adapters import WorkspaceAdapter
from ratchet.errors import AdapterError, ConfigurationError, FenceRejectedError
from ratchet.runtime import Action, Fence
from tests.adapters.harness import RIGHT_GREETING, WRONG_GREETING, make_workspace, run_git

WRITER = """
import os, signal, sys
from ratchet.adapters import WorkspaceAdapter
from ratchet.runtime import Action, Fence

root, stage, raw = sys.argv[1], sys.argv[2], sys.argv[3]

def hook(seen):
    if seen == stage:
        os.kill(os.getpid(), signal.SIGKILL)

ws = WorkspaceAdapter(root, ["app.py", "tests"], hook=hook)
action = Action.model_validate_json(raw)
ws.execute(action, action.intent_digest, Fence(run_id="r", lease_version=1, state_version=1),
           None)
"""


def write(key: str, content: str, expected: int, path: str = "app.py") -> Action:
    return Action.model_validate(
        {
            "action_id": f"a-{key}",
            "kind": "write_file",
            "risk": "reversible_write",
            "args": {"path": path, "content": content},
            "idempotency_key": key,
            "expected_env_version": expected,
            "deadline_at": 2**40,
        }
    )


def fence(lease: int = 1, state: int = 1) -> Fence:
    return Fence(run_id="r", lease_version=lease, state_version=state)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return make_workspace(tmp_path / "ws")


@pytest.mark.parametrize("stage", ["after_intent", "after_replace"])
def test_a_writer_killed_mid_write_leaves_journal_and_files_in_agreement(
    root: Path, stage: str
) -> None:
    with WorkspaceAdapter(root, ["app.py", "tests"]) as ws:
        before = ws.observe()
        action = write("k-1", RIGHT_GREETING, before.version)
        predicted = ws.project(action, before)
        killed = subprocess.run(
            [sys.executable, "-c", WRITER, str(root), stage, action.model_dump_json()],
            capture_output=True,
            timeout=60,
            check=False,
        )
        assert killed.returncode == -signal.SIGKILL
        # The live handle resolves the dead writer's intent before answering.
        after = ws.observe()
        receipt = ws.lookup("k-1")
        if stage == "after_intent":
            assert (root / "app.py").read_text() == WRONG_GREETING
            assert receipt is None and ws.effects == 0
            assert after == before
        else:
            assert (root / "app.py").read_text() == RIGHT_GREETING
            assert receipt is not None and ws.effects == 1
            assert after == predicted
            assert receipt.env_version_after == after.version
        assert list((root / ".ratchet" / "tmp").iterdir()) == []
        # Executing the same key now gives exactly one effect either way.
        again = ws.execute(action, action.intent_digest, fence(1, 2), None)
        assert ws.effects == 1
        assert ws.lookup("k-1") == again
        assert (root / "app.py").read_text() == RIGHT_GREETING


def test_a_fresh_handle_recovers_a_write_whose_writer_died_after_the_replace(root: Path) -> None:
    action = write("k-1", RIGHT_GREETING, 1)
    killed = subprocess.run(
        [sys.executable, "-c", WRITER, str(root), "after_replace", action.model_dump_json()],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert killed.returncode == -signal.SIGKILL
    with WorkspaceAdapter(root, ["app.py", "tests"]) as ws:
        receipt = ws.lookup("k-1")
        assert receipt is not None and receipt.intent_digest == action.intent_digest
        assert ws.effects == 1 and ws.observe().version == 2


def test_an_in_process_crash_after_the_intent_is_resolved_on_the_next_call(root: Path) -> None:
    def crash(stage: str) -> None:
        if stage == "after_intent":
            raise RuntimeError("died")

    with WorkspaceAdapter(root, ["app.py"], hook=crash) as ws:
        action = write("k-1", RIGHT_GREETING, ws.observe().version)
        with pytest.raises(RuntimeError):
            ws.execute(action, action.intent_digest, fence(), None)
        assert ws.lookup("k-1") is None and ws.effects == 0
        assert (root / "app.py").read_text() == WRONG_GREETING


def test_writes_from_several_handles_at_once_are_serialised_with_one_version_each(
    root: Path,
) -> None:
    handles = [WorkspaceAdapter(root, ["app.py", "tests"]) for _ in range(4)]
    errors: list[BaseException] = []

    def writer(i: int, ws: WorkspaceAdapter) -> None:
        try:
            for j in range(3):
                key = f"k-{i}-{j}"
                action = Action.model_validate(
                    {
                        "action_id": key,
                        "kind": "write_file",
                        "risk": "reversible_write",
                        "args": {"path": f"tests/out_{i}_{j}.txt", "content": key},
                        "idempotency_key": key,
                        "expected_env_version": 0,
                        "deadline_at": 2**40,
                    }
                )
                while True:  # re-plan against the current version until it lands
                    current = ws.observe().version
                    planned = action.model_copy(update={"expected_env_version": current})
                    try:
                        ws.execute(planned, planned.intent_digest, fence(), None)
                        break
                    except AdapterError as exc:
                        if "precondition" not in exc.message:
                            raise
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i, ws)) for i, ws in enumerate(handles)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    try:
        assert errors == []
        assert handles[0].effects == 12
        assert handles[0].observe().version == 13
        receipts = [handles[1].lookup(f"k-{i}-{j}") for i in range(4) for j in range(3)]
        assert sorted(r.env_version_after for r in receipts if r) == list(range(2, 14))
    finally:
        for ws in handles:
            ws.close()


def test_the_highest_fence_survives_a_reopen_and_refuses_the_old_owner(root: Path) -> None:
    with WorkspaceAdapter(root, ["app.py"]) as ws:
        ws.raise_fence(fence(2, 0))
    with WorkspaceAdapter(root, ["app.py"]) as reopened:
        action = write("late", "late\n", reopened.observe().version)
        with pytest.raises(FenceRejectedError):
            reopened.execute(action, action.intent_digest, fence(1, 99), None)
        assert reopened.refused_stale == 1 and reopened.effects == 0
        assert (root / "app.py").read_text() == WRONG_GREETING


def test_writes_outside_the_allowed_paths_or_into_the_state_folder_are_refused(root: Path) -> None:
    with WorkspaceAdapter(root, ["app.py"]) as ws:
        action = write("k-1", "x", ws.observe().version, path="setup.py")
        with pytest.raises(AdapterError) as caught:
            ws.execute(action, action.intent_digest, fence(), None)
        assert caught.value.retryable is False
        assert not (root / "setup.py").exists()
    with pytest.raises(ConfigurationError):
        WorkspaceAdapter(root, [".ratchet/journal.sqlite3"])
    with pytest.raises(ConfigurationError):
        WorkspaceAdapter(root, ["../outside"])


def test_a_write_through_a_symbolic_link_is_refused(root: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "tests" / "escape").symlink_to(outside)
    with WorkspaceAdapter(root, ["tests"]) as ws:
        action = write("k-1", "x", ws.observe().version, path="tests/escape/evil.py")
        with pytest.raises(AdapterError):
            ws.execute(action, action.intent_digest, fence(), None)
    assert list(outside.iterdir()) == []


def test_the_instance_id_is_minted_once_and_kept_until_the_state_folder_is_reset(
    root: Path,
) -> None:
    with WorkspaceAdapter(root, ["app.py"]) as ws:
        first = ws.instance_id
    with WorkspaceAdapter(root, ["app.py"]) as ws:
        assert ws.instance_id == first
    for item in sorted((root / ".ratchet").rglob("*"), reverse=True):
        item.rmdir() if item.is_dir() else item.unlink()
    with WorkspaceAdapter(root, ["app.py"]) as ws:
        assert ws.instance_id != first


def test_an_edit_outside_the_adapter_moves_the_version_on_and_fails_the_precondition(
    root: Path,
) -> None:
    with WorkspaceAdapter(root, ["app.py"]) as ws:
        before = ws.observe()
        (root / "app.py").write_text("edited elsewhere\n")
        after = ws.observe()
        assert after.version == before.version + 1 and after.fingerprint != before.fingerprint
        stale = write("k-1", RIGHT_GREETING, before.version)
        with pytest.raises(AdapterError) as caught:
            ws.execute(stale, stale.intent_digest, fence(), None)
        assert "precondition" in caught.value.message and ws.effects == 0


def test_in_a_git_repository_head_and_the_dirty_flag_are_observed_and_projected(
    tmp_path: Path,
) -> None:
    root = make_workspace(tmp_path / "repo", git=True)
    with WorkspaceAdapter(root, ["app.py", "tests"]) as ws:
        clean = ws.observe()
        head = run_git(root, "rev-parse", "HEAD").strip()
        assert clean.details == {"git_head": head, "git_dirty": "0"}
        action = write("k-1", RIGHT_GREETING, clean.version)
        predicted = ws.project(action, clean)
        assert predicted is not None and predicted.details["git_dirty"] == "1"
        ws.execute(action, action.intent_digest, fence(), None)
        assert ws.observe() == predicted
        # Writing HEAD's content back makes the tree clean again, and that is predicted.
        back = write("k-2", WRONG_GREETING, predicted.version)
        predicted_clean = ws.project(back, predicted)
        assert predicted_clean is not None and predicted_clean.details["git_dirty"] == "0"
        ws.execute(back, back.intent_digest, fence(1, 2), None)
        assert ws.observe() == predicted_clean
        run_git(root, "commit", "-q", "--allow-empty", "-m", "moved")
        moved = ws.observe()
        assert moved.details["git_head"] != head and moved.fingerprint != clean.fingerprint


def test_observing_an_unchanged_workspace_takes_no_write_lock_and_an_edit_moves_the_version(
    root: Path,
) -> None:
    with WorkspaceAdapter(root, ["app.py"]) as adapter:
        first = adapter.observe()
        statements: list[str] = []
        adapter._journal._db.set_trace_callback(statements.append)
        assert adapter.observe() == first
        assert adapter.observe() == first
        assert not [s for s in statements if s.startswith("BEGIN")]  # reads only
        (root / "app.py").write_text("edited outside\n")
        moved = adapter.observe()
        assert moved.version == first.version + 1 and moved.fingerprint != first.fingerprint
        assert [s for s in statements if s.startswith("BEGIN")] == ["BEGIN IMMEDIATE"]
        assert adapter.observe() == moved
        adapter._journal._db.set_trace_callback(None)
