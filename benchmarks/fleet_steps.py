"""Fleet throughput: durable steps per second of four worker processes, ratchet against
DBOS and LangGraph's PostgresSaver, each step one fsync'd external write.

Every step performs the write of ``benchmarks/durable_steps.py`` (imported from it, not
copied): a ~512 B record (idempotency key + payload) appended to a ledger file and
``fdatasync``'d. Every process has a ledger file of its own (in a folder of its own), so
no process's fsync ever covers another's record. Runs (workflows, graph threads) have
``--steps-per-run`` writes each (20), run back to back; a run's set-up is inside the
timing. Each contender runs in ``--processes`` worker processes (4) at once:

* **ratchet**: each process drives its own runs exactly as durable_steps.py's ``ratchet``
  contender does in one process (its code, imported): a real
  :class:`~ratchet.runtime.RunEngine` per run, created through ``RedisStore.creator``, its
  lease acquired, resumed on the :class:`~ratchet.leasing.LeasedRun`, 20 ``external_call``
  writes through the ledger adapter, two fenced, signed commits per write, coalesced (a
  write's receipt commit goes in one script call with the next write's intent commit; the
  last one with the lease's release). All processes commit to **one** ``redis-server``
  (``appendonly yes``, ``appendfsync always``), so they share Redis' group commit: one AOF
  fsync covers every command that arrived while the previous one ran.
* **DBOS**: each process runs ``@DBOS.workflow()`` workflows of 20 ``@DBOS.step()`` writes
  (durable_steps.py's DBOS contender, imported) on the machine's PostgreSQL. The four
  processes **share one system database** (``ratchet_bench_dbos``, the one durable_steps.py
  uses), as a DBOS fleet does; each has an executor id of its own (``DBOS__VMID``), so no
  process recovers another's workflows at launch. Launches (which migrate the schema) take
  turns.
* **LangGraph + PostgresSaver** (``langgraph-checkpoint-postgres``): each process runs
  graph threads whose node performs the write and loops back to itself 20 times, invoked
  with ``durability="sync"`` (every superstep's writes and checkpoint are stored before the
  next starts), on one shared database ``ratchet_bench_langgraph`` (created if missing),
  one connection per process opened as ``PostgresSaver.from_conn_string`` does
  (autocommit, no pipeline).

Both peers' PostgreSQL is the machine's, at 127.0.0.1:5432 (``synchronous_commit`` as the
server has it: reported), which has its own group commit for concurrent transactions.

A fleet turn starts the contender's processes together (each waits for a common instant)
for ``--seconds``; each finishes the run it is in, and the fleet's rate is the steps of all
completed runs divided by the time from the first process's start to the last one's end.

Also measured, on the same Redis:

* **floor_single_run**: the single-run physical floor: one process, per step a bare
  ``EVALSHA`` of a tiny script (one ``SET`` of a counter; the write makes Redis fsync its
  AOF before the reply) followed by the same fsync'd ledger append, through redis-py's
  default client; no run set-up: the least a durable step costs one client here.
* **ratchet_single_run**: one ratchet process alone (the first fleet process, same runs);
  ``ratchet_single_run_fraction_of_floor`` is its rate over the floor's.
* **floor_fleet**: the floor's loop in every ratchet process at once: what four clients of
  this Redis reach with nothing but the round trip and the effect (the ceiling of the
  ratchet fleet here); ``ratchet_fleet_fraction_of_floor_fleet`` is the fleet's share.

Rounds are interleaved: every round runs every phase (the three fleets, the single run,
both floors), in rotating order; each figure is the **median** of its rounds (the best
round is beside it, and every round's figure is listed). ``ratio_vs_dbos_fleet`` and
``ratio_vs_langgraph_postgres_fleet`` are ratchet's fleet figure over each peer's (goal:
2.0). Beside each phase: the worker processes' own CPU per step, the server's (Redis for
ratchet and the floors, every ``postgres`` process for the peers; read from ``INFO cpu``
and ``/proc``), the share of the machine's CPU that was busy during the phase, and the
load average at the start and the end. A contender that cannot run (package missing,
PostgreSQL unreachable) is reported as null with the reason. ``--json`` prints one JSON
object.

    python benchmarks/fleet_steps.py [--rounds 7] [--seconds 6] [--processes 4]
        [--steps-per-run 20] [--quick] [--json]

The defaults take about five minutes; ``--quick`` (2 rounds of 0.5 s turns) is a smoke
run of 10-30 s that checks nothing.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from durable_steps import (
    PAYLOAD_BYTES,
    PG_PROBE_URL,
    STEPS_PER_RUN,
    Contender,
    Ledger,
    _build,
    _dist_version,
    _Unavailable,
    langgraph_contender,
    ledger_record,
)
from harness import (
    emit,
    median,
    parse_args,
    parser,
    payload_text,
    print_measures,
    ratio,
    temp_redis,
)

CONTENDERS = ("ratchet", "dbos", "langgraph_postgres")
# Phase name -> (contender whose processes run it, command, how many of its processes).
PHASES: dict[str, tuple[str, str, str]] = {
    "ratchet_fleet": ("ratchet", "round", "all"),
    "dbos_fleet": ("dbos", "round", "all"),
    "langgraph_postgres_fleet": ("langgraph_postgres", "round", "all"),
    "ratchet_single_run": ("ratchet", "round", "one"),
    "floor_single_run": ("ratchet", "floor", "one"),
    "floor_fleet": ("ratchet", "floor", "all"),
}
LANGGRAPH_DB = "ratchet_bench_langgraph"
LANGGRAPH_URL = f"postgresql://postgres@127.0.0.1:5432/{LANGGRAPH_DB}"
TINY_SCRIPT = "redis.call('SET', KEYS[1], ARGV[1]) return 1"
SETUP_TIMEOUT_S = 180.0  # for all processes together (they start on a shared machine)
START_DELAY_S = 0.05  # a fleet turn starts this long after its command is sent
GOAL_VS_PEERS = 2.0


# -- the contenders, inside a worker process ------------------------------------------------


def _probe_postgres() -> None:
    """Raise :class:`_Unavailable` with the reason when PostgreSQL does not answer."""
    import psycopg

    try:
        psycopg.connect(PG_PROBE_URL, connect_timeout=3).close()
    except psycopg.Error as exc:
        raise _Unavailable(
            f"PostgreSQL at 127.0.0.1:5432 unreachable: "
            f"{type(exc).__name__}: {str(exc).strip()[:200]}"
        ) from None


def _ensure_database(name: str) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(PG_PROBE_URL, autocommit=True, connect_timeout=3) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
            return
        with contextlib.suppress(psycopg.errors.DuplicateDatabase):
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def _langgraph_postgres(work: Path, steps: int) -> Contender:
    """durable_steps.py's LangGraph contender with ``PostgresSaver`` for ``SqliteSaver``."""
    from langgraph.checkpoint.postgres import PostgresSaver

    _probe_postgres()
    _ensure_database(LANGGRAPH_DB)
    stack = contextlib.ExitStack()
    saver = stack.enter_context(PostgresSaver.from_conn_string(LANGGRAPH_URL))
    saver.setup()
    return langgraph_contender(
        work,
        steps,
        "ledger",
        saver,
        close=stack.close,
        info={
            "langgraph_version": _dist_version("langgraph"),
            "langgraph_checkpoint_postgres_version": _dist_version("langgraph-checkpoint-postgres"),
        },
        details={},
    )


