"""A change's per-step cost: this tree's durable steps against a base revision's, in one run.

``durable_steps.py`` measures ratchet against other runtimes; this script measures ratchet
against itself: the working tree (``new``) and a base revision (``old``, checked out with
``git worktree`` into a temporary folder) each run ``durable_steps.py``'s own ``ratchet``
contender (runs of ``--steps-per-run`` external writes through a real ``RunEngine`` on a
real ``redis-server`` with ``appendfsync always``) in a process of its own, importing its
own ``ratchet`` and its own ``durable_steps``. Turns alternate (old, new, new, old, ...)
on one shared Redis, so both see the same machine; each figure is the median of its
turns, and ``ratio`` is new over old (1.0: the same cost; 0.95: the change costs 5 %).

Both write effects are measured: ``ledger`` (the default durable step: an fsync'd append)
and ``workspace`` (a ``WorkspaceAdapter`` file write: the SQLite journal, a temp file, a
rename, the workspace observed before and after).

    python benchmarks/revisions.py --base 03fbb36 --json
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import statistics
import subprocess
import sys
import tempfile
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TOP = HERE.parent
SETUP_TIMEOUT_S = 120.0


def _contender(tree: str, url: str, work: str, steps: int, effect: str, conn: Connection) -> None:
    """A child process: import ``ratchet`` and ``durable_steps`` from ``tree``, then serve
    rounds as ``durable_steps``' own contender process does."""
    sys.path[:0] = [str(Path(tree) / "src"), str(Path(tree) / "benchmarks")]
    sys.modules.pop("harness", None)
    import durable_steps  # from the tree this process measures

    durable_steps._child("ratchet", url, work, steps, effect, conn)


def _ask(conn: Connection, command: str, arg: object, timeout: float) -> Any:
    conn.send((command, arg))
    if not conn.poll(timeout):
        raise RuntimeError(f"no answer to {command} within {timeout:.0f} s")
    status, value = conn.recv()
    if status != "done":
        raise RuntimeError(str(value))
    return value


def measure(
    trees: dict[str, Path], *, effect: str, rounds: int, seconds: float, steps: int
) -> dict[str, Any]:
    """Interleaved turns of each tree's contender on one Redis; rates in steps/s."""
    from harness import temp_redis  # this tree's harness, in the parent

    ctx = mp.get_context("spawn")
    rates: dict[str, list[float]] = {name: [] for name in trees}
    with temp_redis(prefix="ratchet-revisions-") as (server, work):
        conns: dict[str, Connection] = {}
        procs = []
        for name, tree in trees.items():
            parent, child = ctx.Pipe()
            folder = Path(work) / name
            folder.mkdir()
            proc = ctx.Process(
                target=_contender,
                args=(str(tree), server.url, str(folder), steps, effect, child),
                daemon=True,
            )
            proc.start()
            procs.append(proc)
            conns[name] = parent
        try:
            for name, conn in conns.items():
                if not conn.poll(SETUP_TIMEOUT_S):
                    raise RuntimeError(f"{name}: set-up took longer than {SETUP_TIMEOUT_S} s")
                status, value = conn.recv()
                if status != "ready":
                    raise RuntimeError(f"{name}: {value}")
            names = list(trees)
            for r in range(rounds):
                order = names if r % 2 == 0 else names[::-1]
                for name in order:
                    count, elapsed = _ask(conns[name], "round", seconds, seconds + 120)
                    rates[name].append(count / elapsed)
            cpu = {
                name: _ask(conn, "finish", None, 60).get("cpu_us_per_step")
                for name, conn in conns.items()
            }
        finally:
            for proc in procs:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
    medians = {name: statistics.median(values) for name, values in rates.items()}
    return {
        "effect": effect,
        "steps_per_s": {name: round(value, 1) for name, value in medians.items()},
        "cpu_us_per_step": cpu,
        "ratio_new_vs_old": round(medians["new"] / medians["old"], 3),
        "rounds": {name: [round(v, 1) for v in values] for name, values in rates.items()},
    }


@contextlib.contextmanager
def worktree(base: str) -> Any:
    with tempfile.TemporaryDirectory(prefix="ratchet-base-") as folder:
        path = Path(folder) / "tree"
        subprocess.run(
            ["git", "-C", str(TOP), "worktree", "add", "--detach", "-q", str(path), base],
            check=True,
        )
        try:
            yield path
        finally:
            subprocess.run(
                ["git", "-C", str(TOP), "worktree", "remove", "--force", str(path)], check=False
            )


def _print_table(report: dict[str, Any]) -> None:
    print(f"base {report['base']} (old) against the working tree (new)")
    print(f"{'effect':<10} {'old steps/s':>12} {'new steps/s':>12} {'new/old':>8}")
    for row in report["results"]:
        rates = row["steps_per_s"]
        print(
            f"{row['effect']:<10} {rates['old']:>12} {rates['new']:>12} "
            f"{row['ratio_new_vs_old']:>8}"
        )


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(HERE))
    from harness import emit, parse_args, parser

    cli = parser(__doc__)
    cli.add_argument("--base", default="HEAD", help="the revision to compare against")
    cli.add_argument("--rounds", type=int, default=6, help="turns of each tree per effect")
    cli.add_argument("--seconds", type=float, default=2.0, help="duration of one turn")
    cli.add_argument("--steps-per-run", type=int, default=10, help="writes per run")
    args = parse_args(cli, argv, quick="smoke run: 2 turns of 0.5 s per tree and effect")
    if args.quick:
        args.rounds, args.seconds = 2, 0.5
    if not 1 <= args.rounds <= 40 or not 0.2 <= args.seconds <= 30:
        cli.error("--rounds must be 1..40 and --seconds 0.2..30")
    with contextlib.redirect_stdout(sys.stderr), worktree(args.base) as old:
        trees = {"old": old, "new": TOP}
        report = {
            "base": args.base,
            "results": [
                measure(
                    trees,
                    effect=effect,
                    rounds=args.rounds,
                    seconds=args.seconds,
                    steps=args.steps_per_run,
                )
                for effect in ("ledger", "workspace")
            ],
        }
    emit(report, as_json=args.json, table=_print_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
