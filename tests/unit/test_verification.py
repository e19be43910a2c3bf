"""Completion needs a passing verifier event at the environment version after the last
write; a later write invalidates it."""

from __future__ import annotations

import pytest

from ratchet.errors import CheckpointError
from ratchet.runtime import Phase, TraceOutcome
from tests.unit.world import WRONG_GREETING, World


def test_finishing_without_a_verifier_event_is_rejected(world: World) -> None:
    engine = world.start()
    engine.propose(world.write(engine))
    assert engine.propose(world.finish(engine)).outcome is TraceOutcome.REJECTED_UNVERIFIED


def test_a_failing_verifier_does_not_allow_completion(world: World) -> None:
    engine = world.start()
    assert engine.propose(world.verify(engine)).outcome is TraceOutcome.VERIFIED
    assert engine.state.verification is not None and not engine.state.verification.passed
    assert engine.propose(world.finish(engine)).outcome is TraceOutcome.REJECTED_UNVERIFIED


def test_a_later_write_invalidates_an_earlier_passing_verification(world: World) -> None:
    engine = world.start()
    engine.propose(world.write(engine))
    engine.propose(world.verify(engine))
    assert engine.state.verification is not None and engine.state.verification.passed
    engine.propose(world.write(engine, WRONG_GREETING + "# comment\n", key="second"))
    assert engine.state.verification is None
    assert engine.propose(world.finish(engine)).outcome is TraceOutcome.REJECTED_UNVERIFIED


def test_completion_evidence_is_bound_to_the_last_writes_version(world: World) -> None:
    engine = world.start()
    engine.propose(world.write(engine))
    engine.propose(world.verify(engine))
    result = engine.propose(world.finish(engine))
    assert result.phase is Phase.COMPLETED
    state = engine.state
    assert state.verification is not None
    assert state.verification.env_version == state.last_write_env_version
    verified = [e for e in state.trace if e.outcome is TraceOutcome.VERIFIED]
    assert verified[-1].verifier == state.verification
    assert verified[-1].env_version == state.environment.version


def test_an_edit_outside_the_runtime_voids_the_verification(world: World) -> None:
    engine = world.start()
    engine.propose(world.write(engine))
    engine.propose(world.verify(engine))
    world.adapter.external_edit("app.py", WRONG_GREETING)
    # The checkpoint's verification is bound to a state the world no longer has: a
    # resume fails closed instead of completing on it.
    with pytest.raises(CheckpointError) as err:
        world.resume(engine.checkpoint)
    assert err.value.reason == "environment"