def _floor(url: str, work: Path, steps: int) -> Callable[[int], int]:
    """The floor's run: per step a bare fsync'd ``EVALSHA`` and the fsync'd ledger append."""
    import redis

    client = redis.Redis.from_url(url)  # redis-py's defaults (hiredis parses replies)
    sha = client.script_load(TINY_SCRIPT)
    ledger = Ledger(work / "floor-ledger.log")
    body = payload_text(PAYLOAD_BYTES)
    key = f"bench:floor:{os.getpid()}"

    def run_once(n: int) -> int:
        for index in range(steps):
            client.evalsha(sha, 1, key, index)
            ledger.append(ledger_record("write", f"floor-{os.getpid()}-{n}-{index}", body))
        return steps

    return run_once


def _contender(name: str, url: str, work: Path, steps: int, lock: Any) -> Contender:
    work.mkdir(parents=True, exist_ok=True)
    if name == "ratchet":
        return _build("ratchet", url, work, steps, "ledger")
    if name == "dbos":
        # An executor id of its own: a launching DBOS recovers the pending workflows of its
        # executor id, which would otherwise be every other process's running workflows.
        os.environ["DBOS__VMID"] = f"fleet-{os.getpid()}"
        with contextlib.suppress(ImportError):
            import dbos  # noqa: F401 - imported before the lock, launched under it
        with lock:
            return _build("dbos", url, work, steps, "ledger")
    try:
        import langgraph.checkpoint.postgres  # noqa: F401
    except ImportError as exc:
        raise _Unavailable(
            f"langgraph-checkpoint-postgres is not installed ({exc.name or exc}); "
            "pip install -e '.[bench]'"
        ) from None
    with lock:  # PostgresSaver.setup migrates the shared database's schema
        return _langgraph_postgres(work, steps)


