"""A declared tool's call with its ledger in the store against the file ledger, in one run.

``durable_steps.py``'s ``ratchet_tool`` contender (runs of ``--steps-per-run`` calls of a
user-declared tool, ``@ratchet.tool(idempotent=True)``, whose effect is the benchmark's
fsync'd append, through a real ``RunEngine`` on a real ``redis-server`` with
``appendfsync always``) runs twice, in two processes on one Redis, in alternating turns:

* ``file``: the tool ledger is a file in the environment's folder (host-local: how runs
  submitted before the store ledger keep it);
* ``store``: the tool ledger is the run's own keys in Redis (``ratchet.tools.
  store_ledger``): made with the run, every call checked at the store against the run's
  live lease and generation, its receipt recorded by a script (what submit picks now).

Each figure is the median of its turns; ``ratio_store_vs_file`` is the store ledger's rate
over the file ledger's (1.0: the same cost per call), ``cpu_us_per_call`` each process's
CPU per call over its turns.

    python benchmarks/tool_ledger.py --json
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import statistics
import sys
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SETUP_TIMEOUT_S = 120.0
CONTENDERS = {"file": "ratchet_tool", "store": "ratchet_tool_store"}


def _contender(name: str, url: str, work: str, steps: int, conn: Connection) -> None:
    sys.path.insert(0, str(HERE))
    import durable_steps

    durable_steps._child(name, url, work, steps, "ledger", conn)


def _ask(conn: Connection, command: str, arg: object, timeout: float) -> Any:
    conn.send((command, arg))
    if not conn.poll(timeout):
        raise RuntimeError(f"no answer to {command} within {timeout:.0f} s")
    status, value = conn.recv()
    if status != "done":
        raise RuntimeError(str(value))
    return value


def measure(*, rounds: int, seconds: float, steps: int) -> dict[str, Any]:
    from harness import temp_redis

    ctx = mp.get_context("spawn")
    rates: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    with temp_redis(prefix="ratchet-tool-ledger-") as (server, work):
        conns: dict[str, Connection] = {}
        procs = []
        for label, name in CONTENDERS.items():
            parent, child = ctx.Pipe()
            folder = Path(work) / label
            folder.mkdir()
            proc = ctx.Process(
                target=_contender, args=(name, server.url, str(folder), steps, child), daemon=True
            )
            proc.start()
            procs.append(proc)
            conns[label] = parent
        try:
            for label, conn in conns.items():
                if not conn.poll(SETUP_TIMEOUT_S):
                    raise RuntimeError(f"{label}: set-up took longer than {SETUP_TIMEOUT_S} s")
                status, value = conn.recv()
                if status != "ready":
                    raise RuntimeError(f"{label}: {value}")
            labels = list(CONTENDERS)
            for r in range(rounds):
                for label in labels if r % 2 == 0 else labels[::-1]:
                    count, elapsed = _ask(conns[label], "round", seconds, seconds + 120)
                    rates[label].append(count / elapsed)
            cpu = {
                label: _ask(conn, "finish", None, 60).get("cpu_us_per_step")
                for label, conn in conns.items()
            }
        finally:
            for proc in procs:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
    medians = {label: statistics.median(values) for label, values in rates.items()}
    return {
        "calls_per_s": {label: round(value, 1) for label, value in medians.items()},
        "cpu_us_per_call": cpu,
        "ratio_store_vs_file": round(medians["store"] / medians["file"], 3),
        "rounds": {label: [round(v, 1) for v in values] for label, values in rates.items()},
        "steps_per_run": steps,
    }


def _print_table(report: dict[str, Any]) -> None:
    rates, cpu = report["calls_per_s"], report["cpu_us_per_call"]
    print(f"{'ledger':<8} {'calls/s':>10} {'CPU us/call':>12}")
    for label in CONTENDERS:
        print(f"{label:<8} {rates[label]:>10} {cpu[label]!s:>12}")
    print(f"store / file: {report['ratio_store_vs_file']}")


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(HERE))
    from harness import emit, parse_args, parser

    cli = parser(__doc__)
    cli.add_argument("--rounds", type=int, default=6, help="turns of each ledger")
    cli.add_argument("--seconds", type=float, default=2.0, help="duration of one turn")
    cli.add_argument("--steps-per-run", type=int, default=10, help="tool calls per run")
    args = parse_args(cli, argv, quick="smoke run: 2 turns of 0.5 s per ledger")
    if args.quick:
        args.rounds, args.seconds = 2, 0.5
    if not 1 <= args.rounds <= 40 or not 0.2 <= args.seconds <= 30:
        cli.error("--rounds must be 1..40 and --seconds 0.2..30")
    with contextlib.redirect_stdout(sys.stderr):
        report = measure(rounds=args.rounds, seconds=args.seconds, steps=args.steps_per_run)
    emit(report, as_json=args.json, table=_print_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
