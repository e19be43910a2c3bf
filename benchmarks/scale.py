"""Costs that stay flat: what a step, a restore, a view, a takeover, a finished run and a
short run cost as runs get longer and the fleet gets larger, each as a ratio measured in
one run.

Six figures, each with its bound, printed under these keys (``--json``: one object):

* ``commit_ratio_step5000_vs_10``: the cost of one durable step (a write: its intent and
  receipt commits, coalesced into one round trip of the commit script, plus the fsync'd
  ledger append of ``benchmarks/durable_steps.py``) on a run that is ``--long-steps``
  (5,000) steps in, over the same on a run 10 steps in. Both runs live side by side on
  one ``redis-server`` (AOF ``always``) and are measured in alternating batches of
  ``--batch`` steps, ``--rounds`` times; the figure is the median of the per-round ratios,
  the worse of client CPU (``time.process_time``) and wall time. Bound 1.2. Each batch
  starts with the garbage collector's debt paid (``gc.collect()``, not timed), so a
  restore's allocations are billed to the restore, not to the steps after it.
* ``restore_ratio_long_vs_short``: a restore (the lease's read with the checkpoint, the
  archive's last segments and the key digests, as a worker's job start reads them, then
  :meth:`ratchet.runtime.RunEngine.resume`: every check a job start, a yield's return and
  a takeover pay) of the long run over the same of the short run, alternating, median of
  the per-round ratios of median times. Bound 2.
* ``views_ratio_100k_vs_1k``: ``benchmarks/fleet_views.py`` at 1k and 100k runs (a
  listing page, the next page, the review queue page, a metrics scrape, a reaper tick);
  each view's cost relative to a bare ``ZRANGE`` at 100k over the same at 1k; the worst of
  the views. Bound 1.5.
* ``takeover_p99_ratio_1000_vs_1``: ``benchmarks/takeover.py`` (real worker processes, a
  SIGKILL of the holder, Redis time until another owner commits) with 1,000 other runs
  holding live leases, over the same with none besides the killed one; p99 (nearest rank)
  of ``--kills`` takeovers each. Bound 1.1.
* ``memory_per_finished_run_bytes``: what a finished 3-write run (the drill's run: a note
  written twice, an order placed at a loopback orders service, a grep verifier) keeps in
  Redis after retention (``purge_finished``, which exports each run to a verified file
  first and leaves a tombstone): ``MEMORY USAGE`` of its keys and its share of the
  cross-run indexes. ``kept_memory_per_run_bytes`` is the same before retention,
  ``used_memory_per_run_bytes`` the server's ``used_memory`` deltas (noisier: the
  allocator's), and ``aof_bytes_per_run`` what the runs added to the AOF. Bound 4,096.
* ``worker_cpu_ms_per_short_run``: the CPU time of the worker process (this one) per such
  run, executed through the real job path (:func:`ratchet.worker.job.execute_run`), the
  median of ``--runs``. Bound 5. Beside it, ``fleet_runs_per_s``: the same runs through RQ
  and real worker processes (``worker_main``), 1, 2, 4 and 8 of them, from submission to
  the last completion.

The machine is shared and noisy: each ratio's two sides are measured in the same rounds,
interleaved, and only the ratios are meant to travel. ``--quick`` is a smoke run with
small sizes that checks nothing; ``--only`` picks sections (``commit``, ``views``,
``takeover``, ``runs``). Exit code 1 when a figure misses its bound (not in ``--quick``).

    python benchmarks/scale.py [--long-steps 5000] [--rounds 5] [--batch 20]
        [--kills 15] [--runs 30] [--only commit,views,takeover,runs] [--quick] [--json]
"""

from __future__ import annotations

import gc
import os
import platform
import secrets
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from harness import emit, keyring, median, parse_args, parser, payload_text, print_measures, ratio
from harness import temp_redis as _temp_redis

BOUNDS = {
    "commit_ratio_step5000_vs_10": 1.2,
    "restore_ratio_long_vs_short": 2.0,
    "views_ratio_100k_vs_1k": 1.5,
    "takeover_p99_ratio_1000_vs_1": 1.1,
    "memory_per_finished_run_bytes": 4096,
    "worker_cpu_ms_per_short_run": 5.0,
}
SECTIONS = ("commit", "views", "takeover", "runs")
SHORT_AT = 10  # the short run's step when its batches start


# -- one durable step at any length --------------------------------------------------------


