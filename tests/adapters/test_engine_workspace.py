"""The engine over a real workspace: every write crash window recovers with one effect,
stale owners are fenced, drift fails closed, and the example task completes with pytest."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from ratchet.adapters import CommandVerifier, WorkspaceAdapter
from ratchet.adapters.sandbox import Sandbox
from ratchet.errors import CheckpointError, FenceRejectedError
from ratchet.runtime import CrashWindow, Phase, RunEngine, TraceOutcome
from ratchet.testing.memory import ObserveFailsAfterWrite
from tests.adapters.harness import (
    PYTEST_CHECK,
    QUICK_CHECK,
    RIGHT_GREETING,
    WRITE_WINDOWS,
    Harness,
    SimulatedCrash,
    crash_at,
    make_workspace,
    run_git,
)
from tests.conftest import test_sandbox_mode


class Workspaces:
    """Opens workspace handles on one directory, as separate worker processes would."""

    def __init__(self, root: Path, check: list[str]) -> None:
        self.root = root
        self.check = check
        self.handles: list[WorkspaceAdapter] = []

    def open(self) -> WorkspaceAdapter:
        handle = WorkspaceAdapter(
            self.root,
            ["app.py", "tests"],
            verifier=CommandVerifier(
                {"unit": self.check}, sandbox=Sandbox.resolve(test_sandbox_mode())
            ),
        )
        self.handles.append(handle)
        return handle

    def effects(self) -> int:
        return self.handles[-1].effects

    def close(self) -> None:
        for handle in self.handles:
            handle.close()


def harness_for(
    tmp_path: Path, *, git: bool = False, check: list[str] = QUICK_CHECK
) -> tuple[Harness, Workspaces]:
    spaces = Workspaces(make_workspace(tmp_path / "ws", git=git), check)
    return Harness(open_adapter=spaces.open, effects=spaces.effects), spaces


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Harness]:
    harness, spaces = harness_for(tmp_path)
    yield harness
    spaces.close()


def finish(h: Harness, engine: RunEngine) -> None:
    assert engine.propose(h.verify(engine)).outcome is TraceOutcome.VERIFIED
    assert engine.state.verification is not None and engine.state.verification.passed
    assert engine.propose(h.finish(engine)).phase is Phase.COMPLETED


@pytest.mark.parametrize("window", WRITE_WINDOWS)
def test_a_crash_in_each_write_window_recovers_with_exactly_one_workspace_write(
    run: Harness, tmp_path: Path, window: CrashWindow
) -> None:
    engine = run.start(probe=crash_at(window))
    if window is CrashWindow.AFTER_RECEIPT_BEFORE_STATE:
        # Receipt and state are one commit unless the environment cannot be observed
        # right after the write: only then is the receipt committed alone.
        engine.executor.hooks = ObserveFailsAfterWrite(engine.executor.hooks)
    with pytest.raises(SimulatedCrash):
        engine.propose(run.write(engine, key="fix-1"))

    resumed = run.resume(lease_version=2)
    assert resumed.reconcile().window is window
    assert run.effects() == 1
    assert (tmp_path / "ws" / "app.py").read_text() == RIGHT_GREETING
    assert resumed.state.pending is None
    assert resumed.state.executed[-1].receipt.namespace == "workspace"
    finish(run, resumed)
    assert run.effects() == 1


def test_the_old_owners_late_write_is_refused_after_the_new_owner_wrote(
    run: Harness, tmp_path: Path
) -> None:
    new_owner: list[RunEngine] = []

    def paused_then_late(window: CrashWindow) -> None:
        # The old owner committed its pending intent and stalls before the adapter call;
        # meanwhile a new owner takes over, raises the fence and performs the write.
        if window is CrashWindow.AFTER_PENDING_BEFORE_ADAPTER and not new_owner:
            resumed = run.resume(lease_version=2)
            resumed.reconcile()
            new_owner.append(resumed)

    old = run.start(probe=paused_then_late)
    with pytest.raises(FenceRejectedError):
        old.propose(run.write(old, key="fix-1"))
    assert run.effects() == 1
    assert new_owner[0].state.executed[-1].idempotency_key == "fix-1"
    adapter = old.executor.adapter
    assert isinstance(adapter, WorkspaceAdapter) and adapter.refused_stale == 1
    finish(run, new_owner[0])


def test_a_file_edited_behind_ratchets_back_fails_recovery_closed(
    run: Harness, tmp_path: Path
) -> None:
    engine = run.start()
    engine.propose(run.write(engine, key="fix-1"))
    (tmp_path / "ws" / "app.py").write_text("print('someone else')\n")
    with pytest.raises(CheckpointError) as caught:
        run.resume(lease_version=2)
    assert caught.value.reason == "environment"  # type: ignore[attr-defined]
    assert "neither the checkpoint's state" in caught.value.message


def test_a_moved_git_head_fails_recovery_closed(tmp_path: Path) -> None:
    h, spaces = harness_for(tmp_path, git=True)
    try:
        engine = h.start()
        recorded_head = engine.state.environment.details["git_head"]
        run_git(tmp_path / "ws", "commit", "-q", "--allow-empty", "-m", "someone moved HEAD")
        with pytest.raises(CheckpointError) as caught:
            h.resume(lease_version=2)
        assert caught.value.reason == "environment"  # type: ignore[attr-defined]
        assert spaces.handles[-1].observe().details["git_head"] != recorded_head
    finally:
        spaces.close()


def test_a_reset_workspace_is_a_new_instance_and_fails_recovery_closed(
    run: Harness, tmp_path: Path
) -> None:
    engine = run.start()
    engine.propose(run.write(engine, key="fix-1"))
    old_instance = engine.state.environment.instance_id
    shutil.rmtree(tmp_path / "ws" / ".ratchet")
    with pytest.raises(CheckpointError) as caught:
        run.resume(lease_version=2)
    assert caught.value.reason == "environment"  # type: ignore[attr-defined]
    assert caught.value.expected == old_instance  # type: ignore[attr-defined]
    assert "instance differs" in caught.value.message


def test_the_example_task_is_fixed_and_verified_with_pytest(tmp_path: Path) -> None:
    h, spaces = harness_for(tmp_path, check=PYTEST_CHECK)
    try:
        engine = h.start()
        read = engine.propose(h.action(engine, "read_file", {"path": "app.py"}))
        assert read.outcome is TraceOutcome.READ
        failing = engine.propose(h.verify(engine))
        assert failing.outcome is TraceOutcome.VERIFIED
        assert engine.state.verification is not None and not engine.state.verification.passed
        assert engine.propose(h.finish(engine)).outcome is TraceOutcome.REJECTED_UNVERIFIED
        assert engine.propose(h.write(engine)).outcome is TraceOutcome.EXECUTED
        finish(h, engine)
        assert (tmp_path / "ws" / "app.py").read_text() == RIGHT_GREETING
        assert spaces.effects() == 1
        report = engine.state.verification
        assert report is not None and report.env_version == engine.state.environment.version
    finally:
        spaces.close()
