"""Coalesced commits: a write's receipt + state commit is held and sent together with the
run's next commit. Same checkpoints, fewer round trips, and every crash still recovers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from ratchet.errors import CommitOutcomeUnknownError, LeaseLostError
from ratchet.runtime import CrashWindow, Effect, Hooks, Phase, RunEngine, TraceOutcome
from ratchet.runtime.effects import Commit
from ratchet.runtime.engine import Probe
from tests.runtime.world import RIGHT_GREETING, World


class Recorder(Hooks):
    """Executor hooks that record each commit round trip the store applied: the
    generations it carried."""

    def __init__(self) -> None:
        self.trips: list[list[int]] = []
        self.blobs: list[bytes] = []

    def around(self, effect: Effect, proceed: Callable[[], Any]) -> Any:
        result = proceed()
        if isinstance(effect, Commit):
            self.trips.append([c.expected_generation + 1 for c in effect.batch])
            self.blobs.extend(c.blob for c in effect.batch)
        return result


def start(
    world: World, *, coalesce: bool, probe: Probe | None = None
) -> tuple[RunEngine, Recorder]:
    recorder = Recorder()
    engine = RunEngine.start(
        world.run_id,
        **world.ports(store=world.store.leased(1), hooks=recorder, probe=probe, coalesce=coalesce),
    )
    return engine, recorder


def play(world: World, engine: RunEngine) -> None:
    """Two writes, a read, a verification and the finish."""
    assert (
        engine.propose(world.write(engine, "print('draft')\n", key="w-1")).outcome
        is TraceOutcome.EXECUTED
    )
    assert engine.propose(world.write(engine, key="w-2")).outcome is TraceOutcome.EXECUTED
    engine.propose(world.action(engine, "read_file", {"path": "app.py"}))
    assert engine.propose(world.verify(engine)).outcome is TraceOutcome.VERIFIED
    assert engine.propose(world.finish(engine)).phase is Phase.COMPLETED


def test_coalesced_and_plain_runs_commit_the_same_checkpoints_in_fewer_round_trips() -> None:
    plain_world, coalesced_world = World(), World()
    plain, plain_log = start(plain_world, coalesce=False)
    coalesced, coalesced_log = start(coalesced_world, coalesce=True)
    play(plain_world, plain)
    play(coalesced_world, coalesced)
    assert coalesced_log.blobs == plain_log.blobs  # byte for byte, generation for generation
    assert coalesced.held_commits == 0 and coalesced.generation == plain.generation
    assert all(len(trip) == 1 for trip in plain_log.trips)
    # The first write's receipt rides with the second write's intent, the second's with
    # the read: two round trips fewer, each carrying two consecutive generations.
    batched = [trip for trip in coalesced_log.trips if len(trip) > 1]
    assert len(batched) == 2 and all(b == a + 1 for a, b in batched)
    assert len(coalesced_log.trips) == len(plain_log.trips) - 2
    assert coalesced_world.adapter.write_count == plain_world.adapter.write_count == 2


def test_a_write_leaves_its_receipt_held_until_the_next_commit(world: World) -> None:
    engine, log = start(world, coalesce=True)
    engine.propose(world.write(engine, key="w-1"))
    assert engine.held_commits == 1
    assert engine.durable_generation == engine.generation - 1
    assert world.store.high_water(engine.key) == engine.durable_generation
    stored = RunEngine.resume(world.store.load(engine.key).blob, **world.ports())
    assert stored.state.pending is not None  # the durable checkpoint: intent, no receipt
    assert engine.state.pending is None  # the engine's view: the write is complete
    engine.propose(world.action(engine, "read_file", {"path": "app.py"}))
    assert engine.held_commits == 0
    assert world.store.high_water(engine.key) == engine.generation == engine.durable_generation
    assert log.trips[-1] == [engine.generation - 1, engine.generation]


def test_flush_sends_what_is_held_and_is_a_no_op_otherwise(world: World) -> None:
    engine, log = start(world, coalesce=True)
    engine.flush()
    assert len(log.trips) == 1  # only the creation
    engine.propose(world.write(engine, key="w-1"))
    engine.flush()
    assert engine.held_commits == 0 and log.trips[-1] == [engine.generation]
    assert world.store.high_water(engine.key) == engine.generation
    engine.flush()
    assert log.trips[-1] == [engine.generation] and engine.held_commits == 0


def test_a_run_that_ends_or_waits_holds_nothing(world: World) -> None:
    engine, _ = start(world, coalesce=True)
    engine.propose(world.order(engine))  # needs approval: the wait is committed at once
    assert engine.state.phase is Phase.AWAITING_APPROVAL
    assert engine.held_commits == 0
    assert world.store.high_water(engine.key) == engine.generation


def test_a_worker_that_dies_with_a_held_commit_recovers_by_the_adapters_receipt(
    world: World,
) -> None:
    engine, _ = start(world, coalesce=True)
    engine.propose(world.write(engine, key="w-1"))
    assert engine.held_commits == 1
    del engine  # the worker dies: the held commit never left the process
    resumed = world.resume()
    assert resumed.reconcile().window is CrashWindow.AFTER_ADAPTER_BEFORE_RECEIPT
    assert world.adapter.write_count == 1
    assert resumed.state.executed[-1].idempotency_key == "w-1"
    assert resumed.propose(world.verify(resumed)).outcome is TraceOutcome.VERIFIED
    assert resumed.propose(world.finish(resumed)).phase is Phase.COMPLETED
    assert world.adapter.write_count == 1
    assert world.adapter.files["app.py"] == RIGHT_GREETING


def test_a_refused_batch_leaves_the_engine_at_the_last_acknowledged_commit(world: World) -> None:
    engine, _ = start(world, coalesce=True)
    engine.propose(world.write(engine, key="w-1"))
    durable = engine.durable_generation
    world.store.leased(2).claim(world.run_id)  # another worker took the run over
    with pytest.raises(LeaseLostError):
        engine.propose(world.write(engine, "print('late')\n", key="w-2"))
    assert engine.generation == engine.durable_generation == durable
    assert engine.held_commits == 0
    assert engine.state.pending is not None  # the last state the store acknowledged
    assert world.store.high_water(engine.key) == durable
    assert world.adapter.write_count == 1  # the second write never reached the adapter


def test_a_batch_whose_reply_is_lost_is_re_read_and_never_assumed(world: World) -> None:
    engine, _ = start(world, coalesce=True)
    engine.propose(world.write(engine, key="w-1"))
    durable = engine.durable_generation
    # The memory store applies the held receipt commit, then loses the reply: the intent
    # behind it never applied, so the batch's outcome is not what the engine sent.
    world.store.lose_next_reply = True
    with pytest.raises(CommitOutcomeUnknownError):
        engine.propose(world.write(engine, "print('two')\n", key="w-2"))
    assert engine.generation == durable and engine.held_commits == 0
    assert world.store.high_water(engine.key) == durable + 1
    assert world.adapter.write_count == 1
    resumed = world.resume()
    assert resumed.reconcile().window is CrashWindow.BEFORE_PROPOSAL  # the receipt is in
    assert resumed.state.executed[-1].idempotency_key == "w-1"