class StepRun:
    """One run of ledger writes, driven as ``durable_steps.py``'s ratchet contender drives
    it (a real engine on a real lease, coalesced commits), one step at a time."""

    def __init__(self, ctx: Any, run_id: str, steps: int) -> None:
        from ratchet.runtime import RunEngine
        from ratchet.worker.executor import Executor

        self.ctx, self.run_id, self.done = ctx, run_id, 0
        # Every run writes its own ledger: the ledger is the environment a run observes.
        self.adapter = ctx.adapter(run_id)
        RunEngine.start(
            run_id,
            scenario=ctx.scenario,
            keyring=ctx.keys,
            executor=Executor(self.adapter, ctx.store.creator(ctx.scenario_bytes)),
            clock=ctx.clock,
            archive_trace=True,
        )
        lease = ctx.store.acquire(run_id, owner=f"scale-{os.getpid()}", ttl_ms=3_600_000)
        if lease is None:
            raise RuntimeError(f"could not take the lease of {run_id}")
        self.lease = lease
        self.engine = self.restore()
        self.engine.reconcile()
        self.advance(steps)

    def restore(self) -> Any:
        """What a job start pays: the read, then every check of the restore."""
        from ratchet.runtime import RunEngine
        from ratchet.runtime.window import restore_tail
        from ratchet.worker.executor import Executor

        ctx = self.ctx
        snap = self.lease.read(with_checkpoint=True, archive_tail=restore_tail())
        return RunEngine.resume(
            snap.checkpoint,
            archive=snap.archive,
            archive_from=snap.archive_from,
            keys=snap.keys,
            scenario=ctx.scenario,
            keyring=ctx.keys,
            executor=Executor(self.adapter, self.lease),
            clock=ctx.clock,
            lease_version=self.lease.lease_version,
            coalesce=True,
        )

    def advance(self, steps: int) -> None:
        from ratchet.runtime import TraceOutcome, derive_idempotency_key

        ctx, engine = self.ctx, self.engine
        for _ in range(steps):
            state = engine.state
            action = {
                "action_id": f"a-{state.next_seq}",
                "kind": "external_call",
                "risk": "irreversible_external_write",
                "args": {"operation": ctx.operation, "body": ctx.body},
                "idempotency_key": derive_idempotency_key(self.run_id, self.done),
                "expected_env_version": state.environment.version,
                "deadline_at": ctx.clock.now() + 600,
            }
            result = engine.propose(action, agent_state={"cursor": self.done})
            if result.outcome is not TraceOutcome.EXECUTED:
                raise RuntimeError(f"step {self.done} of {self.run_id} ended {result.outcome}")
            self.done += 1


class _Context:
    def __init__(self, url: str, work: Path, steps: int) -> None:
        import durable_steps as ds

        from ratchet.leasing import RedisStore
        from ratchet.runtime.canonical import model_json

        self.store = RedisStore.from_url(url)
        self.store.load_scripts()
        self.keys = keyring()
        self.scenario = ds._scenario(steps, "ledger")
        self.scenario_bytes = model_json(self.scenario)
        self.clock = ds._Clock()
        self.body = payload_text(ds.PAYLOAD_BYTES)
        self.operation = ds.OPERATION
        self.adapter: Callable[[str], Any] = lambda run_id: ds.LedgerAdapter(
            ds.Ledger(work / f"{run_id}.log"), f"ledger-{run_id}"
        )


def _timed_steps(run: StepRun, steps: int) -> tuple[float, float]:
    """(client CPU s, wall s) per step over ``steps`` steps."""
    cpu, wall = time.process_time(), time.perf_counter()
    run.advance(steps)
    return (time.process_time() - cpu) / steps, (time.perf_counter() - wall) / steps


def _timed_restore(run: StepRun, samples: int) -> float:
    """The median time of ``samples`` restores, each with the collector's debt of the one
    before paid first."""
    times = []
    for _ in range(samples):
        gc.collect()
        started = time.perf_counter()
        run.restore()
        times.append(time.perf_counter() - started)
    return median(times)


