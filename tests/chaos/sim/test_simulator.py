"""The simulator on the unbroken build: its budget of schedules keeps every invariant,
each schedule replays exactly, every kind of fault fires, and a schedule is data that
round-trips through its text form."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from typing import Any

import pytest

from ratchet.chaos.sim import (
    INVARIANTS,
    Runner,
    explore,
    format_schedule,
    parse_schedule,
    replay,
)
from ratchet.chaos.sim.schedule import CODES, Entry
from ratchet.errors import ContractError
from ratchet.runtime import checkpoint as checkpoint_module
from ratchet.runtime import window as window_module

CI_SCHEDULES = 6_000


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_ci_budget_of_schedules_of_the_unbroken_build_keeps_every_invariant(
    record_property: pytest.RecordProperty,
) -> None:
    exploration = explore(CI_SCHEDULES, processes=2)
    record_property("schedules_per_second", round(exploration.per_second, 1))
    print(f"\n{exploration.schedules} schedules, {exploration.per_second:.0f} per second")
    assert exploration.failure is None, exploration.failure.render()
    assert exploration.schedules == CI_SCHEDULES
    # The faults did happen: workers died, replies were lost, leases were taken over.
    assert exploration.outcomes["crashed"] > CI_SCHEDULES
    assert exploration.outcomes["lease_lost"] > 0
    assert exploration.outcomes["retry_later"] > 0


def test_a_schedule_replays_to_the_same_execution() -> None:
    with Runner() as runner:
        for seed in (3, 17, 42):
            explored = runner.run(seed)
            again = runner.run(seed, explored.schedule)
            assert again.schedule == explored.schedule
            assert (again.points, again.jobs, again.outcomes) == (
                explored.points,
                explored.jobs,
                explored.outcomes,
            )
            assert again.violation == explored.violation is None


def test_every_kind_of_decision_is_taken_in_a_few_hundred_schedules() -> None:
    taken: Counter[str] = Counter()
    windows: Counter[str] = Counter()
    refused = 0
    with Runner() as runner:
        for seed in range(300):
            result = runner.run(seed)
            assert result.violation is None, (seed, result.violation)
            taken.update(e.code[0] for e in result.schedule)
            windows.update(result.outcomes)
            refused += result.outcomes.get("lease_lost_before_refusal", 0)
    assert set(taken) == {code[0] for code in CODES}, taken
    assert windows["crashed"] > 0 and windows["held_elsewhere"] > 0
    assert refused > 0  # zombies whose fence a successor had raised past


def test_a_dropped_subsequence_of_a_schedule_still_replays() -> None:
    with Runner() as runner:
        seed = next(s for s in range(11, 200) if len(runner.run(s).schedule) >= 6)
        explored = runner.run(seed)
        half = explored.schedule[::2]
        result = runner.run(seed, half)
        assert result.violation is None
        assert set(result.schedule) <= set(half)


def test_schedule_text_round_trips() -> None:
    entries = [Entry(3, "c"), Entry(9, "p600"), Entry(10, "w1"), Entry(12, "l")]
    text = format_schedule(entries)
    assert text == "3:c 9:p600 10:w1 12:l"
    assert parse_schedule(text) == entries


@pytest.mark.parametrize("text", ["x", "3:q", "3:p", "3:c5", "3:c 3:l", "-1:c"])
def test_a_malformed_schedule_is_refused_in_one_line(text: str) -> None:
    with pytest.raises(ContractError) as refused:
        parse_schedule(text)
    assert "\n" not in refused.value.message
    with pytest.raises(ContractError):
        replay(0, text)


def test_the_public_names_are_pinned() -> None:
    from ratchet.chaos import sim

    assert sim.__all__ == [
        "INVARIANTS",
        "Entry",
        "Exploration",
        "Failure",
        "Profile",
        "Runner",
        "SimResult",
        "Violation",
        "explore",
        "format_schedule",
        "minimise",
        "parse_schedule",
        "replay",
    ]


def test_the_invariants_are_named_once() -> None:
    assert len(set(INVARIANTS)) == len(INVARIANTS) == 14


def test_the_command_line_replays_a_schedule_and_explores() -> None:
    replayed = subprocess.run(
        [
            sys.executable,
            "-m",
            "ratchet.chaos.sim",
            "--seed",
            "59",
            "--schedule",
            "11:c 41:p600",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert replayed.returncode == 0, replayed.stderr
    report = json.loads(replayed.stdout)
    assert report["seed"] == 59 and report["violation"] is None
    explored = subprocess.run(
        [sys.executable, "-m", "ratchet.chaos.sim", "--schedules", "20", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert explored.returncode == 0, explored.stderr
    summary = json.loads(explored.stdout)
    assert summary["schedules"] == 20 and summary["failure"] is None
    bad = subprocess.run(
        [sys.executable, "-m", "ratchet.chaos.sim", "--schedule", "nonsense"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1


@pytest.mark.chaos
@pytest.mark.timeout(24 * 3600)
def test_a_million_schedules_of_the_unbroken_build_keep_every_invariant() -> None:
    exploration = explore(1_000_000, start=CI_SCHEDULES, processes=2)
    print(f"\n{exploration.schedules} schedules, {exploration.per_second:.0f} per second")
    assert exploration.failure is None, exploration.failure.render()
    assert exploration.schedules == 1_000_000


def test_schedules_with_a_one_segment_window_keep_every_invariant(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The window moving at nearly every commit (it keeps one segment), under the
    simulator's crashes, lost replies, held commits and takeovers: every invariant holds,
    restores read only the archive's tail, and the window did move."""
    moved: list[int] = []
    real_choose = window_module.choose_cut

    def counted(*args: Any, **kwargs: Any) -> Any:
        cut = real_choose(*args, **kwargs)
        if cut is not None:
            moved.append(cut.segments)
        return cut

    monkeypatch.setattr(window_module, "WINDOW_SEGMENTS", 1)
    monkeypatch.setattr(checkpoint_module, "choose_cut", counted)
    exploration = explore(300, start=50_000, processes=1)
    assert exploration.failure is None, exploration.failure.render()
    assert len(moved) > 300  # the window moved, many times per run
    assert exploration.outcomes["crashed"] > 0 and exploration.outcomes["lease_lost"] > 0
