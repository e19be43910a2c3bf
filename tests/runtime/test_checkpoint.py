"""Restore fails closed: corruption, tampering, wrong keys, rollback, missing high-water,
unknown fields, changed contracts, environment drift and untrusted evidence."""

from __future__ import annotations

import hashlib
import itertools
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ratchet.errors import CheckpointError, CheckpointTooLargeError, InvariantViolation
from ratchet.runtime import KeyRing, Observation, RunEngine, Scenario, restore_checkpoint
from ratchet.runtime.canonical import canonical_json
from ratchet.runtime.checkpoint import run_key, seal_checkpoint
from ratchet.runtime.history import grow, key_positions
from ratchet.runtime.signing import parse_envelope, seal_envelope
from ratchet.runtime.state import TraceEvent, TraceOutcome, check_invariants
from tests.runtime.world import CHECKPOINT_SECRET, OTHER_SECRET, World, resign, scenario_data


def restore(
    world: World,
    blob: bytes,
    *,
    scenario: Scenario | None = None,
    keyring: KeyRing | None = None,
    observed: Observation | None = None,
    with_store: bool = True,
    with_trust: bool = True,
) -> object:
    return restore_checkpoint(
        blob,
        scenario=scenario or world.scenario,
        keyring=keyring or world.keyring,
        high_water=world.store.high_water if with_store else None,
        observe=lambda _state, _gen: observed or world.adapter.observe(),
        approvers=world.approvers if with_trust else None,
        reviewers=world.reviewers if with_trust else None,
    )


def reason_of(world: World, blob: bytes, **kw: object) -> str:
    with pytest.raises(CheckpointError) as err:
        restore(world, blob, **kw)  # type: ignore[arg-type]
    return str(err.value.reason)


@pytest.fixture
def engine(world: World) -> RunEngine:
    engine = world.start()
    engine.propose(world.write(engine))
    return engine


def test_a_fresh_checkpoint_restores_to_the_same_state(world: World, engine: RunEngine) -> None:
    restored = restore(world, engine.checkpoint)
    assert restored.state == engine.state  # type: ignore[attr-defined]
    assert restored.generation == engine.generation  # type: ignore[attr-defined]


def test_random_corruption_is_caught_by_the_checksum(world: World, engine: RunEngine) -> None:
    blob = bytearray(engine.checkpoint)
    blob[-5] ^= 0x01
    assert reason_of(world, bytes(blob)) == "checksum"


def test_payload_tampering_with_a_recomputed_plain_checksum_fails_the_hmac(
    world: World, engine: RunEngine
) -> None:
    _, body = parse_envelope(engine.checkpoint)
    forged = body.replace(b'"phase":"running"', b'"phase":"completed"')
    assert forged != body
    head = json.loads(engine.checkpoint.split(b"\n", 1)[0])
    head["sum"] = hashlib.sha256(forged).hexdigest()
    head["len"] = len(forged)
    blob = canonical_json(head) + b"\n" + forged
    assert reason_of(world, blob) == "bad_mac"


def test_a_wrong_key_under_the_same_key_id_fails_the_hmac(world: World, engine: RunEngine) -> None:
    wrong = KeyRing.from_secrets({"k1": OTHER_SECRET}, signing_kid="k1")
    assert reason_of(world, engine.checkpoint, keyring=wrong) == "bad_mac"


def test_an_unknown_key_id_is_refused(world: World, engine: RunEngine) -> None:
    other = KeyRing.from_secrets({"k9": OTHER_SECRET}, signing_kid="k9")
    assert reason_of(world, engine.checkpoint, keyring=other) == "unknown_kid"


def test_older_keys_verify_and_the_newest_signs(world: World, engine: RunEngine) -> None:
    rotated = KeyRing.from_secrets({"k1": CHECKPOINT_SECRET, "k2": OTHER_SECRET}, signing_kid="k2")
    restore(world, engine.checkpoint, keyring=rotated)
    assert parse_envelope(seal_envelope(rotated, b"{}"))[0].kid == "k2"
    retired = KeyRing(rotated.keys, "k2", frozenset({"k1"}))
    assert reason_of(world, engine.checkpoint, keyring=retired) == "retired_kid"


def test_an_older_generation_with_a_valid_hmac_is_refused(world: World) -> None:
    engine = world.start()
    old = engine.checkpoint
    engine.propose(world.action(engine, "read_file", {"path": "app.py"}))
    assert reason_of(world, old) == "stale_generation"


