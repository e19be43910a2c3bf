"""The seeded fault schedule of a drill.

Two kinds of fault:

* **worker faults**: each worker process the drill starts gets one ``RATCHET_FAILPOINTS``
  spec from :meth:`Schedule.next_spec` (SIGKILL, SIGSTOP, drop-reply, delay or raise at a
  named failpoint, on its N-th hit; :mod:`ratchet.chaos.drill.processfaults` follows
  them). A worker that dies is replaced by one with the next spec. The first specs cover
  every (point, action) pair the requested faults need, each ``repeats`` times, so a
  short drill fires every failpoint at least twice; the rest are drawn at random;
* **cluster faults**, at fixed fractions of the runs settled: Redis ``kill -9`` and
  restart on the same folder, a rollback of Redis to an earlier point of its AOF
  (:mod:`ratchet.chaos.drill.restartfaults`), duplicate enqueues of runs that already
  ended, and operator cancels (``ratchet cancel``) of runs still in flight
  (:mod:`ratchet.chaos.drill.operatorfaults`);
* **store faults** (:mod:`ratchet.chaos.drill.storefaults`), also at fractions of the runs
  settled: Redis paused past the lease TTL, slowed (``DEBUG SLEEP``), out of memory
  (``maxmemory``), its AOF's disk full, corrupted records of a few runs, two workers with
  one configured name (:mod:`ratchet.chaos.drill.processfaults` starts them), and, once
  every run settled, Redis restarted on an empty folder (``store-wipe``, always last: it
  ends the old runs' store; :mod:`ratchet.chaos.drill.restartfaults`).

The same seed gives the same schedule (the order in which processes reach their points
still depends on timing; the report says what actually fired).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ratchet.errors import ConfigurationError

__all__ = ["FAULTS", "STORE_FAULTS_AT", "Schedule", "parse_faults"]

#: Every fault kind ``--faults`` accepts (``all`` means every one).
FAULTS = (
    "kill",
    "pause",
    "drop-reply",
    "delay",
    "raise",
    "redis-kill",
    "duplicate-enqueue",
    "rollback",
    "cancel",
    "redis-pause",
    "redis-slow",
    "disk-full",
    "maxmemory",
    "store-wipe",
    "corrupt-record",
    "owner-collision",
    "partition-store",
    "partition-adapter",
    "orders-kill",
    "partition-reply",
    "approvals",
    "clock-skew",
    "sqlite-busy",
    "workspace-full",
    "reviews",
)

#: Store faults injected at a fraction of the runs settled, in this order. Corruption
#: comes first (before any rollback cut, so the rollback never undoes it) and while runs
#: are still waiting to start; the others are spaced between the Redis kills, after the
#: rollback (at 45 %): a rollback after a pause or a slowed store could cut away the
#: evidence their invariants judge (the runs in flight then are the runs it rewinds).
STORE_FAULTS_AT = (
    ("corrupt-record", 0.1),
    ("redis-pause", 0.47),
    ("redis-slow", 0.5),
    ("maxmemory", 0.54),
    ("disk-full", 0.7),
)

_Maker = Callable[[random.Random], str]  # draws one worker's failpoint spec
_WINDOWS = (
    "before_proposal",
    "after_pending_before_adapter",
    "after_adapter_before_receipt",
    "after_receipt_before_state",
)


def parse_faults(text: str) -> frozenset[str]:
    """``all`` or a comma list of :data:`FAULTS`. Raises ConfigurationError."""
    names = {part.strip() for part in text.split(",") if part.strip()}
    if not names:
        raise ConfigurationError("--faults needs at least one fault", field="faults")
    if "all" in names:
        return frozenset(FAULTS)
    unknown = sorted(names - set(FAULTS))
    if unknown:
        raise ConfigurationError(
            f"unknown faults {unknown}; known: {', '.join(FAULTS)}", field="faults"
        )
    return frozenset(names)


@dataclass
class Schedule:
    """Worker specs in the order they are handed out, and the cluster fault plan."""

    seed: int
    faults: frozenset[str]
    runs: int
    repeats: int = 3
    specs: list[str] = field(default_factory=list)
    redis_kills_at: list[float] = field(default_factory=list)
    rollback_at: float | None = None
    duplicate_enqueues: int = 0
    cancels_at: list[float] = field(default_factory=list)
    store_faults_at: list[tuple[str, float]] = field(default_factory=list)
    owner_collision_at: float | None = None
    store_wipe: bool = False
    _next: int = 0
    _returns: dict[str, int] = field(default_factory=dict)
    _rng: random.Random = field(default_factory=random.Random, repr=False)
    _topups: int = 0
    _calls: int = 0

    #: Hits every covered failpoint should reach (the short profile's test checks it).
    WANT_HITS = 2

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)  # noqa: S311 - a reproducible schedule, not a secret
        self._rng = rng
        coverage = [make for _, make in self._targets()]
        specs: list[str] = []
        repeats = max(self.repeats, self.runs // max(4 * len(coverage), 1))
        for _ in range(repeats):
            block = [make(rng) for make in coverage]
            rng.shuffle(block)
            specs += block
        extras = self._extras()
        for _ in range(max(0, self.runs // 2 - len(specs))):
            if extras:
                specs.append(rng.choice(extras)(rng))
        self.specs = specs
        if "redis-kill" in self.faults:
            self.redis_kills_at = [0.25, 0.6] if self.runs < 100 else [0.15, 0.35, 0.55, 0.8]
        if "rollback" in self.faults:
            self.rollback_at = 0.45
        if "duplicate-enqueue" in self.faults:
            self.duplicate_enqueues = max(3, self.runs // 8)
        if "cancel" in self.faults:
            self.cancels_at = [0.2, 0.5] if self.runs < 100 else [0.1, 0.25, 0.4, 0.55, 0.7]
        self.store_faults_at = [(k, at) for k, at in STORE_FAULTS_AT if k in self.faults]
        if "owner-collision" in self.faults:
            self.owner_collision_at = 0.3
        self.store_wipe = "store-wipe" in self.faults

    def __repr__(self) -> str:
        return f"Schedule(seed={self.seed}, specs={len(self.specs)}, faults={sorted(self.faults)})"

    def _targets(self) -> list[tuple[str, _Maker]]:
        """The coverage specs, each with the failpoint it is there to reach."""
        makers: list[tuple[str, _Maker]] = []
        want = self.faults
        if "kill" in want:
            for window in _WINDOWS[:3]:
                makers.append((window, _one(window, "kill", 1, 2)))
            # The receipt is committed alone only when the observation after the write
            # fails: make it fail, then die in the window that opens.
            makers.append(
                (
                    "after_receipt_before_state",
                    # The first write's observation: a later one may never come (the
                    # job's run ends, another fault takes the worker first).
                    lambda r: "observe_after_write=raise@1;after_receipt_before_state=kill@1",
                )
            )
            makers.append(
                ("after_commit_before_reply", _one("after_commit_before_reply", "kill", 2, 8))
            )
            makers.append(("during_renewal", _one("during_renewal", "kill", 1, 2)))
            # Inside the workspace's own write (the worker dies with the adapter): between
            # the journal's intent and the file's replace, and between the replace and
            # the receipt. Recovery under the next owner's lock settles either.
            for stage in ("workspace_after_intent", "workspace_after_replace"):
                makers.append((stage, _one(stage, "kill", 1, 2)))
        if "drop-reply" in want:
            # Drop both the reply and its retry's: the engine sees an unknown outcome and
            # fires commit_reply_lost, where the worker then dies (or, without kill, waits).
            then = "kill" if "kill" in want else "delay:50"
            makers.append(
                (
                    "commit_reply_lost",
                    lambda r: (
                        f"after_commit_before_reply=drop-reply@{r.randint(2, 8)};"
                        f"commit_reply_lost={then}@1"
                    ),
                )
            )
            makers.append(("during_renewal", _one("during_renewal", "drop-reply", 1, 2)))
        if "pause" in want:
            # Zombies past the guard: their write / commit must be refused by the fences.
            makers.append(
                ("after_guard_before_adapter", _one("after_guard_before_adapter", "pause", 1, 2))
            )
            # Past the job's first commit, and early enough that a job restarted late in
            # its run (fewer commits left) still reaches it (@5 and @6 often went unfired).
            makers.append(
                ("after_guard_before_commit", _one("after_guard_before_commit", "pause", 2, 4))
            )
        if "delay" in want:
            makers.append(
                (
                    "after_adapter_before_receipt",
                    lambda r: f"after_adapter_before_receipt=delay:{r.randint(50, 300)}@*",
                )
            )
        if "raise" in want:
            makers.append(("", lambda r: f"{r.choice(_WINDOWS[:3])}=raise@{r.randint(1, 2)}"))
        return makers

    def _extras(self) -> list[_Maker]:
        extras = [make for _, make in self._targets()]
        if "pause" in self.faults:
            extras.append(lambda r: f"{r.choice(_WINDOWS[:3])}=pause@{r.randint(1, 3)}")
            extras.append(lambda r: f"during_renewal=pause@{r.randint(1, 2)}")
        return extras

    def put_back(self, spec: str) -> None:
        """A worker left before its spec fired (Redis restarted under it, or it was
        recycled): hand the spec to a later worker, at most three times."""
        self._returns[spec] = self._returns.get(spec, 0) + 1
        if spec and self._returns[spec] <= 3 * self.repeats:
            self.specs.insert(self._next, spec)

    def next_spec(self, hits: Mapping[str, int] | None = None, progress: float = 0.0) -> str:
        """The next worker's failpoints ("" once the schedule is used up).

        ``hits`` (failpoint -> hits so far, from the drill's fired log) and ``progress``
        (the fraction of runs settled): from 40 % of the runs on every other worker, from
        60 % on, or once the planned specs are used up, every worker gets a spec aimed at
        a failpoint still short of :data:`WANT_HITS` (at most four per covered failpoint in
        all), so a spec that a
        worker took and never reached (its run ended first, the store refused it) does not
        leave a failpoint uncovered for timing's sake. Drawn from the schedule's own
        seeded generator."""
        self._calls += 1
        planned = self._next < len(self.specs)
        aimed = progress >= 0.6 or (progress >= 0.4 and self._calls % 2 == 0)
        if hits is not None and (not planned or aimed):
            topup = self._topup(hits)
            if topup:
                return topup
        if not planned:
            return ""
        spec = self.specs[self._next]
        self._next += 1
        return spec

    def short(self, hits: Mapping[str, int]) -> int:
        """How many covered failpoints are still short of :data:`WANT_HITS` while aimed
        specs are left to give them (0 once the budget is spent)."""
        targets = [p for p, _ in self._targets() if p]
        if self._topups >= 4 * len(targets):
            return 0
        return sum(1 for p in targets if hits.get(p, 0) < self.WANT_HITS)

    def _topup(self, hits: Mapping[str, int] | None) -> str:
        if hits is None:
            return ""
        targets = [(p, make) for p, make in self._targets() if p]
        short = [make for p, make in targets if hits.get(p, 0) < self.WANT_HITS]
        if not short or self._topups >= 4 * len(targets):
            return ""
        self._topups += 1
        return short[self._topups % len(short)](self._rng)

    @property
    def remaining(self) -> int:
        return len(self.specs) - self._next


def _one(point: str, action: str, low: int, high: int) -> _Maker:
    def make(r: random.Random) -> str:
        return f"{point}={action}@{r.randint(low, high)}"

    return make