def _child(
    name: str, index: int, url: str, work: str, steps: int, lock: Any, conn: Connection
) -> None:
    """A worker process: set up, then run turns on the parent's command."""
    os.dup2(2, 1)  # libraries that log to stdout must not mix into the parent's JSON
    floor: Callable[[int], int] | None = None
    try:
        contender = _contender(name, url, Path(work) / f"{name}-{index}", steps, lock)
        contender.run_once(-1)  # warm-up run (imports, caches, connections)
        if name == "ratchet":
            floor = _floor(url, Path(work) / f"{name}-{index}", steps)
            floor(-1)
    except _Unavailable as exc:
        conn.send(("unavailable", str(exc)))
        return
    except Exception as exc:
        conn.send(("unavailable", f"set-up failed: {type(exc).__name__}: {exc}"[:500]))
        return
    conn.send(("ready", contender.info))
    n = 0
    while True:
        if not conn.poll(SETUP_TIMEOUT_S * 4):
            return  # the parent went away
        command, arg = conn.recv()
        try:
            if command in ("round", "floor"):
                start_at, seconds = arg
                once = contender.run_once if command == "round" else floor
                if once is None:
                    raise RuntimeError(f"{name} has no {command}")
                time.sleep(max(0.0, start_at - time.monotonic()))
                count, cpu, start = 0, time.process_time(), time.monotonic()
                end = start_at + float(seconds)
                while time.monotonic() < end:
                    count += once(n)
                    n += 1
                conn.send(("done", (count, start, time.monotonic(), time.process_time() - cpu)))
            else:
                conn.send(("done", contender.finish()))
                return
        except Exception as exc:
            conn.send(
                ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"[:2000])
            )
            return


# -- what the parent reads about the machine ------------------------------------------------


def _machine_cpu() -> tuple[float, float] | None:
    """(busy, total) jiffies of all CPUs so far (busy: not idle, not waiting for I/O)."""
    try:
        fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal
    return total - fields[3] - fields[4], total


def _postgres_cpu_s() -> float | None:
    """CPU seconds (user + system) used so far by the machine's ``postgres`` processes."""
    tick = os.sysconf("SC_CLK_TCK")
    total, found = 0, False
    try:
        entries = list(os.scandir("/proc"))
    except OSError:
        return None
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            if Path(entry.path, "comm").read_text().strip() != "postgres":
                continue
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
        found = True
    return total / tick if found else None


def _redis_cpu_s(client: Any) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


# -- the parent -----------------------------------------------------------------------------