def test_a_missing_high_water_store_fails_closed(world: World, engine: RunEngine) -> None:
    assert reason_of(world, engine.checkpoint, with_store=False) == "high_water_missing"
    world.store.available = False
    assert reason_of(world, engine.checkpoint) == "high_water_missing"


def test_a_run_unknown_to_the_store_fails_closed(world: World, engine: RunEngine) -> None:
    world.store.checkpoints.clear()
    assert reason_of(world, engine.checkpoint) == "high_water_missing"


def test_an_unknown_field_in_a_validly_signed_payload_is_refused(
    world: World, engine: RunEngine
) -> None:
    blob = resign(world, engine.checkpoint, lambda d: d["state"].update(extra="x"))
    assert reason_of(world, blob) == "schema"


def test_a_duplicate_key_in_a_validly_signed_payload_is_refused(
    world: World, engine: RunEngine
) -> None:
    _, body = parse_envelope(engine.checkpoint)
    dup = body[:-1] + b',"generation":' + str(engine.generation).encode() + b"}"
    blob = seal_envelope(world.keyring, dup)
    assert reason_of(world, blob) == "schema"


def test_a_non_canonical_payload_is_refused(world: World, engine: RunEngine) -> None:
    _, body = parse_envelope(engine.checkpoint)
    pretty = json.dumps(json.loads(body), indent=1).encode()
    assert reason_of(world, seal_envelope(world.keyring, pretty)) == "schema"


def test_an_unsupported_schema_version_is_named(world: World, engine: RunEngine) -> None:
    blob = resign(world, engine.checkpoint, lambda d: d.update(schema_version=2))
    assert reason_of(world, blob) == "schema_version"


@pytest.mark.parametrize(
    "change", [{"task_version": "2"}, {"policy_version": "9"}, {"allowed_paths": ["app.py"]}]
)
def test_a_changed_task_or_policy_fails_closed(
    world: World, engine: RunEngine, change: dict[str, object]
) -> None:
    changed = Scenario.model_validate(scenario_data(**change))
    assert reason_of(world, engine.checkpoint, scenario=changed) == "scenario"


def test_same_version_with_a_different_state_fails_closed(world: World, engine: RunEngine) -> None:
    now = world.adapter.observe()
    forged = Observation(instance_id=now.instance_id, version=now.version, fingerprint="0" * 64)
    assert reason_of(world, engine.checkpoint, observed=forged) == "environment"


def test_the_same_state_on_another_instance_fails_closed(world: World, engine: RunEngine) -> None:
    now = world.adapter.observe()
    twin = Observation(instance_id="ws-b", version=now.version, fingerprint=now.fingerprint)
    assert reason_of(world, engine.checkpoint, observed=twin) == "environment"


def test_multi_step_drift_not_explained_by_the_pending_write_fails_closed(
    world: World, engine: RunEngine
) -> None:
    world.adapter.external_edit("app.py", "print('edited by someone else')\n")
    assert reason_of(world, engine.checkpoint) == "environment"


def test_an_invalid_state_does_not_advance_the_high_water_mark(
    world: World, engine: RunEngine
) -> None:
    before = world.store.high_water(run_key(engine.state))
    gap = TraceEvent(seq=len(engine.state.trace) + 5, at=0, outcome=TraceOutcome.READ)
    broken = engine.state.model_copy(update={"trace": (*engine.state.trace, gap)})
    with pytest.raises(InvariantViolation, match="contiguous"):
        engine._drive(engine._commit(broken))
    assert world.store.high_water(run_key(engine.state)) == before
    assert engine.generation == before
    restore(world, engine.checkpoint)  # the last good checkpoint still restores


def test_a_gap_inside_the_already_committed_trace_is_still_found(
    world: World, engine: RunEngine
) -> None:
    """The contiguity check skips only the prefix that is the very trace last committed:
    a state whose earlier events were replaced is checked whole."""
    first = engine.state.trace[0]
    moved = first.model_copy(update={"seq": first.seq + 7})
    broken = engine.state.model_copy(update={"trace": (moved, *engine.state.trace[1:])})
    with pytest.raises(InvariantViolation, match="contiguous"):
        check_invariants(broken, world.scenario, previous=engine.state)
    check_invariants(engine.state, world.scenario, previous=engine.state)


