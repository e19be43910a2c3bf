"""Schedules: what the simulation decides at each of its decision points, as data.

Every place where the world can go one way or another is a numbered decision point: before
each effect a worker's engine yields (run on, pause, hand over to another worker, let time
pass, crash), right after the lease guard passed, at each crash window the engine reaches,
right after each effect was performed (crash before the result is used, or lose the
reply), around every store call (drop the request, lose the reply, delay it, crash before
it), at each heartbeat renewal, and between jobs (which worker runs next, or let time
pass). Points are numbered in the order they are reached.

A **schedule** is the list of non-default decisions, ``seq:code``; every point not listed
runs on. The text form is those entries separated by spaces, e.g. ``17:c 53:p600 54:w1
88:l`` (see :data:`CODES`). With the seed (which fixes the world: worker count, lease
TTL, clock skews, batching, steps per job) a schedule replays the exact same execution.
Exploration draws the decisions from ``random.Random(seed)``; replay takes them from the
schedule alone. An entry that does not fit the point it lands on (after minimisation
removed the entries before it) is ignored, so every subsequence of a schedule is a valid
schedule: that is what lets delta debugging shrink one.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TypeVar

from ratchet.errors import ContractError

_T = TypeVar("_T")

__all__ = [
    "CODES",
    "Decider",
    "Entry",
    "Kind",
    "Profile",
    "format_schedule",
    "parse_schedule",
]


class Kind(StrEnum):
    """The kinds of decision point."""

    PRE = "pre"  # before an effect (before the lease guard)
    GUARD = "guard"  # a guarded effect, after its guard passed, before the call
    WINDOW = "window"  # a named crash window (``Reached``)
    POST = "post"  # after an effect was performed, before its result is used
    NET = "net"  # a worker's store call (a script or a plain command)
    BEAT = "beat"  # a heartbeat renewal's store call
    NEXT = "next"  # between jobs: which worker runs next


#: The decision codes, and where each applies.
CODES = {
    "c": "crash the worker here (pre, guard, window, post, net)",
    "p<ms>": "pause the worker for <ms> of simulated time: a zombie (pre, guard, net)",
    "a<ms>": "let <ms> of time pass here (pre, net)",
    "y": "hand over: the worker waits while the scheduler runs another (pre)",
    "l": "lose the reply: the call ran, its reply never arrives (post, net, beat)",
    "d": "drop the request: the call never ran (net, beat)",
    "w<k>": "run worker <k> next: resume it, or start a job on it (next)",
    "t<ms>": "let <ms> of time pass before anything else runs (next)",
}

_ALLOWED: dict[Kind, tuple[str, ...]] = {
    Kind.PRE: ("c", "p", "a", "y"),
    Kind.GUARD: ("c", "p"),
    Kind.WINDOW: ("c",),
    Kind.POST: ("c", "l"),
    Kind.NET: ("c", "p", "a", "l", "d"),
    Kind.BEAT: ("l", "d"),
    Kind.NEXT: ("w", "t"),
}
_ENTRY = re.compile(r"(\d+):([cpaylwdt])(\d*)")
_NUMBERED = frozenset("pawt")


@dataclass(frozen=True, slots=True)
class Entry:
    """One non-default decision: at point ``seq``, ``code`` (``c``, ``p600``, ``w1``...)."""

    seq: int
    code: str

    def __str__(self) -> str:
        return f"{self.seq}:{self.code}"


def parse_schedule(text: str) -> list[Entry]:
    """Parse the text form. Raises ContractError (one line) for anything malformed."""
    entries: list[Entry] = []
    for token in text.split():
        match = _ENTRY.fullmatch(token)
        if match is None:
            raise ContractError(f"schedule entry {token!r} is not seq:code", field="schedule")
        letter, number = match.group(2), match.group(3)
        if (letter in _NUMBERED) != bool(number):
            raise ContractError(
                f"schedule entry {token!r}: {letter!r} takes a number iff it is one of p a w t",
                field="schedule",
            )
        entries.append(Entry(int(match.group(1)), letter + number))
    seqs = [e.seq for e in entries]
    if len(set(seqs)) != len(seqs):
        raise ContractError("schedule names one decision point twice", field="schedule")
    return sorted(entries, key=lambda e: e.seq)


def format_schedule(entries: list[Entry]) -> str:
    return " ".join(str(e) for e in sorted(entries, key=lambda e: e.seq))


@dataclass(frozen=True, slots=True)
class Profile:
    """The world a seed fixes (before any decision)."""

    workers: int
    ttl_ms: int
    skews_ms: tuple[int, ...]  # each worker's wall clock minus the store's
    coalesce: tuple[bool, ...]  # whether each worker batches receipt commits (plans ahead)
    steps_per_job: int
    fault_rate: float  # the chance of a fault at a point, before the settle phase
    fault_points: int  # points after which no more faults are drawn (the settle phase)

    @classmethod
    def from_seed(cls, seed: int) -> Profile:
        rng = random.Random(f"profile/{seed}")  # noqa: S311 - reproducible, not a secret
        workers = rng.choice((2, 3, 3))
        ttl = rng.choice((200, 300, 600))
        return cls(
            workers=workers,
            ttl_ms=ttl,
            skews_ms=tuple(rng.choice((0, 0, rng.randint(-3 * ttl, 3 * ttl))) for _ in range(3)),
            coalesce=tuple(rng.random() < 0.5 for _ in range(3)),
            steps_per_job=rng.choice((2, 3, 100, 100)),
            fault_rate=rng.choice((0.0, 0.01, 0.03, 0.06, 0.1)),
            fault_points=rng.randint(40, 400),
        )

    def __str__(self) -> str:
        return (
            f"workers={self.workers} ttl_ms={self.ttl_ms} "
            f"skews_ms={list(self.skews_ms[: self.workers])} "
            f"coalesce={list(self.coalesce[: self.workers])} steps_per_job={self.steps_per_job} "
            f"fault_rate={self.fault_rate} fault_points={self.fault_points}"
        )


class Decider:
    """Makes (exploring) or looks up (replaying) each decision and keeps the schedule.

    ``schedule`` None: explore, drawing from ``random.Random(seed)``. Otherwise replay:
    exactly the schedule's entries, every other point runs on.
    """

    def __init__(self, seed: int, profile: Profile, schedule: list[Entry] | None = None) -> None:
        self.profile = profile
        rng = random.Random(f"decisions/{seed}")  # noqa: S311 - reproducible, not a secret
        self._rng = rng if schedule is None else None
        self._planned = {e.seq: e.code for e in schedule or ()}
        self.taken: list[Entry] = []

    @property
    def exploring(self) -> bool:
        return self._rng is not None

    def decide(self, seq: int, kind: Kind, draw: str, default: str = "") -> str:
        """The decision at point ``seq`` of ``kind``: ``draw`` is what exploration would
        do here (already drawn by :meth:`draw`), ``default`` what running on means."""
        if self._rng is None:
            code = self._planned.get(seq, default)
            if code != default and code[0] not in _ALLOWED[kind]:
                code = default  # an entry that does not fit this point
        else:
            code = draw
        if code != default:
            self.taken.append(Entry(seq, code))
        return code

    def chance(self, rate: float) -> bool:
        """Exploration only: a biased coin (always False when replaying)."""
        rng = self._rng
        return rng is not None and rng.random() < rate

    def pick(self, options: Sequence[_T], empty: _T) -> _T:
        """Exploration only: one of ``options`` (``empty`` when replaying or none)."""
        rng = self._rng
        if rng is None or not options:
            return empty
        return options[rng.randrange(len(options))]

    def randint(self, low: int, high: int) -> int:
        rng = self._rng
        return low if rng is None else rng.randint(low, high)
