"""Simulator throughput: schedules per second of ``ratchet.chaos.sim`` on the unbroken build.

Runs ``--schedules`` consecutive seeds (from ``--seed``) in ``--processes`` spawned
processes, as the CI test does (10,000 seeds on 2 processes), and reports schedules per
second (wall clock, all processes together), the CPU time per schedule, and what a
schedule holds on average: decision points, jobs (worker incarnations started), crashes
and the job outcomes. A failure (there should be none) is printed with its seed and
minimised schedule and makes the script exit 1.

The machine's load matters a great deal (the schedules are CPU bound, two processes for
two cores): ``load_average`` is reported with the figures.

    python benchmarks/sim_schedules.py [--schedules 2000] [--processes 2] [--quick] [--json]
"""

from __future__ import annotations

import os
import platform
import sys
import time
from typing import Any

from harness import emit, parse_args, parser, print_measures


def measure(schedules: int, processes: int, seed: int) -> dict[str, Any]:
    from ratchet.chaos.sim import explore

    cpu = os.times()
    exploration = explore(schedules, start=seed, processes=processes)
    after = os.times()
    # The spawned processes' CPU time is counted in the children's fields.
    cpu_s = (after.children_user - cpu.children_user) + (
        after.children_system - cpu.children_system
    )
    if processes <= 1:
        cpu_s = (after.user - cpu.user) + (after.system - cpu.system)
    done = max(exploration.schedules, 1)
    return {
        "schedules": exploration.schedules,
        "processes": processes,
        "seconds": round(exploration.seconds, 2),
        "schedules_per_second": round(exploration.per_second, 1),
        "cpu_ms_per_schedule": round(cpu_s * 1000 / done, 2),
        "points_per_schedule": round(exploration.points / done, 1),
        "jobs_per_schedule": round(exploration.jobs / done, 2),
        "outcomes": exploration.outcomes,
        "failure": exploration.failure.as_dict() if exploration.failure is not None else None,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }


def main(argv: list[str] | None = None) -> int:
    cli = parser(__doc__)
    cli.add_argument("--schedules", type=int, default=2000)
    cli.add_argument("--processes", type=int, default=2)
    cli.add_argument("--seed", type=int, default=0)
    args = parse_args(cli, argv, quick="200 schedules on one process (a smoke run)")
    schedules, processes = (200, 1) if args.quick else (args.schedules, args.processes)
    began = time.perf_counter()
    report = measure(schedules, processes, args.seed)
    report["wall_s"] = round(time.perf_counter() - began, 2)
    emit(report, as_json=args.json, table=lambda r: print_measures(r, "simulator schedules"))
    return 1 if report["failure"] is not None else 0


if __name__ == "__main__":
    sys.exit(main())