@dataclass
class _Proc:
    name: str
    index: int
    proc: Any
    conn: Connection
    reason: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    finished: bool = False

    def ask(self, command: str, arg: Any, timeout_s: float) -> Any:
        self.conn.send((command, arg))
        return self.answer(command, timeout_s)

    def answer(self, command: str, timeout_s: float) -> Any:
        if not self.conn.poll(timeout_s):
            raise RuntimeError(
                f"{self.name}[{self.index}]: no answer to {command} in {timeout_s} s"
            )
        status, value = self.conn.recv()
        if status != "done":
            raise RuntimeError(f"{self.name}[{self.index}]: {value}")
        return value


@dataclass
class _Phase:
    name: str
    procs: list[_Proc]
    command: str
    server: str  # "redis" or "postgres": whose CPU is reported beside the phase
    rates: list[float] = field(default_factory=list)
    steps: int = 0
    client_cpu_s: float = 0.0
    server_cpu_s: float | None = 0.0
    busy: list[float] = field(default_factory=list)


def _turn(phase: _Phase, seconds: float, redis_client: Any) -> None:
    """One turn of ``phase``: its processes start together and run for ``seconds``."""

    def server_cpu() -> float | None:
        return _redis_cpu_s(redis_client) if phase.server == "redis" else _postgres_cpu_s()

    cpu_before, server_before = _machine_cpu(), server_cpu()
    start_at = time.monotonic() + START_DELAY_S
    for p in phase.procs:
        p.conn.send((phase.command, (start_at, seconds)))
    replies = [p.answer(phase.command, seconds + 120) for p in phase.procs]
    cpu_after, server_after = _machine_cpu(), server_cpu()
    count = sum(r[0] for r in replies)
    window = max(r[2] for r in replies) - min(r[1] for r in replies)
    phase.rates.append(count / window)
    phase.steps += count
    phase.client_cpu_s += sum(r[3] for r in replies)
    if phase.server_cpu_s is not None and server_before is not None and server_after is not None:
        phase.server_cpu_s += server_after - server_before
    else:
        phase.server_cpu_s = None
    if cpu_before is not None and cpu_after is not None and cpu_after[1] > cpu_before[1]:
        phase.busy.append((cpu_after[0] - cpu_before[0]) / (cpu_after[1] - cpu_before[1]))


def run(*, rounds: int, seconds: float, steps: int, processes: int) -> dict[str, Any]:
    """Start Redis and every worker process, run interleaved rounds, return the report."""
    started = time.monotonic()
    load_start = os.getloadavg()
    ctx = mp.get_context("spawn")
    procs: list[_Proc] = []
    with temp_redis(prefix="ratchet-fleet-") as (server, work):
        client = server.client()
        redis_version = client.info("server").get("redis_version")
        try:
            # Set-up steps that migrate a shared schema take turns (one lock per contender,
            # kept alive here until every process has started).
            locks = {name: ctx.Lock() for name in CONTENDERS}
            for name in CONTENDERS:
                lock = locks[name]
                for index in range(processes):
                    parent, child = ctx.Pipe()
                    proc = ctx.Process(
                        target=_child,
                        daemon=True,
                        args=(name, index, server.url, str(work), steps, lock, child),
                    )
                    proc.start()
                    procs.append(_Proc(name, index, proc, parent))
            deadline = time.monotonic() + SETUP_TIMEOUT_S
            for p in procs:  # set-up runs in parallel; all of it has one deadline
                if not p.conn.poll(max(0.0, deadline - time.monotonic())):
                    p.reason = f"set-up took longer than {SETUP_TIMEOUT_S:.0f} s"
                    continue
                try:
                    status, value = p.conn.recv()
                except EOFError:
                    status, value = "unavailable", f"the process exited ({p.proc.exitcode})"
                if status == "ready":
                    p.info = value
                else:
                    p.reason = str(value)
            reasons: dict[str, str | None] = {}
            groups: dict[str, list[_Proc]] = {}
            for name in CONTENDERS:
                group = [p for p in procs if p.name == name]
                failed = next((p for p in group if p.reason is not None), None)
                reasons[name] = None if failed is None else failed.reason
                groups[name] = group if failed is None else []
            if not groups["ratchet"]:
                raise RuntimeError(f"ratchet could not run: {reasons['ratchet']}")
            phases = [
                _Phase(
                    phase,
                    groups[owner] if count == "all" else groups[owner][:1],
                    command,
                    "redis" if owner == "ratchet" else "postgres",
                )
                for phase, (owner, command, count) in PHASES.items()
            ]
            live = [ph for ph in phases if ph.procs]
            for r in range(rounds):
                for phase in live[r % len(live) :] + live[: r % len(live)]:
                    _turn(phase, seconds, client)
            for p in procs:
                if p.reason is None and groups[p.name]:
                    p.info.update(p.ask("finish", None, 60))
                    p.finished = True
        finally:
            for p in procs:  # a process left waiting (its group could not run) is ended
                p.proc.join(timeout=10 if p.finished else 0.5)
                if p.proc.is_alive():
                    p.proc.kill()
                    p.proc.join(timeout=5)
    return _report(
        phases,
        groups,
        reasons,
        rounds=rounds,
        seconds=seconds,
        steps=steps,
        processes=processes,
        redis_version=redis_version,
        load=(load_start, os.getloadavg()),
        elapsed=time.monotonic() - started,
    )


