"""Fleet views at any size: a listing page, the review queue page and a metrics scrape at
1k, 10k and 100k runs, each as a ratio to a bare ``ZRANGE`` of the same page.

One run of this script starts its own ``redis-server`` (no AOF: the views only read) and
fills one database per size (so every size is measured in the same rounds, side by side,
and the machine's noise falls on all of them alike) with runs written directly, with
pipelines: each run's state and lease hashes
and its entries in the runs index and one phase index (a tenth each awaiting approval and
needing review, a fifth running, the rest completed), as the create and commit scripts
leave them. No checkpoint is stored: the views never read one, except the review queue,
which verifies each run it shows (so every run it lists stops at "no checkpoint" here; a
real page adds one HMAC check per shown run, the same cost at every size). Each round
measures every size and every view in turn, ``--samples`` calls each, ``--rounds`` times:

* ``bare``: one ``ZRANGE ... BYSCORE REV LIMIT 0 50`` of the runs index (the page a
  listing shows, read bare);
* ``list_page``: ``RedisStore.list_runs(limit=50)``: the page, its runs' state and lease
  hashes and newest incident (one pipeline), Redis' time;
* ``next_page``: the same, continuing after the first page's cursor;
* ``review_queue``: the console's review queue page: the newest 50 of each waiting phase,
  each run's verified view asked for, the exact counts, the HTML;
* ``metrics_scrape``: the console's ``/metrics`` body (every collector it registers);
* ``reaper_tick``: one tick of a worker's reaper (:func:`ratchet.worker.reaper.reap_once`),
  with every running run's live lease on the expiry index (a fifth of the runs), none of
  them expired: what every worker pays every reaper interval.

Every figure is the median call time of its best round (noise only ever adds time); each
view is reported as ``view / bare`` at each size, and ``growth`` is that ratio at the
largest size over the ratio at the smallest. Goal: growth < 1.5 for every view (exit 1
otherwise). ``--quick`` uses small sizes and few samples: a smoke run that checks
nothing. ``--json`` prints one JSON object.

    python benchmarks/fleet_views.py [--sizes 1000,10000,100000] [--rounds 5]
        [--samples 30] [--quick] [--json]
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import emit, median, parse_args, parser, ratio, redis_server
from pydantic import SecretStr

from ratchet.cli.console import fleet_console_data
from ratchet.console.server import ConsoleServer
from ratchet.fleet.context import Fleet
from ratchet.fleet.settings import Settings
from ratchet.leasing import RUNS_INDEX, RedisStore, run_keys
from ratchet.leasing.keyspace import EXPIRY_INDEX, phase_index
from ratchet.worker.reaper import reap_once

PAGE = 50
LIVE_FOR_MS = 3_600_000  # the running runs' leases expire after the measurement
GOAL = 1.5
KEY_HEX = "ab" * 32  # benchmark only: no run here is ever signed
VIEWS = ("list_page", "next_page", "review_queue", "metrics_scrape", "reaper_tick")


def phase_of(i: int) -> str:
    """A tenth awaiting approval, a tenth needing review, a fifth running, the rest done."""
    slot = i % 10
    return (
        "awaiting_approval"
        if slot == 0
        else "needs_review"
        if slot == 1
        else "running"
        if slot in (2, 3)
        else "completed"
    )


def fill(client: Any, start: int, stop: int, *, base_ms: int) -> None:
    """Runs ``start..stop-1`` written as the scripts leave them (pipelines of 2000)."""
    for chunk in range(start, stop, 2000):
        pipe = client.pipeline(transaction=False)
        for i in range(chunk, min(stop, chunk + 2000)):
            run_id = f"bench-{i:07d}"
            keys = run_keys(run_id)
            at = base_ms + i  # one creation time per run, in creation order
            phase = phase_of(i)
            pipe.hset(
                keys.state,
                mapping={
                    "task_id": f"task-{i % 97}",
                    "env_instance_id": "e",
                    "generation": 3,
                    "state_version": 3,
                    "created_at_ms": at,
                    "updated_at_ms": at + 5,
                    "last_commit_id": f"c-{i}",
                    "phase": phase,
                    "phase_at_ms": at + 5,
                },
            )
            pipe.hset(
                keys.lease, mapping={"owner": "", "lease_version": 1, "expires_at_ms": at + 5}
            )
            pipe.zadd(RUNS_INDEX, {run_id: at})
            pipe.zadd(phase_index(phase), {run_id: at + 5})
            if phase == "running":  # a live lease: on the expiry index, expiring later
                pipe.zadd(EXPIRY_INDEX, {run_id: at + LIVE_FOR_MS})
        pipe.execute()


def median_call_s(fn: Callable[[], object], samples: int) -> float:
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return median(times)


def _never_enqueued(run_id: str) -> None:
    raise RuntimeError(f"the reaper enqueued {run_id}, whose lease is live")


def views(fleet: Fleet, server: ConsoleServer) -> dict[str, Callable[[], object]]:
    """The bare read and each view, on one fleet (one database)."""
    from prometheus_client import generate_latest

    from ratchet.console.data import run_counts, waiting_runs
    from ratchet.console.pages import review_queue_page

    store = fleet.store
    client = store.client
    data = server.data
    cursor = store.list_runs(limit=PAGE).next_cursor

    def review() -> str:
        reviews, approvals, broken = waiting_runs(data, limit=PAGE)
        counts, _ = run_counts(data)
        return review_queue_page(reviews, approvals, broken, now=data.now(), counts=counts)

    ops: dict[str, Callable[[], object]] = {
        "bare": lambda: client.zrange(
            RUNS_INDEX, "+inf", "-inf", desc=True, byscore=True, offset=0, num=PAGE, withscores=True
        ),
        "list_page": lambda: store.list_runs(limit=PAGE),
        "next_page": lambda: store.list_runs(limit=PAGE, after=cursor),
        "review_queue": review,
        "metrics_scrape": lambda: generate_latest(server.registry),
        "reaper_tick": lambda: reap_once(store, _never_enqueued),
    }
    for fn in ops.values():  # warm up: scripts loaded, connections made
        fn()
    return ops


def run(sizes: list[int], *, rounds: int, samples: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ratchet-fleet-views-") as tmp:
        redis = redis_server(
            Path(tmp), aof=False, extra_args=["--databases", str(len(sizes))]
        ).start()
        servers: list[ConsoleServer] = []
        try:
            fill_started = time.perf_counter()
            per_db: list[dict[str, Callable[[], object]]] = []
            for db, size in enumerate(sizes):
                url = f"redis://127.0.0.1:{redis.port}/{db}"
                RedisStore.from_url(url).identity.init_epoch()
                settings = Settings(
                    redis_url=SecretStr(url),
                    state_dir=Path(tmp) / "state",
                    checkpoint_key=SecretStr(KEY_HEX),
                )
                fleet = Fleet.connect(settings)
                fill(fleet.store.client, 0, size, base_ms=fleet.store.server_time_ms() - 10 * size)
                server = ConsoleServer(("127.0.0.1", 0), fleet_console_data(fleet))
                servers.append(server)
                per_db.append(views(fleet, server))
            filled_s = time.perf_counter() - fill_started
            started = time.perf_counter()
            best = [dict.fromkeys(ops, float("inf")) for ops in per_db]
            for _ in range(rounds):
                for ops, figures in zip(per_db, best, strict=True):
                    for name, fn in ops.items():
                        figures[name] = min(figures[name], median_call_s(fn, samples))
            elapsed = time.perf_counter() - started
            version = redis.client().info("server").get("redis_version")
        finally:
            for server in servers:
                server.server_close()
            redis.kill()
    per_size = {
        str(size): {
            "bare_ms": round(figures["bare"] * 1000, 4),
            **{f"{view}_ms": round(figures[view] * 1000, 4) for view in VIEWS},
            **{f"{view}_ratio": ratio(figures[view], figures["bare"], 2) for view in VIEWS},
        }
        for size, figures in zip(sizes, best, strict=True)
    }
    small, large = per_size[str(sizes[0])], per_size[str(sizes[-1])]
    growth = {view: ratio(large[f"{view}_ratio"], small[f"{view}_ratio"], 3) for view in VIEWS}
    return {
        "sizes": sizes,
        "page": PAGE,
        "rounds": rounds,
        "samples": samples,
        "results": per_size,
        "growth": growth,
        "goal": GOAL,
        "goal_met": all(g is not None and g < GOAL for g in growth.values()),
        "redis_version": version,
        "fill_s": round(filled_s, 1),
        "elapsed_s": round(elapsed, 1),
    }


def _print_report(report: dict[str, Any]) -> None:
    sizes = report["sizes"]
    head = f"{'runs':>8}  {'bare ms':>8}" + "".join(f"  {v:>16}" for v in VIEWS)
    print(head)
    for size in sizes:
        row = report["results"][str(size)]
        cells = "".join(f"  {row[f'{v}_ms']:>7.3f} ({row[f'{v}_ratio']:>5.1f}x)" for v in VIEWS)
        print(f"{size:>8}  {row['bare_ms']:>8.3f}{cells}")
    growth = ", ".join(f"{v} {g}" for v, g in report["growth"].items())
    print(f"growth {sizes[-1]} / {sizes[0]} (goal < {GOAL}): {growth}")
    print(
        f"redis {report['redis_version']}; filled in {report['fill_s']} s, "
        f"measured in {report['elapsed_s']} s"
    )


def main(argv: list[str] | None = None) -> int:
    cli = parser(__doc__)
    cli.add_argument(
        "--sizes", default="1000,10000,100000", help="Comma-separated run counts, ascending."
    )
    cli.add_argument("--rounds", type=int, default=5)
    cli.add_argument("--samples", type=int, default=30)
    args = parse_args(cli, argv, quick="Small sizes, few samples; a smoke run that checks nothing.")
    if args.quick:
        sizes, rounds, samples = [200, 2000], 1, 5
    else:
        try:
            sizes = [int(s) for s in args.sizes.split(",")]
        except ValueError:
            cli.error("--sizes takes comma-separated integers")
        rounds, samples = args.rounds, args.samples
    if (
        len(sizes) < 2
        or sizes != sorted(sizes)
        or sizes[0] < PAGE * 10 // 5
        or (rounds < 1 or samples < 1)
    ):
        cli.error(
            "--sizes needs two or more ascending counts of at least 100; "
            "--rounds and --samples at least 1"
        )
    report = run(sizes, rounds=rounds, samples=samples)
    emit(report, as_json=args.json, table=_print_report)
    if args.quick:
        return 0
    return 0 if report["goal_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