def commit_section(long_steps: int, rounds: int, batch: int, restores: int) -> dict[str, Any]:
    with _temp_redis(prefix="ratchet-scale-") as (server, work):
        ctx = _Context(server.url, work, long_steps + (rounds + 1) * batch + SHORT_AT + 10)
        built = time.perf_counter()
        long_run = StepRun(ctx, "scale-long", long_steps)
        build_s = time.perf_counter() - built
        cpu_ratios, wall_ratios, restore_ratios = [], [], []
        figures: dict[str, list[float]] = {k: [] for k in ("short_cpu", "long_cpu", "short_wall")}
        figures |= {k: [] for k in ("long_wall", "short_restore", "long_restore")}
        shorts = []
        for index in range(rounds):
            short = StepRun(ctx, f"scale-short-{index}", SHORT_AT)
            shorts.append(short)
            # Alternate, the short side first on even rounds, last on odd ones. Each
            # phase starts with the collector's debt paid (gc.collect() outside the
            # timing): a restore's allocations must not be billed to the steps after it.
            pair = [(short, "short"), (long_run, "long")]
            for run, side in pair if index % 2 == 0 else reversed(pair):
                gc.collect()
                cpu, wall = _timed_steps(run, batch)
                figures[f"{side}_cpu"].append(cpu)
                figures[f"{side}_wall"].append(wall)
            cpu_ratios.append(figures["long_cpu"][-1] / figures["short_cpu"][-1])
            wall_ratios.append(figures["long_wall"][-1] / figures["short_wall"][-1])
        for index, short in enumerate(shorts):
            pair = [(short, "short"), (long_run, "long")]
            for run, side in pair if index % 2 == 0 else reversed(pair):
                gc.collect()
                figures[f"{side}_restore"].append(_timed_restore(run, restores))
            restore_ratios.append(figures["long_restore"][-1] / figures["short_restore"][-1])
        archive = ctx.store.client.llen(f"ratchet:{{{long_run.run_id}}}:archive")
        checkpoint_bytes = len(long_run.engine.checkpoint)
    cpu_ratio, wall_ratio = round(median(cpu_ratios), 3), round(median(wall_ratios), 3)
    return {
        "commit_ratio_step5000_vs_10": max(cpu_ratio, wall_ratio),
        "commit_cpu_ratio": cpu_ratio,
        "commit_wall_ratio": wall_ratio,
        "restore_ratio_long_vs_short": round(median(restore_ratios), 3),
        "step_cpu_us_short": round(median(figures["short_cpu"]) * 1e6, 1),
        "step_cpu_us_long": round(median(figures["long_cpu"]) * 1e6, 1),
        "step_wall_us_short": round(median(figures["short_wall"]) * 1e6, 1),
        "step_wall_us_long": round(median(figures["long_wall"]) * 1e6, 1),
        "restore_ms_short": round(median(figures["short_restore"]) * 1e3, 3),
        "restore_ms_long": round(median(figures["long_restore"]) * 1e3, 3),
        "long_run_steps": long_run.done,
        "long_run_trace_events": long_run.engine.state.next_seq - 1,
        "long_run_window_trace_events": len(long_run.engine.state.trace),
        "long_run_archive_segments": archive,
        "long_run_checkpoint_bytes": checkpoint_bytes,
        "long_run_build_s": round(build_s, 1),
        "commit_rounds": rounds,
        "commit_batch_steps": batch,
    }


# -- views and takeover: the existing benchmarks, at two sizes --------------------------------


def views_section(sizes: list[int], rounds: int, samples: int) -> dict[str, Any]:
    import fleet_views

    report = fleet_views.run(sizes, rounds=rounds, samples=samples)
    growth = report["growth"]
    worst = max(growth, key=lambda view: growth[view] or 0.0)
    return {
        "views_ratio_100k_vs_1k": growth[worst],
        "views_worst": worst,
        "views_growth": growth,
        "views_sizes": sizes,
        "views_ms": {
            size: {k: v for k, v in row.items() if k.endswith("_ms")}
            for size, row in report["results"].items()
        },
    }


def takeover_section(kills: int, live: int) -> dict[str, Any]:
    import takeover

    reports = {}
    for leases in (0, live):
        reports[leases] = takeover.run(
            kills=kills,
            workers=3,
            ttl_ms=1000,
            reaper_ms=100,
            think_ms=20,
            budget_s=60 + kills * 15,
            live_leases=leases,
        )
    one, many = reports[0], reports[live]
    return {
        "takeover_p99_ratio_1000_vs_1": ratio(many["p99_ms"], one["p99_ms"], 3),
        "takeover_p50_ratio_1000_vs_1": ratio(many["p50_ms"], one["p50_ms"], 3),
        "takeover_ms": {
            "1_lease": {k: one[k] for k in ("p50_ms", "p99_ms", "kills")},
            f"{live + 1}_leases": {k: many[k] for k in ("p50_ms", "p99_ms", "kills")},
        },
        "takeover_duplicate_effects": one["duplicate_effects"] + many["duplicate_effects"],
    }


