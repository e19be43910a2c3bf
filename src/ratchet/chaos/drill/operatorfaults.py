"""What happens to a drill's runs from outside the fleet: ``duplicate-enqueue`` and
``cancel``.

* **duplicate-enqueue**: a run that already ended is handed to the queue twice more (an
  operator submitting it again, a queue delivering twice). A job of an ended run must
  change nothing: the checker compares the run's generation at the end with the one
  recorded here;
* **cancel**, at fixed fractions of the runs settled: an operator cancels a run still in
  flight as ``ratchet cancel`` does (a sealed request in the run's inbox); a worker ends
  the run at its next safe point, and the run's signed ``cancelled`` event must name
  the request.

Neither touches Redis beyond what a client does, so neither takes the Redis lane.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ratchet.errors import RatchetError
from ratchet.ops import cancel, inspect_run

if TYPE_CHECKING:
    from ratchet.chaos.drill.runner import _Drill

__all__ = ["cancel_one", "enqueue_again"]


def enqueue_again(drill: _Drill) -> None:
    """Now and then (one tick in twenty), while the schedule wants more, enqueue a run
    that ended, and has not been enqueued again yet, twice more."""
    if (
        len(drill.rec.duplicate_enqueues) < drill.schedule.duplicate_enqueues
        and drill.rng.random() < 0.05
    ):
        done = sorted(
            r
            for r, (s, _) in drill.settled.items()
            if s == "terminal" and r not in {d["run_id"] for d in drill.rec.duplicate_enqueues}
        )
        if done:
            _duplicate(drill, drill.rng.choice(done))


def _duplicate(drill: _Drill, run_id: str) -> None:
    try:
        view = inspect_run(drill.fleet, run_id)
        drill.fleet.enqueue(run_id)
        drill.fleet.enqueue(run_id)
    except RatchetError:
        return
    drill.rec.duplicate_enqueues.append(
        {
            "run_id": run_id,
            "at": time.time(),
            "generation": view.generation,
            "phase": view.state.phase.value,
        }
    )


def cancel_one(drill: _Drill, fraction: float) -> None:
    """An operator cancels a run still in flight, as ``ratchet cancel`` does: the
    request goes to the run's inbox and a worker ends the run at its next safe
    point. A run that cannot be cancelled right now (it just ended, or is under
    review) is passed over; the next tick tries another."""
    if not drill.schedule.cancels_at or fraction < drill.schedule.cancels_at[0]:
        return
    asked = {c["run_id"] for c in drill.rec.cancels} | set(drill.rec.corrupted)
    candidates = sorted(r for r in drill.rec.runs if r not in drill.settled and r not in asked)
    if not candidates:
        return
    run_id = drill.rng.choice(candidates)
    try:
        posted = cancel(
            drill.fleet, run_id, reason="drill: an operator ends the run", operator="drill"
        )
    except RatchetError:
        return
    drill.schedule.cancels_at.pop(0)
    drill.rec.cancels.append(
        {
            "run_id": run_id,
            "at": time.time(),
            "request_id": posted.request.request_id,
            "phase": posted.phase,
            "held_by": posted.held_by,
        }
    )
