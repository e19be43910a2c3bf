"""Exploring many schedules, replaying one, and shrinking a failing one.

:func:`explore` runs the schedules of consecutive seeds (in one process, or split over
several spawned ones) and stops at the first failure; the failure is then minimised in
this process: delta debugging (Zeller's ddmin) over the failing schedule's entries, each
candidate replayed, keeping a subsequence only when it fails the *same* invariant, down
to one where no single entry can be dropped (or the replay budget is spent). The result
names the seed, the world it fixes and the minimised schedule, and replays with
``python -m ratchet.chaos.sim --seed N --schedule '<schedule>'`` or
:func:`replay` ``(seed, schedule)``.
"""

from __future__ import annotations

import multiprocessing
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .schedule import Entry, format_schedule, parse_schedule
from .sim import Runner, SimResult

__all__ = ["Exploration", "Failure", "explore", "minimise", "replay"]

MAX_REPLAYS = 400


@dataclass
class Failure:
    """A failing schedule, minimised: everything needed to replay it."""

    seed: int
    invariant: str
    detail: str
    world: str
    schedule: list[Entry]
    original_entries: int
    replays: int

    @property
    def schedule_text(self) -> str:
        return format_schedule(self.schedule)

    @property
    def command(self) -> str:
        return f"python -m ratchet.chaos.sim --seed {self.seed} --schedule '{self.schedule_text}'"

    def render(self) -> str:
        """One readable block (what a failing test or the command line prints)."""
        return "\n".join(
            [
                f"simulation failed: {self.invariant}",
                f"  seed:      {self.seed}",
                f"  world:     {self.world}",
                f"  violation: {self.detail}",
                f"  schedule:  {self.schedule_text or '(none: the default run fails)'}",
                f"             ({len(self.schedule)} of {self.original_entries} decisions "
                f"kept after {self.replays} replays)",
                f"  replay:    {self.command}",
            ]
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "invariant": self.invariant,
            "detail": self.detail,
            "world": self.world,
            "schedule": self.schedule_text,
            "original_entries": self.original_entries,
            "replays": self.replays,
            "command": self.command,
        }


@dataclass
class Exploration:
    """What :func:`explore` did."""

    schedules: int
    seconds: float
    points: int
    jobs: int
    failure: Failure | None = None
    outcomes: dict[str, int] = field(default_factory=dict)

    @property
    def per_second(self) -> float:
        return self.schedules / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "schedules": self.schedules,
            "seconds": round(self.seconds, 3),
            "schedules_per_second": round(self.per_second, 1),
            "points_per_schedule": round(self.points / max(self.schedules, 1), 1),
            "jobs_per_schedule": round(self.jobs / max(self.schedules, 1), 2),
            "outcomes": self.outcomes,
            "failure": self.failure.as_dict() if self.failure is not None else None,
        }


def replay(seed: int, schedule: str | list[Entry], *, runner: Runner | None = None) -> SimResult:
    """Replay ``schedule`` (text or entries) in the world of ``seed``.

    Raises ContractError for a malformed schedule text.
    """
    entries = parse_schedule(schedule) if isinstance(schedule, str) else list(schedule)
    if runner is not None:
        return runner.run(seed, entries)
    with Runner() as own:
        return own.run(seed, entries)


def minimise(result: SimResult, runner: Runner, *, budget: int = MAX_REPLAYS) -> Failure:
    """Shrink a failing result's schedule to a small subsequence failing the same way."""
    if result.violation is None:
        raise ValueError("minimise needs a failing result")
    target = result.violation.invariant
    replays = 0
    best = result

    def fails(candidate: list[Entry]) -> SimResult | None:
        nonlocal replays
        replays += 1
        got = runner.run(result.seed, candidate)
        return got if got.violation is not None and got.violation.invariant == target else None

    entries = list(result.schedule)
    empty = fails([])
    if empty is not None:
        entries, best = [], empty
    chunks = 2
    while len(entries) >= 2 and replays < budget:
        size = -(-len(entries) // chunks)
        parts = [entries[i : i + size] for i in range(0, len(entries), size)]
        reduced = False
        for i, part in enumerate(parts):
            for candidate in (part, [e for j, p in enumerate(parts) if j != i for e in p]):
                if not candidate or len(candidate) == len(entries) or replays >= budget:
                    continue
                got = fails(candidate)
                if got is not None:
                    entries, best, reduced = candidate, got, True
                    chunks = max(chunks - 1, 2) if candidate is not part else 2
                    break
            if reduced:
                break
        if not reduced:
            if chunks >= len(entries):
                break
            chunks = min(len(entries), chunks * 2)
    # One pass dropping single entries (ddmin ends 1-minimal; this catches what the
    # budget cut short).
    index = 0
    while index < len(entries) and len(entries) > 1 and replays < budget:
        candidate = entries[:index] + entries[index + 1 :]
        got = fails(candidate)
        if got is not None:
            entries, best = candidate, got
        else:
            index += 1
    # The decisions the final replay actually took (entries that no longer fit a point
    # are not among them).
    final = best.schedule if best.violation is not None else entries
    violation = best.violation or result.violation
    return Failure(
        seed=result.seed,
        invariant=violation.invariant,
        detail=violation.detail,
        world=str(result.profile),
        schedule=list(final),
        original_entries=len(result.schedule),
        replays=replays,
    )


def _chunk(start: int, stop: int, step: int, stop_at_first: bool) -> dict[str, Any]:
    """Run seeds ``range(start, stop, step)`` (one process's share)."""
    points = jobs = count = 0
    outcomes: Counter[str] = Counter()
    failed: int | None = None
    with Runner() as runner:
        for seed in range(start, stop, step):
            result = runner.run(seed)
            count += 1
            points += result.points
            jobs += result.jobs
            outcomes.update(result.outcomes)
            if result.failed:
                failed = seed if failed is None else failed
                if stop_at_first:
                    break
    return {
        "count": count,
        "points": points,
        "jobs": jobs,
        "outcomes": dict(outcomes),
        "failed": failed,
    }


def explore(
    count: int,
    *,
    start: int = 0,
    processes: int = 1,
    stop_at_first: bool = True,
    minimise_failure: bool = True,
) -> Exploration:
    """Run the schedules of seeds ``start .. start + count - 1``; the first failure (by
    seed) is minimised and returned in the result."""
    began = time.perf_counter()
    stop = start + count
    if processes <= 1:
        shares = [_chunk(start, stop, 1, stop_at_first)]
    else:
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=processes, mp_context=context) as pool:
            futures = [
                pool.submit(_chunk, start + i, stop, processes, stop_at_first)
                for i in range(processes)
            ]
            shares = [f.result() for f in futures]
    seconds = time.perf_counter() - began
    outcomes: Counter[str] = Counter()
    for share in shares:
        outcomes.update(share["outcomes"])
    failed = [s["failed"] for s in shares if s["failed"] is not None]
    exploration = Exploration(
        schedules=sum(s["count"] for s in shares),
        seconds=seconds,
        points=sum(s["points"] for s in shares),
        jobs=sum(s["jobs"] for s in shares),
        outcomes=dict(sorted(outcomes.items())),
    )
    if failed:
        seed = min(failed)
        with Runner() as runner:
            result = runner.run(seed)
            if minimise_failure:
                exploration.failure = minimise(result, runner)
            elif result.violation is not None:
                exploration.failure = Failure(
                    seed,
                    result.violation.invariant,
                    result.violation.detail,
                    str(result.profile),
                    result.schedule,
                    len(result.schedule),
                    0,
                )
    return exploration
