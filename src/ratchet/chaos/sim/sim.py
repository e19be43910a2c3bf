"""One simulated schedule: the world, its clocks, the workers' hand-off and the scheduler.

Determinism. Each simulated worker process runs its job on a thread of its own (the job
calls the engine, which drives its effects synchronously), but exactly one thread runs at
a time: a strict hand-off passes one baton between the scheduler (the caller's thread) and
the workers. A worker hands the baton back only at a decision point, so the order of every
effect, store call and fault is fixed by the decisions alone. Decisions a worker can make
on its own (run on, crash, lose a reply, let time pass) are made in its thread without a
hand-off; only "someone else runs now" costs one. Time is a number: the store's clock is
``BASE_MS + t``, each worker's wall clock adds its skew, each worker's monotonic clock is
``t`` plus an offset; ``t`` moves only when a decision moves it (and by 1 ms per effect).
While time moves, every worker that holds a lease and is not paused renews it when its
heartbeat is due (a paused worker does not: that is what makes it a zombie).

The scheduler, between jobs: resume a worker that handed over (and is not paused); else,
while the lease is live (its holder paused, or ended without a release), let time pass to
its expiry or to the end of a pause; else start a job on an idle worker, round robin.
Exploration may instead start a job on any idle worker (a duplicate enqueue) or resume
any runnable one. After ``Profile.fault_points`` points no fault is drawn any more (the
settle phase): the run must then complete.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ratchet.leasing import RedisStore
from ratchet.runtime import KeyRing, Phase, RunEngine
from ratchet.worker.executor import Executor

from .invariants import Judge, Violation
from .keyspace import Keyspace, SimRedis
from .schedule import Decider, Entry, Kind, Profile
from .worker import Crash, Halt, SimWorker, run_job
from .world import INTENTS, SimAdapter, SimEnvironment, scenario

__all__ = ["BASE_MS", "RUN_ID", "Runner", "SimResult"]

BASE_MS = 1_700_000_000_000
RUN_ID = "sim-run"
MAX_POINTS = 6000
MAX_JOBS = 120

# Relative weights of what a fault is, per kind of point.
_MENU: dict[Kind, tuple[tuple[str, int], ...]] = {
    Kind.PRE: (("c", 1), ("p", 3), ("a", 2), ("y", 3)),
    Kind.GUARD: (("c", 1), ("p", 3)),
    Kind.WINDOW: (("c", 1),),
    Kind.POST: (("c", 1), ("l", 1)),
    Kind.NET: (("c", 1), ("p", 1), ("a", 2), ("l", 3), ("d", 2)),
    Kind.BEAT: (("l", 1), ("d", 1)),
}
_RATE = {Kind.WINDOW: 1.5, Kind.GUARD: 2.0, Kind.BEAT: 0.5}


@dataclass
class SimResult:
    """What one schedule did, and the first violation (None: it passed)."""

    seed: int
    profile: Profile
    schedule: list[Entry]
    violation: Violation | None
    points: int
    jobs: int
    crashes: int
    outcomes: dict[str, int] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.violation is not None


class _Slot:
    """A worker thread, reused across schedules; it runs only while it holds the baton."""

    def __init__(self, index: int, main: threading.Lock) -> None:
        self.wake = threading.Lock()
        self.wake.acquire()
        self.main = main
        self.task: Callable[[], None] | None = None
        self.closing = False
        self.thread = threading.Thread(target=self._loop, name=f"sim-worker-{index}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            self.wake.acquire()
            if self.closing:
                self.main.release()
                return
            task, self.task = self.task, None
            if task is not None:
                task()  # catches everything itself (see Simulation._job)
            self.main.release()


class Runner:
    """Runs schedules one after another on one keyspace and one set of worker threads.
    Use as a context manager (the threads end on exit)."""

    def __init__(self, *, max_workers: int = 3) -> None:
        self.keyring = KeyRing.from_secrets({"sim": b"\x00" * 32}, signing_kid="sim")
        self.scenario = scenario()
        self._clock = [0]
        self.space = Keyspace(lambda: self._clock[0])
        self.main = threading.Lock()
        self.main.acquire()
        self.slots = [_Slot(i, self.main) for i in range(max_workers)]

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for slot in self.slots:
            slot.closing = True
            slot.wake.release()
            self.main.acquire()
            slot.thread.join(timeout=5)
        self.slots = []

    def run(self, seed: int, schedule: list[Entry] | None = None) -> SimResult:
        """Run the schedule of ``seed`` (exploring), or replay ``schedule`` exactly."""
        return Simulation(self, seed, schedule).run()


class Simulation:
    """One schedule (see the module docstring)."""

    def __init__(self, runner: Runner, seed: int, schedule: list[Entry] | None) -> None:
        self.runner = runner
        self.seed = seed
        self.profile = Profile.from_seed(seed)
        self.decider = Decider(seed, self.profile, schedule)
        self.run_id = RUN_ID
        self.keyring = runner.keyring
        self.scenario = runner.scenario
        self.t = 0
        self.seq = 0
        self.space: Keyspace = runner.space
        self.space.data.clear()
        self.space.clock_ms = self.store_ms
        self.judge = Judge(self.space, RUN_ID, self.keyring, self.store_ms, lambda: self.seq)
        self.space.audit = self.judge
        self.env = SimEnvironment(lambda: self.store_ms() // 1000, self._witness)
        self.env.seq = lambda: self.seq
        p = self.profile
        self.workers = [SimWorker(self, i, p.skews_ms[i], p.coalesce[i]) for i in range(p.workers)]
        self.suspended: set[int] = set()
        self.current: SimWorker | None = None
        self.halting = False
        self._stores: dict[tuple[int, int], RedisStore] = {}
        self._beat = False
        self._round_robin = 0
        self.outcomes: dict[str, int] = {}
        self.crashes = 0

    # -- clocks and stores --------------------------------------------------------------------

    def store_ms(self) -> int:
        return BASE_MS + self.t

    def store_for(self, worker: SimWorker) -> RedisStore:
        key = (worker.index, worker.incarnation)
        store = self._stores.get(key)
        if store is None:
            client = SimRedis(
                self.space, net=lambda what: self._net(worker, what), name=worker.owner
            )
            client.host_clock_ms = worker.wall_ms
            store = self._stores[key] = RedisStore(
                client, history_limit=100_000, compress_checkpoints=False
            )
        return store

    def advance(self, ms: int) -> None:
        """Let ``ms`` of time pass; heartbeats that fall due meanwhile renew."""
        end = self.t + max(ms, 0)
        while True:
            due_worker, due = None, end + 1
            for worker in self.workers:
                guard = worker.guard
                if guard is None or guard.stopped or guard.lost is not None:
                    continue
                at = max(guard.next_renewal_ms - (worker.mono_ms() - self.t), worker.paused_until)
                if at < due:
                    due_worker, due = worker, at
            if due_worker is None or due > end:
                break
            self.t = max(self.t, due)
            guard = due_worker.guard
            if guard is not None:
                self._beat = True
                try:
                    guard.renew()
                finally:
                    self._beat = False
        self.t = end

    # -- decision points ---------------------------------------------------------------------

    def _draw(self, kind: Kind, lossy: bool) -> str:
        decider, ttl = self.decider, self.profile.ttl_ms
        rate = self.profile.fault_rate * _RATE.get(kind, 1.0)
        if self.seq > self.profile.fault_points or not decider.chance(rate):
            return ""
        menu = [(c, w) for c, w in _MENU[kind] if c != "l" or lossy or kind is not Kind.POST]
        letter = decider.pick([c for c, w in menu for _ in range(w)], "")
        if letter == "p":
            pauses = [ttl // 2, ttl, 2 * ttl, 3 * ttl, decider.randint(1, 3 * ttl)]
            return f"p{decider.pick(pauses, ttl)}"
        if letter == "a":
            # Often exactly at the live lease's expiry (or a millisecond either side).
            left = self.judge.lease.expires_ms - self.store_ms()
            options = [left - 1, left, left + 1] if left > 1 else []
            return f"a{decider.pick([*options, decider.randint(1, ttl)], 1)}"
        return letter

    def point(self, worker: SimWorker, kind: Kind, what: str, *, lossy: bool = False) -> str:
        """A decision point in ``worker``'s thread. Returns the code (``l``/``d`` for the
        caller to act on); raises Crash or Halt; may hand over or let time pass."""
        if self.halting or (self.judge.failed and kind is not Kind.BEAT):
            raise Halt
        self.seq += 1
        if self.seq > MAX_POINTS and kind is not Kind.BEAT:
            self.judge.fail("run_finishes", f"no end after {MAX_POINTS} decision points")
            raise Halt
        if kind is Kind.PRE:
            self.advance(1)
        draw = self._draw(kind, lossy) if self.decider.exploring else ""
        code = self.decider.decide(self.seq, kind, draw)
        if not code:
            return code
        letter = code[0]
        if letter == "c":
            raise Crash(f"{worker.owner} at point {self.seq} ({kind.value} {what})")
        if letter == "p":
            worker.paused_until = self.t + int(code[1:])
            self._hand_back(worker)
        elif letter == "a":
            self.advance(int(code[1:]))
        elif letter == "y":
            self._hand_back(worker)
        elif letter == "l" and kind is Kind.POST and not lossy:
            return ""
        return code

    def _net(self, worker: SimWorker, what: str) -> str:
        kind = Kind.BEAT if self._beat else Kind.NET
        code = self.point(worker, kind, what)
        return {"l": "lose", "d": "drop"}.get(code, "ok")

    def _hand_back(self, worker: SimWorker) -> None:
        """In ``worker``'s thread: give the baton to the scheduler; return when resumed."""
        self.suspended.add(worker.index)
        self.runner.main.release()
        self.runner.slots[worker.index].wake.acquire()
        if self.halting:
            raise Halt

    def _witness(self, part: Any, effect: Any, before: Any, action: Any) -> None:
        worker = self.current
        if worker is None:
            return
        live = self.judge.lease.live_for(worker.owner, effect.fence[0], self.store_ms())
        cleared = worker.clearance == (worker.effect_id, True)
        engine = worker.engine
        self.judge.write(
            part,
            effect,
            before,
            action,
            live=live,
            cleared=cleared,
            writer_blob=engine.checkpoint if engine is not None else None,
        )

    # -- the scheduler -----------------------------------------------------------------------

    def _job(self, worker: SimWorker) -> None:
        try:
            outcome = run_job(worker)
        except Crash:
            outcome = "crashed"
            self.crashes += 1
            worker.incarnation += 1
        except Halt:
            outcome = "halted"
        except BaseException as exc:  # a bug of the simulation itself: report it, not hang
            self.judge.fail("no_unexpected_error", f"{type(exc).__name__}: {str(exc)[:200]}")
            outcome = "error"
        self.suspended.discard(worker.index)
        worker.paused_until = -1
        worker.last_outcome = outcome
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def _run(self, worker: SimWorker) -> None:
        """Give ``worker`` the baton (resume it, or start a job) until it hands it back."""
        slot = self.runner.slots[worker.index]
        if worker.index in self.suspended:
            self.suspended.discard(worker.index)
        else:
            slot.task = lambda: self._job(worker)
        self.current = worker
        slot.wake.release()
        self.runner.main.acquire()
        self.current = None

    def _next(self) -> str | None:
        """The scheduler's decision (None: nothing is left to run)."""
        now = self.t
        runnable = [w for w in self.workers if w.index in self.suspended and w.paused_until <= now]
        paused = [w.paused_until - now for w in self.workers if w.index in self.suspended]
        paused = [d for d in paused if d > 0]
        idle = [w for w in self.workers if w.index not in self.suspended]
        ended = self.judge.terminal_at is not None
        lease = self.judge.lease
        live = lease.expires_ms - self.store_ms() if lease.owner else 0
        held = [w for w in idle if w.last_outcome == "held_elsewhere"]
        if runnable:
            default = f"w{runnable[0].index}"
        elif held and len(held) == len(idle) and not ended:
            # Every idle worker was just told the lease is held (by its own clock's
            # judgement, or a live holder): time passes before a job is tried again, as
            # the reaper's next look would be.
            for worker in held:
                worker.last_outcome = ""
            default = f"t{max(self.profile.ttl_ms // 4, 1)}"
        elif ended or live > 0 or not idle:
            waits = [*paused, *([live] if live > 0 and not ended else [])]
            if not waits:
                return None
            default = f"t{min(waits)}"
        else:
            self._round_robin += 1
            default = f"w{idle[self._round_robin % len(idle)].index}"
        self.seq += 1
        draw = default
        if self.decider.exploring and self.seq <= self.profile.fault_points and not ended:
            if self.decider.chance(0.3):
                draw = self.decider.pick([f"w{w.index}" for w in runnable + idle], default)
            elif self.decider.chance(0.05):
                draw = f"t{self.decider.randint(1, 2 * self.profile.ttl_ms)}"
        code = self.decider.decide(self.seq, Kind.NEXT, draw, default)
        if code[0] == "w":
            index = int(code[1:])
            ok = index < len(self.workers) and (
                index not in self.suspended or self.workers[index].paused_until <= now
            )
            if not ok or (ended and index not in self.suspended):
                code = default
        return code

    def _create(self) -> None:
        creator = RedisStore(
            SimRedis(self.space), history_limit=100_000, compress_checkpoints=False
        )
        clock = _Clock(self)
        RunEngine.start(
            RUN_ID,
            scenario=self.scenario,
            keyring=self.keyring,
            executor=Executor(SimAdapter(self.env, "submitter"), creator.creator(b"{}")),
            clock=clock,
            archive_trace=True,  # as a fleet's runs are (RATCHET_ARCHIVE_TRACE)
        )

    def run(self) -> SimResult:
        self._create()
        try:
            while not self.judge.failed:
                if self.judge.terminal_at is not None and not self.suspended:
                    break
                if sum(w.jobs for w in self.workers) > MAX_JOBS or self.seq > MAX_POINTS:
                    self.judge.fail("run_finishes", "no end within the job budget")
                    break
                code = self._next()
                if code is None:
                    break
                if code[0] == "w":
                    self._run(self.workers[int(code[1:])])
                else:
                    self.advance(int(code[1:]))
        finally:
            self.halting = True
            for worker in self.workers:
                if worker.index in self.suspended:
                    self._run(worker)
        if not self.judge.failed:
            self._final()
        violation = self.judge.violations[0] if self.judge.violations else None
        return SimResult(
            self.seed,
            self.profile,
            list(self.decider.taken),
            violation,
            self.seq,
            sum(w.jobs for w in self.workers),
            self.crashes,
            dict(sorted(self.outcomes.items())),
        )

    def _final(self) -> None:
        state = self.judge.stored_state()
        if state is None or state.phase is not Phase.COMPLETED:
            phase = state.phase.value if state is not None else "none"
            self.judge.fail("run_finishes", f"the run ended in phase {phase}")
            return
        keys = [e.key for e in self.env.effects]
        if len(keys) != INTENTS or len(set(keys)) != INTENTS:
            self.judge.fail("one_effect_per_intent", f"effects {keys}, expected {INTENTS}")
            return
        executed = sorted(e.idempotency_key for e in state.executed)
        if executed != sorted(keys):
            self.judge.fail("run_finishes", f"receipts {executed} differ from effects {keys}")


class _Clock:
    """The submitter's clock: the store's (seconds)."""

    def __init__(self, sim: Simulation) -> None:
        self._sim = sim

    def now(self) -> int:
        return self._sim.store_ms() // 1000