# -- finished 3-write runs: memory, AOF, worker CPU, fleet rate -------------------------------


@contextmanager
def _fleet(tmp: Path) -> Iterator[tuple[Any, Any, Any]]:
    """A Redis (AOF always), a fleet on it and the drill's orders service (a process of
    its own, so its CPU is not the worker's)."""
    from pydantic import SecretStr

    from ratchet.adapters.sandbox import for_own_verifiers
    from ratchet.chaos.drill.services import TenantOrders
    from ratchet.fleet.context import Fleet
    from ratchet.fleet.settings import Settings
    from ratchet.leasing import RedisStore

    with _temp_redis(prefix="ratchet-scale-runs-") as (server, base):
        RedisStore(server.client()).identity.init_epoch()
        settings = Settings(
            redis_url=SecretStr(server.url),
            state_dir=base / "state",
            queue=f"scale-{secrets.token_hex(3)}",
            lease_ttl_ms=10_000,
            renew_interval_ms=3_000,
            job_timeout_s=600,
            checkpoint_key=SecretStr(secrets.token_hex(32)),
            worker_name="scale",
            verifier_sandbox=for_own_verifiers(),
        )
        orders = TenantOrders(tmp / "orders", process=True)
        try:
            yield Fleet.connect(settings), orders, server
        finally:
            orders.stop()


def _create(fleet: Any, orders: Any, tmp: Path, tag: str, count: int) -> list[str]:
    from ratchet.chaos.drill.services import drill_document, make_workspace
    from ratchet.ops.operations import create_run

    ids = []
    for index in range(count):
        root = make_workspace(tmp / f"ws-{tag}-{index}")
        url = orders.add(f"{tag}{index}")
        doc = drill_document(root, url, index, think_ms=0)
        ids.append(create_run(fleet, doc, run_id=f"scale-{tag}-{index}"))
    return ids


def _memory(client: Any) -> tuple[int, int]:
    """(Redis ``used_memory``, AOF bytes)."""
    client.execute_command("MEMORY", "PURGE")
    info = client.info("memory")
    aof = client.info("persistence").get("aof_current_size", 0)
    return int(info["used_memory"]), int(aof)


def _keyspace_bytes(client: Any, run_ids: list[str]) -> int:
    """``MEMORY USAGE`` (exact: ``SAMPLES 0``) of every key of these runs, plus every
    cross-run index (``ratchet:index:*``, ``ratchet:nonce:*``): what they hold in Redis,
    free of the allocator's and the server's own noise."""
    total = 0
    for run_id in run_ids:
        for key in client.scan_iter(match=f"ratchet:{{{run_id}}}:*", count=1000):
            total += int(client.memory_usage(key, samples=0) or 0)
    for pattern in ("ratchet:index:*", "ratchet:nonce:*"):
        for key in client.scan_iter(match=pattern, count=1000):
            total += int(client.memory_usage(key, samples=0) or 0)
    return total


def runs_section(runs: int, fleet_sizes: list[int], fleet_runs: int) -> dict[str, Any]:
    from ratchet.ops.retention import purge_finished
    from ratchet.worker.job import execute_run

    with tempfile.TemporaryDirectory(prefix="ratchet-scale-runs-") as tmp_name:
        tmp = Path(tmp_name)
        with _fleet(tmp) as (fleet, orders, _server):
            client = fleet.store.client
            warm = _create(fleet, orders, tmp, "warm", 2)
            for run_id in warm:  # imports, scripts and connections: not a run's cost
                execute_run(fleet, run_id, owner="scale-w")
            exports = tmp / "exports"
            purge_finished(fleet, older_than_ms=0, export_dir=exports, limit=10_000)
            memory_before, aof_before = _memory(client)
            base = _keyspace_bytes(client, [])  # the indexes, before these runs
            ids = _create(fleet, orders, tmp, "r", runs)
            cpu_ms = []
            for run_id in ids:
                started = time.process_time()
                report = execute_run(fleet, run_id, owner="scale-w")
                cpu_ms.append((time.process_time() - started) * 1000)
                if report.phase != "completed":
                    raise RuntimeError(f"{run_id} ended {report.outcome} in {report.phase}")
            memory_kept, aof_kept = _memory(client)
            kept = _keyspace_bytes(client, ids) - base
            purged = purge_finished(fleet, older_than_ms=0, export_dir=exports, limit=10_000)
            if len(purged.purged) != runs:
                raise RuntimeError(f"retention kept runs: {dict(purged.kept)}")
            memory_after, _ = _memory(client)
            after = _keyspace_bytes(client, ids) - base
            rates = {str(n): _fleet_rate(fleet, orders, tmp, n, fleet_runs) for n in fleet_sizes}
    return {
        "memory_per_finished_run_bytes": round(after / runs),
        "kept_memory_per_run_bytes": round(kept / runs),
        "used_memory_per_run_bytes": {
            "kept": round((memory_kept - memory_before) / runs),
            "after_retention": round((memory_after - memory_before) / runs),
        },
        "aof_bytes_per_run": round((aof_kept - aof_before) / runs),
        "worker_cpu_ms_per_short_run": round(median(cpu_ms), 3),
        "worker_cpu_ms_p90": round(sorted(cpu_ms)[int(0.9 * (len(cpu_ms) - 1))], 3),
        "short_runs": runs,
        "fleet_runs_per_s": rates,
        "fleet_runs_each": fleet_runs,
    }


