"""A deterministic simulator of the whole protocol: the real runtime, the real commit
protocol and simulated adapters, workers, network, clocks and crashes, all scheduled from
one seed in one process.

What is real: :class:`ratchet.runtime.RunEngine` (every operation: start, resume,
reconcile, propose, flush), the executor with its lease guard and hooks
(:class:`ratchet.worker.executor.Executor`), the store client
(:class:`ratchet.leasing.RedisStore` and :class:`ratchet.leasing.LeasedRun`, with their
argument checks, reply decoding and commit retries), the Lua scripts themselves (run
unchanged in a Lua 5.1 VM over an in-process keyspace, :mod:`.keyspace`, pinned to a real
``redis-server`` by ``tests/chaos/sim/test_parity.py``), the store clock
(:class:`ratchet.fleet.clock.StoreClock`) and the scripted agent. What is simulated: the
adapters (:mod:`.world`: a workspace and an orders service that keep their own truth and
refuse stale fences as the real ones do), the worker processes (:mod:`.worker`: the job's
order, and the heartbeat's rules on a simulated clock), the network (a request dropped, a
reply lost), clocks (the store's, and each worker's with its skew) and crashes.

Why it exists: the process-level drill (:mod:`ratchet.chaos.drill`) kills and pauses real
processes, so it reaches the crash windows its failpoints name, at the rate a real run
allows. The simulator reaches the interleavings the drill cannot: a crash between any two
effects of any worker, a reply lost at any point, a lease expiring at any instant, a
zombie resuming between any two steps of its successor, thousands of schedules a minute,
each reproducible from its seed.

How: every place the world can go one way or another is a numbered decision point
(:mod:`.schedule`); a schedule is the list of non-default decisions; exploration draws
them from the seed, replay takes them from the schedule; exactly one simulated worker runs
at a time (:mod:`.sim`). After every store script, at every write an adapter performs and
at every lease-guard check the invariants are judged (:mod:`.invariants`, the drill's and
a few more); a failure is minimised by delta debugging and reported with its seed and
schedule (:mod:`.explore`)::

    python -m ratchet.chaos.sim --schedules 10000 --processes 2
    python -m ratchet.chaos.sim --seed 59 --schedule '11:c 41:p600 55:p1800'

The simulator needs ``lupa`` (the ``sim`` extra brings it, and so does the test extra).
"""

from __future__ import annotations

from .explore import Exploration, Failure, explore, minimise, replay
from .invariants import INVARIANTS, Violation
from .schedule import Entry, Profile, format_schedule, parse_schedule
from .sim import Runner, SimResult

__all__ = [
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
