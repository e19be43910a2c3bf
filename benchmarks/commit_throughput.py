"""Durable commit throughput: ratchet's fenced, signed commits against bare Redis and
LangGraph's SqliteSaver.

One run of this script starts its own ``redis-server`` with ``appendonly yes`` and
``appendfsync always`` (every acknowledged write is on disk), then measures, each phase
for ``--seconds``:

* fenced, signed commits of a ~4 KB checkpoint (HMAC envelope + the commit script) from 1
  and from 4 worker processes, each process committing to its own run, through a default
  ``RedisStore`` (which stores a checkpoint this small as it is: compression starts at
  8 KiB, see ``ratchet.leasing.encoding``);
* a bare ``EVALSHA`` of a trivial script that stores the same payload (from 1 and from 4
  processes), and a bare ``SET``;
* LangGraph ``SqliteSaver.put`` of the same payload into a file database in WAL mode with
  ``synchronous=FULL`` (so also on disk at every put), from 1 and from 4 processes
  (needs the ``bench`` extra: ``pip install -e '.[bench]'``).

The payload is the signed payload of a real ~4 KB checkpoint (a run with receipted writes,
verifications and an approved pending write; ``--payload random`` uses 4 KB of random
bytes instead, which no encoding can shrink). Every contender stores the same bytes; a
ratchet commit signs them into an envelope (~200 B of header) first.

Goals: one process reaches at least 0.7x the bare EVALSHA rate; four processes reach at
least 1.5x SqliteSaver's four-process aggregate. Absolute rates depend on the machine's
fsync; the ratios are what travel. ``--json`` prints one JSON object.

    python benchmarks/commit_throughput.py [--seconds 1.5] [--rounds 3]
        [--payload checkpoint|random] [--json]

Phases run interleaved, ``--rounds`` times each; every figure is its best round (the
machine's noise only ever lowers a rate), the same rule for every contender.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sqlite3
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from harness import (
    emit,
    keyring,
    parse_args,
    parser,
    print_measures,
    random_bytes,
    ratio,
    temp_redis,
)

PAYLOAD_BYTES = 4096
TRIVIAL_SCRIPT = "redis.call('SET', KEYS[1], ARGV[1]) return 1"
WARMUP_OPS = 20


def checkpoint_payload() -> bytes:
    """The signed payload of a real ~4 KB checkpoint: a run driven on the in-memory ports
    (writes with receipts, verifications, reads, an approved pending write), exactly what
    a worker commits; see ``benchmarks/checkpoint_cost.py``."""
    from checkpoint_cost import build_checkpoint

    from ratchet.runtime.signing import parse_envelope

    return parse_envelope(build_checkpoint("4k", PAYLOAD_BYTES).blob)[1]


def random_payload() -> bytes:
    return random_bytes(PAYLOAD_BYTES)


_PAYLOAD: dict[str, bytes] = {}  # set in each worker process from the parent's bytes


def _payload(worker: int) -> bytes:
    # Every contender stores the same bytes; the last 8 differ per worker process.
    base = _PAYLOAD["bytes"]
    return base[:-8] + worker.to_bytes(8, "big")


# -- one operation per phase, built inside the worker process ------------------------------


def _client(url: str) -> Any:
    # The same client for every Redis phase: redis-py's defaults (a connection pool;
    # hiredis parses replies when it is installed, as ratchet's dependencies ensure).
    import redis

    return redis.Redis.from_url(url)


def _op_set(url: str, worker: int, _db: str) -> Callable[[int], None]:
    client = _client(url)
    payload = _payload(worker)
    key = f"bench:set:{worker}"
    return lambda i: client.set(key, payload)


def _op_evalsha(url: str, worker: int, _db: str) -> Callable[[int], None]:
    client = _client(url)
    sha = client.script_load(TRIVIAL_SCRIPT)
    payload = _payload(worker)
    key = f"bench:eval:{worker}"
    return lambda i: client.evalsha(sha, 1, key, payload)


def _op_commit(url: str, worker: int, _db: str) -> Callable[[int], None]:
    from ratchet.leasing import RedisStore
    from ratchet.runtime.signing import seal_envelope

    store = RedisStore(_client(url))  # defaults: a ~4 KB checkpoint is stored as it is
    keys = keyring()
    run_id = f"bench-{uuid.uuid4().hex[:12]}-{worker}"
    base = _payload(worker)[:-8]  # + an 8-byte counter: a new checkpoint every commit
    store.create_run(
        run_id,
        task_id="bench",
        env_instance_id="bench-env",
        scenario=b"{}",
        checkpoint=seal_envelope(keys, base),
    )
    run = store.acquire(run_id, owner=f"bench-worker-{worker}", ttl_ms=600_000)
    if run is None:
        raise RuntimeError("could not acquire the benchmark run's lease")

    def commit(i: int) -> None:
        # A new checkpoint each time: sign it, then one fenced commit (owner, lease
        # version, expected state version, generation = high-water + 1).
        blob = seal_envelope(keys, base + i.to_bytes(8, "big"))
        run.commit(blob)

    return commit


def _op_sqlite(_url: str, worker: int, db: str) -> Callable[[int], None]:
    from langgraph.checkpoint.base import empty_checkpoint
    from langgraph.checkpoint.sqlite import SqliteSaver

    conn = sqlite3.connect(db, check_same_thread=False, timeout=60)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    saver = SqliteSaver(conn)
    payload = _payload(worker)
    config: Any = {"configurable": {"thread_id": f"bench-{worker}", "checkpoint_ns": ""}}

    def put(i: int) -> None:
        checkpoint: Any = empty_checkpoint()
        checkpoint["id"] = str(uuid.uuid4())
        checkpoint["channel_values"] = {"payload": payload}
        saver.put(config, checkpoint, {"source": "loop", "step": i, "parents": {}}, {})

    return put


OPS: dict[str, Callable[[str, int, str], Callable[[int], None]]] = {
    "set": _op_set,
    "evalsha": _op_evalsha,
    "commit": _op_commit,
    "sqlite": _op_sqlite,
}


def _worker(
    op_name: str,
    url: str,
    worker: int,
    db: str,
    seconds: float,
    *,
    ready: Any,
    go: Any,
    results: Any,
    payload: bytes,
) -> None:
    _PAYLOAD["bytes"] = payload
    try:
        op = OPS[op_name](url, worker, db)
        for i in range(WARMUP_OPS):
            op(i)
        ready.put(worker)
        if not go.wait(timeout=120):
            raise RuntimeError("no start signal")
        count, start = 0, time.perf_counter()
        end = start + seconds
        while True:
            op(WARMUP_OPS + count)
            count += 1
            if count % 16 == 0 and time.perf_counter() >= end:
                break
        results.put((worker, count, time.perf_counter() - start, None))
    except Exception as exc:  # reported to the parent, which fails the run
        ready.put(worker)
        results.put((worker, 0, 0.0, f"{type(exc).__name__}: {exc}"))


def measure(
    op_name: str, processes: int, url: str, db: str, seconds: float, payload: bytes
) -> float:
    """Aggregate operations per second of ``processes`` workers started together."""
    ctx = mp.get_context("spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [
        ctx.Process(
            target=_worker,
            args=(op_name, url, w, db, seconds),
            kwargs={"ready": ready, "go": go, "results": results, "payload": payload},
        )
        for w in range(processes)
    ]
    for proc in procs:
        proc.start()
    try:
        for _ in procs:
            ready.get(timeout=120)
        go.set()
        outcomes = [results.get(timeout=seconds + 120) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    errors = [err for *_, err in outcomes if err]
    if errors:
        raise RuntimeError(f"{op_name}: {errors[0]}")
    total = sum(count for _, count, _, _ in outcomes)
    elapsed = max(el for _, _, el, _ in outcomes)
    return float(total / elapsed)


def _have_langgraph() -> bool:
    try:
        import langgraph.checkpoint.sqlite  # noqa: F401
    except ImportError:
        return False
    return True


PHASES: list[tuple[str, str, int]] = [
    ("set_per_s", "set", 1),
    ("evalsha_per_s", "evalsha", 1),
    ("commits_per_s_1proc", "commit", 1),
    ("evalsha_per_s_4proc", "evalsha", 4),
    ("commits_per_s_4proc", "commit", 4),
    ("langgraph_sqlite_put_per_s_1proc", "sqlite", 1),
    ("langgraph_sqlite_put_per_s_4proc", "sqlite", 4),
]


def run(seconds: float, rounds: int, payload_kind: str = "checkpoint") -> dict[str, Any]:
    """Every phase ``rounds`` times, interleaved; each figure is its best round."""
    payload = checkpoint_payload() if payload_kind == "checkpoint" else random_payload()
    langgraph = _have_langgraph()
    with temp_redis(prefix="ratchet-bench-") as (server, folder):
        info = server.client().info("server")
        url = server.url
        db = str(folder / "langgraph.sqlite")
        if langgraph:
            from langgraph.checkpoint.sqlite import SqliteSaver

            conn = sqlite3.connect(db)
            SqliteSaver(conn).setup()
            conn.close()
        best: dict[str, Any] = {name: None for name, _, _ in PHASES}
        for _round in range(rounds):
            for name, op, processes in PHASES:
                if op == "sqlite" and not langgraph:
                    continue
                rate = measure(op, processes, url, db, seconds, payload)
                best[name] = rate if best[name] is None else max(best[name], rate)
        figures: dict[str, Any] = dict(best)
    figures = {k: (round(v, 1) if isinstance(v, float) else v) for k, v in figures.items()}
    figures["ratio_vs_evalsha"] = ratio(figures["commits_per_s_1proc"], figures["evalsha_per_s"], 3)
    figures["ratio_vs_langgraph_sqlite_4proc"] = ratio(
        figures["commits_per_s_4proc"], figures["langgraph_sqlite_put_per_s_4proc"], 3
    )
    figures["ratio_4proc_vs_evalsha_4proc"] = ratio(
        figures["commits_per_s_4proc"], figures["evalsha_per_s_4proc"], 3
    )
    figures["goal_1proc_vs_evalsha_met"] = (
        figures["ratio_vs_evalsha"] is not None and figures["ratio_vs_evalsha"] >= 0.7
    )
    figures["goal_4proc_vs_langgraph_met"] = (
        figures["ratio_vs_langgraph_sqlite_4proc"] is not None
        and figures["ratio_vs_langgraph_sqlite_4proc"] >= 1.5
    )
    figures.update(
        {
            "payload": payload_kind,
            "payload_bytes": len(payload),
            "seconds_per_phase": seconds,
            "rounds": rounds,
            "redis_version": info.get("redis_version"),
            "appendonly": "yes",
            "appendfsync": "always",
            "cpus": os.cpu_count(),
        }
    )
    return figures


def _print_table(figures: dict[str, Any]) -> None:
    print_measures(
        figures,
        f"Commit throughput (Redis {figures['redis_version']}, appendfsync "
        f"always, {figures['payload_bytes']} B payload)",
    )


def main(argv: list[str] | None = None) -> int:
    cli = parser(__doc__)
    cli.add_argument("--seconds", type=float, default=1.5, help="duration of each phase")
    cli.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="repeat every phase, interleaved; report each one's best round",
    )
    cli.add_argument(
        "--payload",
        choices=("checkpoint", "random"),
        default="checkpoint",
        help="what every contender stores: a real ~4 KB checkpoint "
        "(default) or 4 KB of random bytes (incompressible)",
    )
    args = parse_args(cli, argv)
    if not 0.2 <= args.seconds <= 60:
        cli.error("--seconds must be between 0.2 and 60")
    if not 1 <= args.rounds <= 10:
        cli.error("--rounds must be between 1 and 10")
    emit(run(args.seconds, args.rounds, args.payload), as_json=args.json, table=_print_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
