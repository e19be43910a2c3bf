"""The engine over the router (workspace + HTTP orders API): every write crash window
recovers with exactly one order on the service's side, stale owners are refused, the
trust boundary sends unbound or late receipts to review, and a changed service identity
fails closed."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ratchet.adapters import CommandVerifier, HttpAdapter, RouterAdapter, WorkspaceAdapter
from ratchet.adapters.sandbox import Sandbox
from ratchet.errors import AdapterError, CheckpointError, FenceRejectedError
from ratchet.runtime import Action, CrashWindow, Fence, Phase, ReviewReason, RunEngine, TraceOutcome
from ratchet.testing.memory import ObserveFailsAfterWrite
from tests.adapters.conftest import ServiceBox
from tests.adapters.harness import (
    QUICK_CHECK,
    WRITE_WINDOWS,
    Harness,
    SimulatedCrash,
    crash_at,
    make_workspace,
    raw_post,
    scenario,
)
from tests.conftest import test_sandbox_mode

OTHER_CALLER = Fence(run_id="another-caller", lease_version=1, state_version=1)


class Routers:
    def __init__(self, root: Path, orders: ServiceBox) -> None:
        self.root = root
        self.orders = orders
        self.handles: list[WorkspaceAdapter] = []

    def open(self) -> RouterAdapter:
        files = WorkspaceAdapter(
            self.root,
            ["app.py", "tests"],
            verifier=CommandVerifier(
                {"unit": QUICK_CHECK}, sandbox=Sandbox.resolve(test_sandbox_mode())
            ),
        )
        self.handles.append(files)
        return RouterAdapter(files, HttpAdapter(self.orders.url))

    def close(self) -> None:
        for handle in self.handles:
            handle.close()


@pytest.fixture
def run(tmp_path: Path, orders: ServiceBox) -> Iterator[Harness]:
    routers = Routers(make_workspace(tmp_path / "ws"), orders)
    harness = Harness(
        open_adapter=routers.open,
        effects=orders.effects,
        clock=orders.clock,
        scenario=scenario(approval_required=["external_call"]),
    )
    yield harness
    routers.close()


def place(run: Harness, engine: RunEngine, *, ttl: int = 300) -> None:
    action = run.order(engine)
    engine.propose(action, approval=run.approve(engine, action, ttl=ttl))


@pytest.mark.parametrize("window", WRITE_WINDOWS)
def test_a_crash_in_each_write_window_recovers_with_exactly_one_order(
    run: Harness, orders: ServiceBox, window: CrashWindow
) -> None:
    engine = run.start(probe=crash_at(window))
    if window is CrashWindow.AFTER_RECEIPT_BEFORE_STATE:
        # Receipt and state are one commit unless the environment cannot be observed
        # right after the write: only then is the receipt committed alone.
        engine.executor.hooks = ObserveFailsAfterWrite(engine.executor.hooks)
    with pytest.raises(SimulatedCrash):
        place(run, engine)

    resumed = run.resume(lease_version=2)
    assert resumed.reconcile().window is window
    assert orders.effects() == 1
    assert resumed.state.phase is Phase.RUNNING and resumed.state.pending is None
    receipt = resumed.state.executed[-1].receipt
    pending_approval = engine.state.pending.approval if engine.state.pending else None
    assert pending_approval is not None and receipt.approval_digest == pending_approval.digest
    # The run goes on: fix the file, verify, finish; still one order.
    assert resumed.propose(run.write(resumed)).outcome is TraceOutcome.EXECUTED
    assert resumed.propose(run.verify(resumed)).outcome is TraceOutcome.VERIFIED
    assert resumed.propose(run.finish(resumed)).phase is Phase.COMPLETED
    assert orders.effects() == 1


def test_the_old_owners_late_order_is_refused_after_the_new_owner_placed_it(
    run: Harness, orders: ServiceBox
) -> None:
    new_owner: list[RunEngine] = []

    def paused_then_late(window: CrashWindow) -> None:
        if window is CrashWindow.AFTER_PENDING_BEFORE_ADAPTER and not new_owner:
            resumed = run.resume(lease_version=2)
            resumed.reconcile()
            new_owner.append(resumed)

    old = run.start(probe=paused_then_late)
    with pytest.raises(FenceRejectedError):
        place(run, old)
    assert orders.effects() == 1
    assert new_owner[0].state.executed[-1].idempotency_key == "order-1"
    assert fence_refusals(old, orders) == 1


def fence_refusals(engine: RunEngine, orders: ServiceBox) -> int:
    """Stale fences refused by either part of the router, by their own records. The
    engine's live precondition check finds the environment moved under the old owner's
    pending order and lets the router judge its fence (files part first) before anything
    is sent, so the order may never reach the service at all."""
    router = engine.executor.adapter
    assert isinstance(router, RouterAdapter)
    files = router.files
    assert isinstance(files, WorkspaceAdapter)
    return int(files.refused_stale) + int(orders.service.stats()[1]["refused_stale"])


def test_a_late_order_planned_before_the_new_owner_wrote_a_file_is_refused_by_the_fence(
    run: Harness, orders: ServiceBox
) -> None:
    """The new owner places the order and then writes a file: the old owner's late order
    fails the cross-part precondition too, but a fence is what refuses it."""
    new_owner: list[RunEngine] = []

    def paused_then_late(window: CrashWindow) -> None:
        if window is CrashWindow.AFTER_PENDING_BEFORE_ADAPTER and not new_owner:
            resumed = run.resume(lease_version=2)
            resumed.reconcile()
            assert resumed.propose(run.write(resumed)).outcome is TraceOutcome.EXECUTED
            new_owner.append(resumed)

    old = run.start(probe=paused_then_late)
    with pytest.raises(FenceRejectedError):
        place(run, old)
    assert orders.effects() == 1
    assert fence_refusals(old, orders) == 1


def test_a_current_owners_order_after_a_file_moved_fails_its_precondition(
    tmp_path: Path, orders: ServiceBox
) -> None:
    """The fence asked on a failed precondition accepts a current owner: the refusal is
    the precondition, and nothing is placed."""
    routers = Routers(make_workspace(tmp_path / "ws"), orders)
    router = routers.open()
    try:
        before = router.observe().version
        (tmp_path / "ws" / "app.py").write_text("print('moved')\n")
        action = Action.model_validate(
            {
                "action_id": "a-1",
                "kind": "external_call",
                "risk": "irreversible_external_write",
                "args": {"operation": "place-order", "body": '{"sku":"A-1","qty":1}'},
                "idempotency_key": "order-x",
                "expected_env_version": before,
                "deadline_at": 2**40,
            }
        )
        with pytest.raises(AdapterError) as caught:
            router.execute(
                action,
                action.intent_digest,
                Fence(run_id="r", lease_version=1, state_version=1),
                None,
            )
        assert not isinstance(caught.value, FenceRejectedError)
        assert "precondition" in caught.value.message
        assert orders.effects() == 0
    finally:
        routers.close()


def test_a_receipt_that_does_not_bind_the_approval_sends_the_run_to_review(
    run: Harness, orders: ServiceBox
) -> None:
    engine = run.start()
    action = run.order(engine)
    # Another caller reached the service first with the same key and body, unapproved.
    assert (
        raw_post(orders, "order-1", action.args["body"], OTHER_CALLER, action.intent_digest) == 201
    )
    engine.propose(action, approval=run.approve(engine, action))
    assert engine.state.phase is Phase.NEEDS_REVIEW
    assert engine.state.review is not None
    assert engine.state.review.reason is ReviewReason.APPROVAL_UNBOUND
    assert engine.state.review.receipt is not None
    assert engine.state.review.receipt.approval_digest is None
    assert orders.effects() == 1


def test_a_receipt_committed_after_the_approval_expired_sends_the_run_to_review(
    run: Harness, orders: ServiceBox
) -> None:
    orders.offset = 1_000  # the service's commit time is past the approval's expiry
    engine = run.start(probe=crash_at(CrashWindow.AFTER_ADAPTER_BEFORE_RECEIPT))
    with pytest.raises(SimulatedCrash):
        place(run, engine, ttl=300)
    resumed = run.resume(lease_version=2)
    resumed.reconcile()
    assert resumed.state.phase is Phase.NEEDS_REVIEW
    assert resumed.state.review is not None
    assert resumed.state.review.reason is ReviewReason.APPROVAL_UNBOUND
    assert orders.effects() == 1


def test_a_reset_service_is_a_new_identity_and_fails_recovery_closed(
    run: Harness, orders: ServiceBox
) -> None:
    engine = run.start()
    place(run, engine)
    assert engine.state.executed
    recorded = engine.state.environment.details["calls.service_id"]
    orders.reset()
    with pytest.raises(CheckpointError) as caught:
        run.resume(lease_version=2)
    assert caught.value.reason == "environment"  # type: ignore[attr-defined]
    assert "instance differs" in caught.value.message
    assert HttpAdapter(orders.url).observe().instance_id != recorded


def test_an_order_placed_by_another_caller_between_checkpoints_fails_recovery_closed(
    run: Harness, orders: ServiceBox
) -> None:
    run.start()
    assert raw_post(orders, "someone-else", '{"sku":"Z","qty":1}', OTHER_CALLER, "0" * 64) == 201
    with pytest.raises(CheckpointError) as caught:
        run.resume(lease_version=2)
    assert caught.value.reason == "environment"  # type: ignore[attr-defined]


def test_closing_the_router_closes_every_part(tmp_path: Path, orders: ServiceBox) -> None:
    """A worker closes its job's adapter at the job's end: with a workspace and an HTTP
    API that is a router, and each part's files and sockets must go with it (before, the
    router had no close: every such job left the workspace's lock file and journal open)."""

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    def one_job() -> None:
        router = RouterAdapter(WorkspaceAdapter(root, ["app.py"]), HttpAdapter(orders.url))
        router.observe()  # the journal open, a read connection kept
        router.close()

    root = tmp_path / "ws"
    root.mkdir()
    one_job()  # whatever the first use opens for good (a library's own files)
    before = open_fds()
    for _ in range(5):
        one_job()
    # The service runs in this process: its side of each connection closes on its own
    # thread once it sees the client's close. Poll for that, with a deadline.
    deadline = time.monotonic() + 10
    while open_fds() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert open_fds() <= before  # (the warm-up's own connection may close meanwhile)
