"""Each known broken build is caught within its share of the CI budget, and the failure
names a seed and a minimised schedule that replays to the same failure. Two of the
breaks are in the job protocol itself, the code the RQ job runs too."""

from __future__ import annotations

import pytest

from ratchet.chaos.sim import explore, replay

from .mutants import MUTANTS

BUDGET = 2000  # schedules per mutant, at most (it stops at the first failure)

# What each break is caught as (the first invariant a schedule violates; a break may show
# up as one of a few, by which of its consequences comes first).
CAUGHT_AS = {
    "fences_disabled": {"no_stale_write"},
    "no_intent_commit": {"intent_committed_before_effect"},
    "commit_id_ignored": {"commit_replies_truthful"},
    "no_guard_before_write": {"no_stale_write"},
    "high_water_before_validation": {
        "high_water_never_goes_back",
        "checkpoint_moves_with_high_water",
    },
    "expiry_on_worker_clock": {"leases_on_the_store_clock", "run_finishes"},
    # Planted in the job protocol the workers run (ratchet.worker.jobprotocol): the
    # simulator drives that code, not a copy of it.
    "retry_frozen": {"no_unexplained_refusal"},
    "no_reconcile": {"run_finishes", "one_effect_per_intent", "no_unexplained_refusal"},
}


def test_every_mutant_has_an_expected_verdict() -> None:
    assert set(CAUGHT_AS) == set(MUTANTS)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_the_simulator_catches_the_broken_build(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    MUTANTS[name](monkeypatch)
    exploration = explore(BUDGET)
    failure = exploration.failure
    assert failure is not None, f"{name} survived {exploration.schedules} schedules"
    print(f"\n{name}: caught after {exploration.schedules} schedules\n{failure.render()}")
    assert failure.invariant in CAUGHT_AS[name], failure.render()
    block = failure.render()
    assert f"seed:      {failure.seed}" in block
    assert f"--seed {failure.seed} --schedule '{failure.schedule_text}'" in block
    assert len(failure.schedule) <= failure.original_entries
    again = replay(failure.seed, failure.schedule_text)
    assert again.violation is not None
    assert again.violation.invariant == failure.invariant
    monkeypatch.undo()
    # Without the break, the same schedule keeps every invariant: the break is the cause.
    assert replay(failure.seed, failure.schedule_text).violation is None
