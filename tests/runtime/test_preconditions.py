"""Defence in depth: before every adapter write the engine compares the live environment
(instance, version and fingerprint) with the state the write was planned against, unless
the adapter declares that its own ``execute`` enforces exactly that."""

from __future__ import annotations

from typing import Any

import pytest

from ratchet.errors import CheckpointError, EnvironmentMismatchError, FenceRejectedError
from ratchet.runtime import CrashWindow, Hooks, Observation, Phase, TraceOutcome
from ratchet.worker.executor import Executor
from tests.runtime.world import RIGHT_GREETING, World

SILENT_EDIT = "print('edited without moving the version')\n"


class CountingAdapter:
    """Counts observations, and can declare that it enforces preconditions itself; every
    other call goes to ``inner``."""

    def __init__(self, inner: Any, *, enforces: object = False) -> None:
        self._inner = inner
        self.observed = 0
        self._enforces = enforces

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @property
    def enforces_preconditions(self) -> bool:
        return self._enforces  # type: ignore[return-value]  # also non-bool, on purpose

    def observe(self) -> Observation:
        self.observed += 1
        return self._inner.observe()  # type: ignore[no-any-return]


def test_a_silent_edit_that_kept_the_version_stops_the_write(world: World) -> None:
    engine = world.start()
    action = world.write(engine, key="fix-1")
    world.adapter.files["app.py"] = SILENT_EDIT  # same version, different content
    with pytest.raises(EnvironmentMismatchError) as err:
        engine.propose(action)
    assert err.value.reason == "stale_observation"
    assert err.value.fingerprint_changed is True
    assert world.adapter.write_count == 0
    assert world.adapter.files["app.py"] == SILENT_EDIT
    # The pending write stays committed as evidence; nothing claims it happened.
    assert engine.state.pending is not None and engine.state.pending.action == action
    assert engine.state.pending.receipt is None
    stored = world.store.load(engine.key)
    assert stored.generation == engine.generation


def test_the_stopped_write_fails_closed_on_restore_too(world: World) -> None:
    engine = world.start()
    action = world.write(engine, key="fix-1")
    world.adapter.files["app.py"] = SILENT_EDIT
    with pytest.raises(EnvironmentMismatchError):
        engine.propose(action)
    with pytest.raises(CheckpointError) as err:
        world.resume()
    assert err.value.reason == "environment"
    assert world.adapter.write_count == 0


def test_a_stale_owner_whose_successor_wrote_is_refused_by_the_fence(world: World) -> None:
    """The live check must not hide a stale owner behind a drift error: the adapter
    judges the fence first."""

    class Paused(Exception):
        pass

    def pause(window: CrashWindow) -> None:
        if window is CrashWindow.AFTER_PENDING_BEFORE_ADAPTER:
            raise Paused

    first = world.start(probe=pause)
    with pytest.raises(Paused):  # committed its pending write, then stalled
        first.propose(world.write(first, key="fix-1"))
    second = world.resume(lease_version=2)
    second.reconcile()  # the successor executed the write
    refused = world.adapter.refused_stale
    with pytest.raises(FenceRejectedError):
        first.execute_pending()
    assert world.adapter.refused_stale == refused + 1
    assert world.adapter.write_count == 1


def test_the_write_goes_when_the_live_environment_is_exactly_the_planned_one(
    world: World,
) -> None:
    engine = world.start()
    counting = CountingAdapter(world.adapter)
    engine.executor.adapter = counting
    assert engine.propose(world.write(engine, key="fix-1")).outcome is TraceOutcome.EXECUTED
    assert world.adapter.files["app.py"] == RIGHT_GREETING
    # The live check before the write and the observation after it.
    assert counting.observed == 2


def test_an_adapter_that_enforces_preconditions_itself_is_not_observed_again(
    world: World,
) -> None:
    engine = world.start()
    counting = CountingAdapter(world.adapter, enforces=True)
    engine.executor.adapter = counting
    assert engine.propose(world.write(engine, key="fix-1")).outcome is TraceOutcome.EXECUTED
    assert counting.observed == 1  # only the observation after the write


def test_only_a_literal_true_declaration_skips_the_check(world: World) -> None:
    engine = world.start()
    engine.executor.adapter = CountingAdapter(world.adapter, enforces="yes")
    world.adapter.files["app.py"] = SILENT_EDIT
    with pytest.raises(EnvironmentMismatchError):
        engine.propose(world.write(engine, key="fix-1"))
    assert world.adapter.write_count == 0
    assert engine.state.phase is Phase.RUNNING


def test_the_declaration_reaches_the_engine_through_a_workers_executor(world: World) -> None:
    """A worker's executor has a guard, hooks and metrics around the adapter: the
    declaration must still reach the engine, or a declaring adapter would pay the check
    anyway."""

    class Guard:
        def check(self) -> None:
            pass

        def progress(self) -> None:
            pass

    engine = world.start()
    counting = CountingAdapter(world.adapter, enforces=True)
    engine.executor = Executor(
        counting, world.store.leased(1), hooks=Hooks(), guard=Guard(), measure=True
    )
    assert engine.propose(world.write(engine, key="fix-1")).outcome is TraceOutcome.EXECUTED
    assert counting.observed == 1
    assert Executor(world.adapter, world.store).enforces_preconditions is False