def _fleet_rate(fleet: Any, orders: Any, tmp: Path, workers: int, count: int) -> float:
    """Runs per second of ``workers`` real worker processes, submission to last completion."""
    import takeover

    from ratchet.leasing.keyspace import phase_index
    from ratchet.worker.pool import _settings_json

    tag = f"f{workers}x"
    ids = _create(fleet, orders, tmp, tag, count)
    done_key = phase_index("completed")
    before = fleet.store.client.zcard(done_key)
    pool = takeover.Pool(_settings_json(fleet.settings))
    try:
        pool.start(workers)
        _wait(lambda: _workers_listening(fleet) >= workers, 60, "workers to start")
        started = time.perf_counter()
        for run_id in ids:
            fleet.enqueue(run_id)
        _wait(lambda: fleet.store.client.zcard(done_key) - before >= count, 300, "the runs")
        elapsed = time.perf_counter() - started
    finally:
        pool.stop_all()
    return round(count / elapsed, 1)


def _workers_listening(fleet: Any) -> int:
    from rq import Worker

    return len(Worker.all(queue=fleet.queue))


def _wait(done: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if done():
            return
        time.sleep(0.02)
    raise TimeoutError(f"timed out waiting for {what}")


# -- the report ----------------------------------------------------------------------------


def run(args: Any) -> dict[str, Any]:
    only = set(args.only.split(",")) if args.only else set(SECTIONS)
    quick = args.quick
    started = time.perf_counter()
    os.environ.setdefault("RATCHET_LOG_LEVEL", "WARNING")  # inherited by the workers
    report: dict[str, Any] = {}
    if "commit" in only:
        report |= commit_section(
            200 if quick else args.long_steps, 2 if quick else args.rounds, args.batch, 3
        )
    if "views" in only:
        sizes = [200, 2000] if quick else [1000, 100_000]
        report |= views_section(sizes, 1 if quick else 5, 5 if quick else 30)
    if "takeover" in only:
        report |= takeover_section(3 if quick else args.kills, 50 if quick else 1000)
    if "runs" in only:
        report |= runs_section(
            5 if quick else args.runs, [1, 2] if quick else [1, 2, 4, 8], 6 if quick else 40
        )
    met = {
        key: (report[key] is not None and report[key] <= bound)
        for key, bound in BOUNDS.items()
        if key in report
    }
    report |= {
        "bounds": {k: v for k, v in BOUNDS.items() if k in report},
        "bounds_met": met,
        "quick": quick,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "elapsed_s": round(time.perf_counter() - started, 1),
    }
    return report


def main(argv: list[str] | None = None) -> int:
    cli = parser(__doc__)
    cli.add_argument("--long-steps", type=int, default=5000)
    cli.add_argument("--rounds", type=int, default=5)
    cli.add_argument("--batch", type=int, default=20)
    cli.add_argument("--kills", type=int, default=15)
    cli.add_argument("--runs", type=int, default=30)
    cli.add_argument("--only", default="", help=f"comma-separated: {', '.join(SECTIONS)}")
    args = parse_args(cli, argv, quick="a smoke run with small sizes; checks nothing")
    if min(args.long_steps, args.rounds, args.batch, args.kills, args.runs) < 1:
        cli.error("every count must be >= 1")
    unknown = set(args.only.split(",")) - set(SECTIONS) if args.only else set()
    if unknown:
        cli.error(f"unknown section(s): {', '.join(sorted(unknown))}")
    report = run(args)
    emit(report, as_json=args.json, table=lambda r: print_measures(r, "Costs that stay flat"))
    if args.quick:
        return 0
    return 0 if all(report["bounds_met"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