def test_a_key_executed_twice_is_refused_whatever_was_checked_before(
    world: World, engine: RunEngine
) -> None:
    assert engine.state.executed, "the fixture's run has executed a write"
    again = engine.state.executed[-1].model_copy(update={"action_id": "a-again"})
    key_positions(engine.state.executed)  # an index grow() then extends in place
    for executed in (
        (*engine.state.executed, again),  # a tuple the history tables never saw
        grow(engine.state.executed, again),  # the runtime's own append
    ):
        doubled = engine.state.model_copy(update={"executed": executed})
        for previous in (None, engine.state):
            with pytest.raises(InvariantViolation, match="executed twice"):
                check_invariants(doubled, world.scenario, previous=previous)
        assert doubled.cached(again.idempotency_key) is engine.state.executed[-1]


def test_a_schema_invalid_state_does_not_advance_the_high_water_mark(
    world: World, engine: RunEngine
) -> None:
    before = world.store.high_water(run_key(engine.state))
    broken = engine.state.model_copy(update={"plan_cursor": -1})
    with pytest.raises(InvariantViolation, match="schema"):
        engine._drive(engine._commit(broken))
    assert world.store.high_water(run_key(engine.state)) == before


def test_a_checkpoint_over_the_cap_is_refused_before_the_store(
    world: World, engine: RunEngine
) -> None:
    before = world.store.commits
    with pytest.raises(CheckpointTooLargeError):
        seal_checkpoint(
            engine.state,
            world.scenario,
            world.keyring,
            generation=engine.generation + 1,
            max_bytes=1000,
        )
    assert world.store.commits == before


@pytest.mark.parametrize("blob", [b"", b"no header", b"{}\n{}", b'{"v":1}\n{}', "text"])
def test_malformed_envelopes_are_typed_errors(world: World, blob: object) -> None:
    assert reason_of(world, blob) == "malformed"  # type: ignore[arg-type]


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(position=st.integers(min_value=0), bit=st.integers(min_value=0, max_value=7))
def test_flipping_any_bit_of_a_signed_checkpoint_is_rejected(
    world: World, engine: RunEngine, position: int, bit: int
) -> None:
    blob = bytearray(engine.checkpoint)
    blob[position % len(blob)] ^= 1 << bit
    with pytest.raises(CheckpointError):
        restore(world, bytes(blob))


def test_a_checkpoint_records_policy_permissions_receipts_budgets_and_environment(
    world: World, engine: RunEngine
) -> None:
    """Not just messages: everything recovery must re-check is in the signed payload."""
    _, body = parse_envelope(engine.checkpoint)
    payload = json.loads(body)
    state = payload["state"]
    assert payload["scenario_fingerprint"] == world.scenario.fingerprint  # covers permissions
    assert (state["policy_id"], state["policy_version"]) == ("default", "3")
    assert (state["task_id"], state["task_version"]) == ("fix-greeting", "1")
    assert state["usage"] == {"proposals": 1, "steps": 1, "cost_units": 0}
    assert state["environment"]["instance_id"] == "ws-a"
    assert state["environment"]["fingerprint"] == world.adapter.observe().fingerprint
    executed = state["executed"][0]
    assert executed["idempotency_key"] == executed["receipt"]["idempotency_key"]
    assert executed["receipt_fingerprint"] == engine.state.executed[0].receipt.fingerprint
    assert state["phase"] == "running" and "plan_cursor" in state


def test_sealing_after_a_previous_state_gives_the_bytes_of_a_fresh_seal(world: World) -> None:
    engine = world.start()
    states = [engine.state]
    for content in ("print('a')\n", "print('b')\n"):
        engine.propose(world.write(engine, content))
        states.append(engine.state)
    engine.propose(world.action(engine, "read_file", {"path": "app.py"}))
    states.append(engine.state)
    # A state that shares no entry object with the one before it (rebuilt from JSON).
    rebuilt = type(engine.state).model_validate_json(engine.state.model_dump_json())
    states.append(rebuilt)
    # A state whose newest entry was swapped for an equal-looking different one.
    last = states[-2].trace[-1].model_copy(update={"at": 7})
    states.append(states[-2].model_copy(update={"trace": (*states[-2].trace[:-1], last)}))
    for generation, (previous, state) in enumerate(itertools.pairwise(states), 2):
        incremental = seal_checkpoint(
            state, world.scenario, world.keyring, generation=generation, previous=previous
        )
        fresh = seal_checkpoint(state, world.scenario, world.keyring, generation=generation)
        assert incremental == fresh
