"""``python -m ratchet.chaos.sim``: explore schedules, or replay one.

    python -m ratchet.chaos.sim --schedules 10000 [--seed 0] [--processes 2] [--json]
    python -m ratchet.chaos.sim --seed 59 --schedule '11:c 41:p600 55:p1800' [--json]

Exit status 0 when every schedule kept every invariant, 1 on a failure (printed as one
block with its seed and minimised schedule), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys

from ratchet.errors import ContractError

from .explore import explore, replay
from .schedule import format_schedule


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ratchet.chaos.sim", description=__doc__)
    parser.add_argument("--seed", type=int, default=0, help="the (first) seed")
    parser.add_argument("--schedule", help="replay this schedule in the world of --seed")
    parser.add_argument("--schedules", type=int, default=1000, help="how many seeds to explore")
    parser.add_argument("--processes", type=int, default=1, help="worker processes (spawned)")
    parser.add_argument("--keep-going", action="store_true", help="do not stop at a failure")
    parser.add_argument("--json", action="store_true", help="print JSON for machines")
    args = parser.parse_args(argv)
    if args.schedules < 1 or args.processes < 1:
        print("error: --schedules and --processes must be positive", file=sys.stderr)
        return 2
    if args.schedule is not None:
        try:
            result = replay(args.seed, args.schedule)
        except ContractError as exc:
            print(f"error: {exc.message}", file=sys.stderr)
            return 2
        report = {
            "seed": result.seed,
            "world": str(result.profile),
            "schedule": format_schedule(result.schedule),
            "points": result.points,
            "jobs": result.jobs,
            "outcomes": result.outcomes,
            "violation": None
            if result.violation is None
            else {"invariant": result.violation.invariant, "detail": result.violation.detail},
        }
        if args.json:
            print(json.dumps(report, sort_keys=True))
        elif result.violation is None:
            print(f"seed {result.seed}: every invariant held ({result.points} points)")
        else:
            print(
                f"seed {result.seed}: {result.violation.invariant} at point "
                f"{result.violation.seq}: {result.violation.detail}"
            )
        return 0 if result.violation is None else 1
    exploration = explore(
        args.schedules,
        start=args.seed,
        processes=args.processes,
        stop_at_first=not args.keep_going,
    )
    if args.json:
        print(json.dumps(exploration.as_dict(), sort_keys=True))
    else:
        print(
            f"{exploration.schedules} schedules in {exploration.seconds:.1f} s "
            f"({exploration.per_second:.0f} per second, "
            f"{exploration.points / max(exploration.schedules, 1):.0f} decision points each)"
        )
        if exploration.failure is not None:
            print(exploration.failure.render())
    return 0 if exploration.failure is None else 1


if __name__ == "__main__":
    sys.exit(main())
