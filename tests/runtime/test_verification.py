"""Completion needs a passing verifier event at the environment version after the last
write; a later write invalidates it."""

from __future__ import annotations

import pytest

from ratchet.errors import CheckpointError
from ratchet.runtime import Phase, RunEngine, TraceOutcome, VerifierReport, restore_checkpoint
from tests.runtime.world import WRONG_GREETING, World, resign


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


def _claim_completed(world: World, data: dict[str, object]) -> None:
    """An insider's edit: ``completed`` with a passing report bound to the current
    environment, but no verifier ever ran (no ``verified`` event in the trace)."""
    obs = world.adapter.observe()
    state = data["state"]
    assert isinstance(state, dict)
    state["phase"] = "completed"
    state["stop_reason"] = "completed"
    state["verification"] = VerifierReport(
        target="unit",
        passed=True,
        env_instance_id=obs.instance_id,
        env_version=obs.version,
        env_fingerprint=obs.fingerprint,
        output_digest="0" * 64,
    ).model_dump(mode="json")


@pytest.mark.parametrize("archived", [False, True], ids=["inline-trace", "archived-trace"])
def test_a_resigned_completed_checkpoint_without_a_verifier_event_is_refused(
    world: World, archived: bool
) -> None:
    """Completion evidence is the report *and* a passing verifier event of that report in
    the trace (in the archive, where the trace lives): a checkpoint re-signed by a key
    holder that claims ``completed`` without the event fails closed."""
    engine = (
        RunEngine.start(
            world.run_id, **world.ports(store=world.store.leased(1), archive_trace=True)
        )
        if archived
        else world.start()
    )
    engine.propose(world.write(engine))
    forged = resign(world, engine.checkpoint, lambda data: _claim_completed(world, data))
    stored = next(iter(world.store.checkpoints.values()))
    with pytest.raises(CheckpointError) as err:
        restore_checkpoint(
            forged,
            scenario=world.scenario,
            keyring=world.keyring,
            high_water=world.store.high_water,
            observe=lambda _s, _g: world.adapter.observe(),
            approvers=world.approvers,
            reviewers=world.reviewers,
            archive=stored.archive,
        )
    assert err.value.reason == "invariant"
    assert "verifier event" in err.value.message


def test_a_truly_verified_completed_checkpoint_still_restores(world: World) -> None:
    engine = world.start()
    engine.propose(world.write(engine))
    engine.propose(world.verify(engine))
    assert engine.propose(world.finish(engine)).phase is Phase.COMPLETED
    assert world.resume(engine.checkpoint).state.phase is Phase.COMPLETED
