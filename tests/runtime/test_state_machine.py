"""The transition table, budgets, the gate's rejections and the trace."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ratchet.errors import InvalidTransitionError
from ratchet.runtime import (
    TRANSITIONS,
    Event,
    Phase,
    RunEngine,
    Scenario,
    TraceOutcome,
    check_invariants,
    transition,
)
from ratchet.runtime.state import TERMINAL_PHASES
from tests.runtime.world import World, scenario_data


@pytest.mark.parametrize(("phase", "event"), list(itertools.product(Phase, Event)))
def test_every_phase_and_event_pair_follows_the_table(phase: Phase, event: Event) -> None:
    if (phase, event) in TRANSITIONS:
        assert transition(phase, event) is TRANSITIONS[(phase, event)]
    else:
        with pytest.raises(InvalidTransitionError):
            transition(phase, event)


def test_terminal_phases_have_no_way_out() -> None:
    assert not [k for k in TRANSITIONS if k[0] in TERMINAL_PHASES]


def test_a_terminal_run_takes_no_proposal_and_records_nothing(world: World) -> None:
    engine = world.start()
    engine.cancel("operator stop")
    generation = engine.generation
    with pytest.raises(InvalidTransitionError):
        engine.propose(world.action(engine, "read_file", {"path": "app.py"}))
    assert engine.generation == generation


def small(world: World, **budgets: int) -> World:
    limits = {"proposals": 3, "steps": 2, "wall_clock_seconds": 60, "cost_units": 10}
    limits.update(budgets)
    return World(scenario=Scenario.model_validate(scenario_data(budgets=limits)))


def test_a_rejected_proposal_still_spends_proposal_budget(world: World) -> None:
    engine = world.start()
    engine.propose(world.action(engine, "read_file", {"path": "secret.txt"}))
    assert engine.state.trace[-1].outcome is TraceOutcome.REJECTED_SCOPE
    assert engine.state.usage.proposals == 1
    assert engine.state.usage.steps == 0


def test_exhausting_the_proposal_budget_fails_the_run(world: World) -> None:
    w = small(world)
    engine = w.start()
    for _ in range(3):
        engine.propose(w.action(engine, "read_file", {"path": "nope/x"}))
    result = engine.propose(w.action(engine, "read_file", {"path": "app.py"}))
    assert result.outcome is TraceOutcome.BUDGET_EXHAUSTED
    assert engine.state.phase is Phase.FAILED
    assert engine.state.stop_reason == "budget exhausted: proposals"


def test_exhausting_the_step_budget_fails_the_run(world: World) -> None:
    w = small(world, proposals=5)
    engine = w.start()
    for _ in range(2):
        engine.propose(w.action(engine, "read_file", {"path": "app.py"}))
    assert engine.propose(w.action(engine, "read_file", {"path": "app.py"})).phase is Phase.FAILED
    assert engine.state.stop_reason == "budget exhausted: steps"


def test_exhausting_the_cost_budget_fails_the_run(world: World) -> None:
    w = small(world)
    engine = w.start()
    engine.propose(w.action(engine, "read_file", {"path": "app.py"}, cost=7))
    assert (
        engine.propose(w.action(engine, "read_file", {"path": "app.py"}, cost=4)).phase
        is Phase.FAILED
    )
    assert engine.state.stop_reason == "budget exhausted: cost_units"


def test_exhausting_the_wall_clock_fails_the_run(world: World) -> None:
    w = small(world)
    engine = w.start()
    w.clock.advance(61)
    result = engine.propose(w.action(engine, "read_file", {"path": "app.py"}))
    assert result.phase is Phase.FAILED
    assert engine.state.stop_reason == "budget exhausted: wall_clock_seconds"


def rejection_cases(world: World, engine: RunEngine) -> list[tuple[Any, TraceOutcome]]:
    stale = world.action(engine, "read_file", {"path": "app.py"}).model_copy(
        update={"expected_env_version": 99}
    )
    late = world.action(engine, "read_file", {"path": "app.py"}).model_copy(
        update={"deadline_at": world.clock.now() - 1}
    )
    return [
        ({"kind": "read_file"}, TraceOutcome.REJECTED_SCHEMA),
        (late, TraceOutcome.REJECTED_DEADLINE),
        (world.action(engine, "read_file", {"path": "etc/passwd"}), TraceOutcome.REJECTED_SCOPE),
        (world.action(engine, "run_verifier", {"target": "deploy"}), TraceOutcome.REJECTED_SCOPE),
        (
            world.action(
                engine, "external_call", {"operation": "wire-money", "body": "{}"}, key="k-x"
            ),
            TraceOutcome.REJECTED_SCOPE,
        ),
        (stale, TraceOutcome.REJECTED_STALE_ENV),
        (world.finish(engine), TraceOutcome.REJECTED_UNVERIFIED),
    ]


def test_each_kind_of_rejection_is_a_typed_trace_outcome(world: World) -> None:
    engine = world.start()
    for raw, outcome in rejection_cases(world, engine):
        assert engine.propose(raw).outcome is outcome
        assert engine.state.phase is Phase.RUNNING
    assert world.adapter.write_count == 0


def test_an_action_outside_the_permissions_is_rejected(world: World) -> None:
    w = World(
        scenario=Scenario.model_validate(
            scenario_data(permissions=["read_file", "run_verifier", "finish"], approval_required=[])
        )
    )
    engine = w.start()
    assert engine.propose(w.write(engine)).outcome is TraceOutcome.REJECTED_PERMISSION


def test_trace_sequence_numbers_are_contiguous_and_checked(world: World) -> None:
    engine = world.start()
    engine.propose(world.action(engine, "read_file", {"path": "app.py"}))
    engine.propose(world.write(engine))
    assert [e.seq for e in engine.state.trace] == list(range(1, len(engine.state.trace) + 1))


# --- property: random operations never leave the table and never break invariants ------

OPS = st.lists(
    st.sampled_from(
        [
            "read",
            "write",
            "write_same_key",
            "write_other_intent",
            "order",
            "approve",
            "verify",
            "finish",
            "cancel",
            "bad_scope",
            "tick",
            "drift_receipt",
            "replan",
            "abort",
        ]
    ),
    min_size=1,
    max_size=25,
)


def apply_op(world: World, engine: RunEngine, op: str) -> None:
    try:
        if op == "read":
            engine.propose(world.action(engine, "read_file", {"path": "app.py"}))
        elif op == "write":
            engine.propose(world.write(engine))
        elif op == "write_same_key":
            engine.propose(world.write(engine, key="fixed-key"))
        elif op == "write_other_intent":
            engine.propose(world.write(engine, "print('x')\n", key="fixed-key"))
        elif op == "order":
            engine.propose(world.order(engine, key=f"order-{engine.state.next_seq}"))
        elif op == "approve" and engine.state.pending is not None:
            engine.refresh_pending_approval(world.approve(engine))
        elif op == "verify":
            engine.propose(world.verify(engine))
        elif op == "finish":
            engine.propose(world.finish(engine))
        elif op == "cancel":
            engine.cancel("random stop")
        elif op == "bad_scope":
            engine.propose(world.action(engine, "read_file", {"path": "x/y"}))
        elif op == "tick":
            world.clock.advance(400)
        elif op == "drift_receipt" and world.adapter.receipts:
            key = next(iter(world.adapter.receipts))
            world.adapter.replace_receipt(key, receipt_id=f"r-{engine.state.next_seq}")
        elif op in ("replan", "abort") and engine.state.review is not None:
            engine.apply_review_decision(world.decide(engine, op))
    except InvalidTransitionError:
        pass  # refused without a change: checked below like any other step
    except Exception as exc:  # evidence refusals are typed and change nothing
        from ratchet.errors import EvidenceError

        if not isinstance(exc, EvidenceError):
            raise


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_random_operations_stay_inside_the_transition_table(ops: list[str]) -> None:
    world = World()
    engine = world.start()
    phases = [engine.state.phase]
    for op in ops:
        before = (engine.state, engine.generation)
        apply_op(world, engine, op)
        check_invariants(engine.state, world.scenario)
        if engine.state.phase is not phases[-1]:
            assert engine.state.phase in {
                v for (p, _), v in TRANSITIONS.items() if p is phases[-1]
            }, (phases[-1], engine.state.phase)
            phases.append(engine.state.phase)
        if engine.generation == before[1]:
            assert engine.state == before[0]  # no commit, no change
        if engine.state.phase in TERMINAL_PHASES:
            break
    # Every write happened at most once per idempotency key.
    keys = [k for k, _ in world.adapter.effects]
    assert len(keys) == len(set(keys))
    # The signed checkpoint always restores to the same state.
    restored = world.resume(engine.checkpoint, lease_version=9)
    assert restored.state == engine.state


def test_the_agents_own_state_is_signed_committed_and_handed_back_on_resume(
    world: World,
) -> None:
    engine = world.start()
    notes = {"cursor": 2, "notes": ["read app.py"], "done": False, "summary": None}
    engine.propose(world.action(engine, "read_file", {"path": "app.py"}), agent_state=notes)
    resumed = world.resume()
    assert resumed.state.agent_state == notes
    assert resumed.state.agent_state["done"] is False  # a bool stays a bool


def test_agent_state_with_a_float_is_refused_before_anything_is_committed(world: World) -> None:
    from ratchet.errors import InvariantViolation

    engine = world.start()
    generation = engine.generation
    with pytest.raises(InvariantViolation):
        engine.propose(
            world.action(engine, "read_file", {"path": "app.py"}), agent_state={"score": 0.5}
        )
    assert engine.generation == generation
    assert world.store.high_water(engine.key) == generation