def _per_step_us(cpu_s: float | None, steps: int) -> float | None:
    return round(cpu_s / steps * 1e6, 1) if cpu_s is not None and steps else None


def _report(
    phases: list[_Phase],
    groups: dict[str, list[_Proc]],
    reasons: dict[str, str | None],
    *,
    rounds: int,
    seconds: float,
    steps: int,
    processes: int,
    redis_version: str | None,
    load: tuple[tuple[float, float, float], tuple[float, float, float]],
    elapsed: float,
) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for ph in phases:
        rate = median(ph.rates) if ph.rates else None
        report[f"{ph.name}_steps_per_s"] = round(rate, 1) if rate is not None else None
        report[f"{ph.name}_steps_per_s_best"] = round(max(ph.rates), 1) if ph.rates else None
        report[f"{ph.name}_steps_per_s_rounds"] = [round(x, 1) for x in ph.rates]
        report[f"{ph.name}_processes"] = len(ph.procs)
        # The worker processes' own CPU per step, and the server's (Redis, or PostgreSQL
        # for the peers), over all of the phase's turns.
        report[f"{ph.name}_client_cpu_us_per_step"] = _per_step_us(ph.client_cpu_s, ph.steps)
        report[f"{ph.name}_server_cpu_us_per_step"] = _per_step_us(ph.server_cpu_s, ph.steps)
        report[f"{ph.name}_server"] = ph.server
        report[f"{ph.name}_machine_cpu_busy"] = round(median(ph.busy), 3) if ph.busy else None
    for name in CONTENDERS:
        report[f"{name}_reason"] = reasons[name]
    by = {ph.name: ph for ph in phases}
    ours = report["ratchet_fleet_steps_per_s"]
    for peer in ("dbos", "langgraph_postgres"):
        value = ratio(ours, report[f"{peer}_fleet_steps_per_s"], 3)
        report[f"ratio_vs_{peer}_fleet"] = value
        report[f"goal_vs_{peer}_fleet_met"] = None if value is None else value >= GOAL_VS_PEERS
        # Each round's own ratio (the same round's turns, so the same weather).
        peer_rates = by[f"{peer}_fleet"].rates
        report[f"ratio_vs_{peer}_fleet_rounds"] = [
            round(a / b, 3) for a, b in zip(by["ratchet_fleet"].rates, peer_rates, strict=False)
        ]
    report["goal_vs_peers_fleet"] = GOAL_VS_PEERS
    single, floor = by["ratchet_single_run"].rates, by["floor_single_run"].rates
    report["ratchet_single_run_fraction_of_floor"] = ratio(
        report["ratchet_single_run_steps_per_s"], report["floor_single_run_steps_per_s"], 3
    )
    report["ratchet_single_run_fraction_of_floor_rounds"] = [
        round(a / b, 3) for a, b in zip(single, floor, strict=True)
    ]
    report["ratchet_fleet_fraction_of_floor_fleet"] = ratio(
        ours, report["floor_fleet_steps_per_s"], 3
    )
    report["ratchet_fleet_speedup_over_single_run"] = ratio(
        ours, report["ratchet_single_run_steps_per_s"], 3
    )
    first = {name: (group[0].info if group else {}) for name, group in groups.items()}
    report["ratchet_commits_per_step"] = first["ratchet"].get("commits_per_step")
    report["ratchet_round_trips_per_step"] = first["ratchet"].get("round_trips_per_step")
    report["langgraph_postgres_checkpointer_writes_per_step"] = first["langgraph_postgres"].get(
        "checkpointer_writes_per_step"
    )
    report.update(
        {
            "statistic": "median of rounds (best round and every round beside it)",
            "payload_bytes": PAYLOAD_BYTES,
            "steps_per_run": steps,
            "processes": processes,
            "rounds": rounds,
            "seconds_per_turn": seconds,
            "redis_version": redis_version,
            "redis_appendonly": "yes",
            "redis_appendfsync": first["ratchet"].get("redis_appendfsync"),
            "postgres_synchronous_commit": first["dbos"].get("postgres_synchronous_commit")
            or _synchronous_commit(),
            "dbos_system_database": "shared by the processes (one executor id each)",
            "dbos_version": first["dbos"].get("dbos_version"),
            "langgraph_version": first["langgraph_postgres"].get("langgraph_version"),
            "langgraph_checkpoint_postgres_version": first["langgraph_postgres"].get(
                "langgraph_checkpoint_postgres_version"
            ),
            "load_average_start": [round(x, 2) for x in load[0]],
            "load_average_end": [round(x, 2) for x in load[1]],
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "elapsed_s": round(elapsed, 1),
        }
    )
    return report


