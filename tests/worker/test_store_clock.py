"""A worker judges time by the store's clock: a worker whose wall clock is two hours off
neither executes an approval that expired by Redis' clock nor refuses one that is still
valid, and a worker too far from Redis' clock refuses to start."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ratchet.adapters.workspace import WorkspaceAdapter
from ratchet.errors import ConfigurationError
from ratchet.fleet.clock import StoreClock, check_clock_skew
from ratchet.fleet.context import Fleet
from ratchet.fleet.runs import RunDocument
from ratchet.ops import Posted, approve, inspect_run
from ratchet.worker.job import execute_run
from ratchet.worker.pool import measure_clock_skew
from tests.ops.helpers import run_awaiting_approval, trust_file, with_trust
from tests.worker.fleet_harness import poll

MakeWorkspace = Callable[..., tuple[Path, RunDocument]]
ALICE = Ed25519PrivateKey.generate()


def test_the_store_clock_is_an_upper_bound_that_follows_the_monotonic_clock() -> None:
    now = [100.0]
    clock = StoreClock(
        5_000_000, sent_at=100.0, margin_ms=1000, drift_ppm=1000, monotonic=lambda: now[0]
    )
    assert clock.now_ms() == 5_001_000
    now[0] = 110.0  # ten seconds later by the monotonic clock
    assert clock.now_ms() == 5_000_000 + 10_010 + 1000
    clock.observe(5_009_000, sent_at=109.5)  # a renewal: a tighter bound, still a bound
    assert clock.now_ms() == 5_009_000 + 501 + 1000
    clock.observe(4_000_000, sent_at=109.9)  # the store's clock went back: ignored
    assert clock.now_ms() == 5_009_000 + 501 + 1000
    assert clock.now() == 5_011


@pytest.mark.parametrize("skew_s", [-7200, 7200, -3])
def test_a_host_far_from_the_stores_clock_is_refused(skew_s: int) -> None:
    store_ms = int(time.time() * 1000)
    with pytest.raises(ConfigurationError, match="from the Redis server's"):
        check_clock_skew(
            store_ms,
            sent_at_wall=store_ms / 1000 + skew_s,
            received_at_wall=store_ms / 1000 + skew_s,
            max_skew_ms=2000,
        )
    assert (
        abs(
            check_clock_skew(
                store_ms,
                sent_at_wall=store_ms / 1000,
                received_at_wall=store_ms / 1000 + 0.01,
                max_skew_ms=2000,
            )
        )
        < 0.1
    )


def test_a_worker_whose_wall_clock_is_two_hours_off_refuses_to_start(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert abs(measure_clock_skew(fleet)) < 2
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 7200)
    with pytest.raises(ConfigurationError, match="-7200"):
        measure_clock_skew(fleet)


def effects(root: Path) -> int:
    with WorkspaceAdapter(root, ["app.py"]) as adapter:
        return adapter.effects


def approved(
    fleet: Fleet, workspace: MakeWorkspace, tmp_path: Path, run_id: str, *, ttl_s: int
) -> tuple[Fleet, Posted]:
    """A run waiting for approval, approved by a trusted approver for ``ttl_s``."""
    fleet = with_trust(fleet, approvers_file=trust_file(tmp_path / "a.json", {"alice": ALICE}))
    run_awaiting_approval(fleet, workspace, run_id)
    pending = inspect_run(fleet, run_id).state.pending
    assert pending is not None
    return fleet, approve(
        fleet, run_id, pending.action.action_id, key=ALICE, approver_id="alice", ttl_s=ttl_s
    )


def test_an_approval_expired_by_redis_time_never_executes_on_a_worker_two_hours_behind(
    fleet: Fleet, workspace: MakeWorkspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_id = "r-skew-behind"
    fleet, posted = approved(fleet, workspace, tmp_path, run_id, ttl_s=1)
    expires_ms = posted.evidence.claims.expires_at * 1000  # type: ignore[union-attr]
    poll(
        lambda: fleet.store.server_time_ms() > expires_ms + 1000,
        deadline_s=10,
        what="the approval expired by Redis' clock",
    )
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 7200)  # the worker's clock is behind
    report = execute_run(fleet, run_id, owner="w-behind")
    assert report.phase == "awaiting_approval"
    view = inspect_run(fleet, run_id)
    assert view.state.phase.value == "awaiting_approval" and not view.state.executed
    root = Path(view.document.environment.root)
    assert effects(root) == 0


def test_a_valid_approval_executes_on_a_worker_two_hours_ahead(
    fleet: Fleet, workspace: MakeWorkspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_id = "r-skew-ahead"
    fleet, _ = approved(fleet, workspace, tmp_path, run_id, ttl_s=3600)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 7200)  # the worker's clock is ahead
    report = execute_run(fleet, run_id, owner="w-ahead")
    assert report.phase == "completed"
    assert effects(Path(inspect_run(fleet, run_id).document.environment.root)) == 1