def _synchronous_commit() -> str | None:
    try:
        import psycopg

        with psycopg.connect(PG_PROBE_URL, connect_timeout=3) as conn:
            row = conn.execute("SHOW synchronous_commit").fetchone()
    except Exception:
        return None
    return str(row[0]) if row else None


def _print_table(report: dict[str, Any]) -> None:
    print_measures(
        report,
        f"Fleet durable steps per second ({report['processes']} processes, "
        f"{report['payload_bytes']} B fsync'd write per step, {report['steps_per_run']} "
        f"steps per run, {report['statistic']})",
    )


def main(argv: list[str] | None = None) -> int:
    cli = parser(__doc__)
    cli.add_argument("--rounds", type=int, default=7, help="interleaved rounds")
    cli.add_argument(
        "--seconds", type=float, default=6.0, help="duration of each phase's turn in a round"
    )
    cli.add_argument(
        "--processes", type=int, default=4, help="worker processes per contender's fleet"
    )
    cli.add_argument(
        "--steps-per-run",
        type=int,
        default=STEPS_PER_RUN,
        help="writes per run (workflow, graph thread)",
    )
    args = parse_args(cli, argv, quick="smoke run: 2 rounds of 0.5 s turns")
    if args.quick:
        args.rounds, args.seconds = 2, 0.5
    if not 1 <= args.rounds <= 20:
        cli.error("--rounds must be between 1 and 20")
    if not 0.2 <= args.seconds <= 60:
        cli.error("--seconds must be between 0.2 and 60")
    if not 1 <= args.processes <= 16:
        cli.error("--processes must be between 1 and 16")
    if not 1 <= args.steps_per_run <= 500:
        cli.error("--steps-per-run must be between 1 and 500")
    with contextlib.redirect_stdout(sys.stderr):  # keep stdout for the one JSON object
        report = run(
            rounds=args.rounds,
            seconds=args.seconds,
            steps=args.steps_per_run,
            processes=args.processes,
        )
    emit(report, as_json=args.json, table=_print_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
