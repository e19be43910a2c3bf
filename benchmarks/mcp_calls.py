"""Worker CPU per MCP tool call against the call itself, measured in one run.

What one MCP tool call costs a worker, beyond what the call itself costs its client. All
in one process (``time.process_time()``: this process's CPU, every thread of it: the
worker's job and the connection's event loop); the MCP server is a process of its own
(the reference tickets server, ``python -m ratchet.testing.mcp_server --sep3182``, over
stdio) and its CPU is not counted.

* **call**: ``MCPConnection.call_tool("create_ticket", ..., idempotency_key=...)`` on a
  started stdio connection, a fresh key per call: what the tool call itself costs the
  client (the request built and validated, sent, answered, parsed). Per call, over a
  batch of ``--calls`` calls.
* **jobs on a shared server**: a tool package installed as the tests install one (a
  module and its dist-info on ``sys.path``, entry point group ``ratchet.tools``) whose
  factory builds ``tk_create_ticket`` with ``mcp_tools(shared_stdio(ARGV), prefix="tk_",
  include=["create_ticket"])[0]`` (docs/mcp.md, "A stdio server in a tool package, kept
  for the worker's life"). Runs are submitted (outside the timing) to a real
  ``redis-server`` (AOF ``always``) and each is run by one real worker job,
  :func:`ratchet.worker.job.execute_run`, in this process; what is timed is that call.
  A run's plan is K calls of the tool, then ``run_verifier`` (the command ``true``: the
  cheapest verifier there is; no sandbox, ``verifier_sandbox`` ``none``: confinement is
  not what is measured) and ``finish`` (a run finishes only on a passing verification).
  ``k0``, ``k1`` and ``k10`` permit the tool and call it 0, 1 and 10 times; ``plain``
  permits no tool (K=0, no tool package loaded: what a job costs without one).
  ``create_ticket`` is an irreversible external write (``destructiveHint``) that does
  not require approval: the scenario permits it and asks for none, so the runs never
  wait. The server dedupes by key (SEP-3182), so the tool's recovery is ``idempotent``
  and its key travels beside the arguments, as in the bare call.
* **the old way** (``own_k1``): the same run with K=1 through a tool package whose
  factory starts a connection of its own in every job (``MCPConnection.stdio(ARGV)
  .start()``, never shared) and closes it when the job's environment is closed (the
  tool's ``close``): a server process started, a handshake and a tool listing per job.

The runs' agent is the built-in ``scripted`` agent: a step may name a permitted tool,
completed from the tool's contract (risk, key for a write). It thinks nothing
(``plans_ahead``).

Figures (medians; every ratio is of figures measured in this run):

* ``call_cpu_us``: CPU per bare call;
* ``job_cpu_ms``: CPU per job, for each kind of run (``job_wall_ms`` beside it, and
  ``job_children_cpu_ms``: the CPU of the child processes that ended during the job,
  the old way's server and the verifier; ``resource.RUSAGE_CHILDREN``);
* ``per_call_in_job_ratio``: ``(k10 - k0) / 10`` over the bare call: the worker's
  marginal CPU per tool call in a job (target: within 3x);
* ``first_call_ratio``: ``k1 - k0`` over the bare call: the first call of a job;
* ``tool_package_ms``: ``k0 - plain``: what permitting the tool costs a job that does
  not call it (the factory, the probe, the tool ledger, the tools' observations);
* ``own_first_call_ratio``: ``own_k1 - k0`` over the bare call: the old way's first
  call, in the worker's CPU; ``own_server_cpu_ms``: the CPU of the server it started
  and stopped (its children's CPU over ``k0``'s), and
  ``own_first_call_with_server_ratio``: both over the bare call;
* ``own_vs_shared_ratio``: ``own_k1 - k0`` over ``k1 - k0``, and ``own_k1`` over
  ``k1``: what starting the server in the job costs the worker;
* ``first_job_of_worker_cpu_ms``: one ``k1`` job that starts the shared server (as a
  worker's first job does; one sample).

Rounds are interleaved: every round runs a batch of bare calls and ``--jobs`` jobs of
every kind (``--own-jobs`` of the old way, whose jobs each start a server), in rotating
order, so a noisy shared machine affects all sides alike. A warm-up round (imports, the
shared server's start, Redis scripts) is not counted. Every ticket the jobs asked for is
checked to be in the servers' state at the end. ``--profile N`` adds the top N
cumulative entries of one profiled ``k10`` job (``cProfile`` on the job's thread's CPU
clock) and every thread's CPU in it.

    python benchmarks/mcp_calls.py [--rounds 6] [--jobs 4] [--calls 100] [--profile 40] --json
"""

from __future__ import annotations

import contextlib
import cProfile
import importlib
import os
import pstats
import resource
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TOOL = "create_ticket"
SERVER = [sys.executable, "-m", "ratchet.testing.mcp_server", "--sep3182"]
KINDS = ("plain", "k0", "k1", "k10", "own_k1")

# The tool package and the plan agent, installed the way pip leaves a package: a module
# and its dist-info on sys.path.
PACKAGE = "mcp_calls_tools"
PACKAGE_SOURCE = """
from ratchet.tools.mcp import MCPConnection, mcp_tools, shared_stdio

SHARED_ARGV = []
OWN_ARGV = []


def shared_tickets():
    return mcp_tools(shared_stdio(SHARED_ARGV), prefix="tk_", include=["create_ticket"])[0]


def own_tickets():
    connection = MCPConnection.stdio(OWN_ARGV).start()
    try:
        made = mcp_tools(connection, prefix="own_", include=["create_ticket"])[0]
    except BaseException:
        connection.close()
        raise
    made.close = connection.close  # the job's environment closes its tools at job end
    return made
"""
ENTRY_POINTS = f"""[ratchet.tools]
tk_create_ticket = {PACKAGE}:shared_tickets
own_create_ticket = {PACKAGE}:own_tickets
"""
AGENT = "scripted"  # its steps may name a permitted tool (completed from the tool's contract)


@contextlib.contextmanager
def _installed(folder: Path, state: Path) -> Iterator[Any]:
    """The tool package on sys.path; its servers keep their state under ``state``."""
    site = folder / "site"
    site.mkdir()
    (site / f"{PACKAGE}.py").write_text(PACKAGE_SOURCE)
    info = site / f"{PACKAGE}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    try:
        module = importlib.import_module(PACKAGE)
        module.SHARED_ARGV[:] = [*SERVER, "--state", str(state / "shared")]
        module.OWN_ARGV[:] = [*SERVER, "--state", str(state / "own")]
        yield module
    finally:
        sys.path.remove(str(site))
        sys.modules.pop(PACKAGE, None)
        importlib.invalidate_caches()


def _document(root: Path, tool: str | None, calls: int) -> Any:
    """A run that calls ``tool`` ``calls`` times, verifies (``true``) and finishes."""
    from ratchet.fleet.runs import EnvironmentSpec, RunDocument, VerifierSpec
    from ratchet.runtime import Scenario

    steps: list[dict[str, Any]] = [
        {"kind": tool, "args": {"title": f"ticket {i}", "body": "from a benchmark"}}
        for i in range(calls)
    ]
    steps += [
        {"kind": "run_verifier", "args": {"target": "unit"}},
        {"kind": "finish", "args": {"summary": "done"}},
    ]
    permissions = ["run_verifier", "finish", *([tool] if tool else [])]
    scenario = Scenario.model_validate(
        {
            "schema_version": 1,
            "task_id": "mcp-calls",
            "task_version": "1",
            "policy_id": "default",
            "policy_version": "1",
            "permissions": permissions,
            "allowed_paths": ["notes.txt"],
            "allowed_verifier_targets": ["unit"],
            "approval_required": [],
            "budgets": {"proposals": 64, "steps": 32, "wall_clock_seconds": 600, "cost_units": 0},
            "initial_files": {},
            "verifier": {"target": "unit"},
        }
    )
    root.mkdir(parents=True, exist_ok=True)
    return RunDocument(
        scenario=scenario,
        agent=AGENT,
        agent_config={"steps": steps},
        environment=EnvironmentSpec(
            root=str(root), git=False, verifiers={"unit": VerifierSpec(argv=("true",))}
        ),
    )


def _server_pids() -> set[int]:
    """This process's live tickets servers."""
    found: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        with contextlib.suppress(OSError):
            found.update(int(p) for p in (task / "children").read_text().split())
    servers = set()
    for pid in found:
        with contextlib.suppress(OSError):
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if b"ratchet.testing.mcp_server" in raw and state != "Z":
                servers.add(pid)
    return servers


def _children_cpu() -> float:
    """CPU seconds of this process's child processes that ended (and were waited for)."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of every live thread of this process, by name (threads of one name
    added up)."""
    found: dict[str, float] = {}
    for thread in threading.enumerate():
        if thread.ident is None:
            continue
        with contextlib.suppress(OSError, ValueError):
            clock = time.pthread_getcpuclockid(thread.ident)
            name = thread.name.split(" ")[0]
            found[name] = found.get(name, 0.0) + time.clock_gettime(clock)
    return found


class Bench:
    """One fleet, one tickets connection, the documents of every kind of run."""

    def __init__(self, fleet: Any, connection: Any, folder: Path) -> None:
        self.fleet = fleet
        self.connection = connection
        self.documents = {
            "plain": _document(folder / "ws-plain", None, 0),
            "k0": _document(folder / "ws-k0", "tk_create_ticket", 0),
            "k1": _document(folder / "ws-k1", "tk_create_ticket", 1),
            "k10": _document(folder / "ws-k10", "tk_create_ticket", 10),
            "own_k1": _document(folder / "ws-own", "own_create_ticket", 1),
        }
        self.count = 0
        self.asked = {"shared": 0, "own": 0}  # tickets the jobs' runs asked for

    def _asked(self, kind: str) -> None:
        if kind in ("k1", "k10"):
            self.asked["shared"] += int(kind[1:])
        elif kind == "own_k1":
            self.asked["own"] += 1

    def calls(self, count: int) -> float:
        """CPU seconds per bare call, over ``count`` calls."""
        args = {"title": "ticket", "body": "from a benchmark"}
        started = time.process_time()
        for _ in range(count):
            result = self.connection.call_tool(TOOL, args, idempotency_key=secrets.token_hex(16))
            if result.is_error:
                raise SystemExit(f"the bare {TOOL} call failed: {result.content}")
        return (time.process_time() - started) / count

    def job(
        self,
        kind: str,
        *,
        around: Callable[[Callable[[], Any]], Any] | None = None,
        fresh: bool = False,
    ) -> tuple[float, float, float]:
        """One worker job running a fresh run of ``kind``: this process's CPU seconds,
        those of the child processes that ended in it (servers stopped, the verifier) and
        its wall seconds. ``fresh``: the shared server is closed first (submit, in this
        process, used it), so the job starts it, as a worker's first job does."""
        from ratchet.ops import submit
        from ratchet.tools.mcp import close_shared
        from ratchet.worker.job import execute_run

        self.count += 1
        run_id = submit(self.fleet, self.documents[kind], run_id=f"mcp-{kind}-{self.count}")
        if fresh:
            close_shared()
        children = _children_cpu()
        wall = time.perf_counter()
        started = time.process_time()
        if around is None:
            report = execute_run(self.fleet, run_id, owner="bench-w")
        else:
            report = around(lambda: execute_run(self.fleet, run_id, owner="bench-w"))
        cpu = time.process_time() - started
        wall = time.perf_counter() - wall
        children = _children_cpu() - children
        self._asked(kind)
        if report.phase != "completed":
            raise SystemExit(
                f"run {run_id} ({kind}) ended {report.outcome} in {report.phase}: {report.detail}"
            )
        return cpu, children, wall


def _where(file: str, line: int, func: str) -> str:
    if not line:
        return func  # a built-in
    return f"{'/'.join(Path(file).parts[-2:])}:{line}:{func}"


def _profiled(bench: Bench, kind: str) -> tuple[float, dict[str, float], dict[str, Any]]:
    """One job of ``kind`` under cProfile, timed by its thread's CPU clock (what the job's
    own thread spends; waits cost nothing): its CPU, every thread's CPU in it, and the
    profile's entries by place (cumulative seconds, calls)."""
    profile = cProfile.Profile(time.thread_time)
    before = _thread_cpu()
    cpu, _, _ = bench.job(kind, around=profile.runcall)
    after = _thread_cpu()
    threads = {
        name: after[name] - before.get(name, 0.0)
        for name in sorted(after)
        if after[name] - before.get(name, 0.0) >= 0.00001
    }
    entries: dict[str, Any] = {}
    for where, row in pstats.Stats(profile).stats.items():  # type: ignore[attr-defined]
        place = _where(*where)
        cumulative, calls = entries.get(place, (0.0, 0))
        entries[place] = (cumulative + row[3], calls + row[1])
    return cpu, threads, entries


def _profile(bench: Bench, top: int) -> dict[str, Any]:
    """One profiled ``k10`` job: its top cumulative entries; and, against one profiled
    ``k0`` job, the entries that grow most per tool call (``(k10 - k0) / 10``)."""
    cpu0, _, base = _profiled(bench, "k0")
    cpu, threads, entries = _profiled(bench, "k10")
    ranked = sorted(entries.items(), key=lambda item: item[1][0], reverse=True)
    grown = sorted(
        (
            (
                (cum - base.get(place, (0.0, 0))[0]) / 10,
                (n - base.get(place, (0.0, 0))[1]) / 10,
                place,
            )
            for place, (cum, n) in entries.items()
        ),
        reverse=True,
    )
    return {
        "job_cpu_ms": round(cpu * 1000, 2),
        "k0_job_cpu_ms": round(cpu0 * 1000, 2),
        "thread_cpu_ms": {name: round(value * 1000, 2) for name, value in threads.items()},
        "top_cumulative_ms": [
            {"where": place, "ms": round(cum * 1000, 2), "calls": n}
            for place, (cum, n) in ranked[:top]
        ],
        "per_tool_call_ms": [
            {"where": place, "ms": round(cum * 1000, 3), "calls": n}
            for cum, n, place in grown[:top]
        ],
    }


def measure(*, rounds: int, jobs: int, own_jobs: int, calls: int, profile: int) -> dict[str, Any]:
    from harness import median, ratio, temp_redis
    from pydantic import SecretStr

    from ratchet.adapters.sandbox import SandboxMode
    from ratchet.fleet.context import Fleet
    from ratchet.fleet.settings import Settings
    from ratchet.leasing import RedisStore
    from ratchet.testing.mcp_server import stats
    from ratchet.tools.mcp import MCPConnection, close_shared, shared_count

    call_cpu: list[float] = []
    job_cpu: dict[str, list[float]] = {kind: [] for kind in KINDS}
    child_cpu: dict[str, list[float]] = {kind: [] for kind in KINDS}
    job_wall: dict[str, list[float]] = {kind: [] for kind in KINDS}
    extra: dict[str, Any] = {}
    with temp_redis(prefix="ratchet-mcp-calls-") as (server, folder):
        RedisStore(server.client()).identity.init_epoch()
        settings = Settings(
            redis_url=SecretStr(server.url),
            state_dir=folder / "state",
            queue=f"mcp-calls-{secrets.token_hex(3)}",
            job_timeout_s=600,
            checkpoint_key=SecretStr(secrets.token_hex(32)),
            worker_name="mcp-calls",
            verifier_sandbox=SandboxMode.NONE,
        )
        fleet = Fleet.connect(settings)
        tickets = folder / "tickets"
        bare_argv = [*SERVER, "--state", str(tickets / "bare")]
        with _installed(folder, tickets), MCPConnection.stdio(bare_argv) as connection:
            before = _server_pids()  # the bare call's server
            try:
                bench = Bench(fleet, connection, folder)
                bench.calls(max(10, calls // 5))  # warm-up: not counted
                for kind in KINDS:  # warm-up: imports, scripts, caches
                    bench.job(kind)
                # A worker's first job starts the shared server (once per worker).
                extra["first_job_of_worker_cpu_ms"] = round(
                    bench.job("k1", fresh=True)[0] * 1000, 2
                )
                for r in range(rounds):
                    call_cpu.append(bench.calls(calls))
                    order = KINDS[r % len(KINDS) :] + KINDS[: r % len(KINDS)]
                    for kind in order:
                        for _ in range(own_jobs if kind == "own_k1" else jobs):
                            cpu, children, wall = bench.job(kind)
                            job_cpu[kind].append(cpu)
                            child_cpu[kind].append(children)
                            job_wall[kind].append(wall)
                if profile:
                    extra["profile_k10"] = _profile(bench, profile)
                extra["shared_connections"] = shared_count()
                for name, asked in bench.asked.items():
                    made = stats(tickets / name).effects
                    if made != asked:
                        raise SystemExit(f"the {name} server made {made} tickets, not {asked}")
                extra["tickets_made"] = dict(bench.asked)
                # Every job of the old way closed its server: none is left but the shared
                # one (and the bare call's).
                extra["servers_left_by_jobs"] = len(_server_pids() - before) - shared_count()
            finally:
                close_shared()
                for pid in _server_pids() - before:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
    call = median(call_cpu)
    # Each round's k0 and k10 jobs against its own bare calls.
    paired = [
        (
            median(job_cpu["k10"][r * jobs : (r + 1) * jobs])
            - median(job_cpu["k0"][r * jobs : (r + 1) * jobs])
        )
        / 10
        / call_cpu[r]
        for r in range(rounds)
    ]
    cpu = {kind: median(values) for kind, values in job_cpu.items()}
    per_call = (cpu["k10"] - cpu["k0"]) / 10
    first = cpu["k1"] - cpu["k0"]
    own_first = cpu["own_k1"] - cpu["k0"]
    children = {kind: median(values) for kind, values in child_cpu.items()}
    server = children["own_k1"] - children["k0"]  # the job's own server, for its life
    return {
        "call_cpu_us": round(call * 1e6, 1),
        "job_cpu_ms": {kind: round(value * 1000, 2) for kind, value in cpu.items()},
        "per_call_in_job_cpu_us": round(per_call * 1e6, 1),
        "per_call_in_job_ratio": ratio(per_call, call, 2),
        "per_call_in_job_ratio_by_round": [round(value, 2) for value in paired],
        "per_call_in_job_ratio_median_of_rounds": round(median(paired), 2),
        "first_call_cpu_us": round(first * 1e6, 1),
        "first_call_ratio": ratio(first, call, 2),
        "tool_package_ms": round((cpu["k0"] - cpu["plain"]) * 1000, 2),
        "own_first_call_cpu_us": round(own_first * 1e6, 1),
        "own_first_call_ratio": ratio(own_first, call, 1),
        "own_vs_shared_ratio": {
            "first_call": ratio(own_first, first, 1),
            "job": ratio(cpu["own_k1"], cpu["k1"], 2),
        },
        "job_children_cpu_ms": {kind: round(value * 1000, 2) for kind, value in children.items()},
        "own_server_cpu_ms": round(server * 1000, 2),
        "own_first_call_with_server_ratio": ratio(own_first + server, call, 0),
        "job_wall_ms": {kind: round(median(vs) * 1000, 2) for kind, vs in job_wall.items()},
        "rounds": rounds,
        "jobs_per_round": {kind: own_jobs if kind == "own_k1" else jobs for kind in KINDS},
        "calls_per_round": calls,
        "call_cpu_us_by_round": [round(v * 1e6, 1) for v in call_cpu],
        "job_cpu_ms_by_kind": {k: [round(v * 1000, 2) for v in vs] for k, vs in job_cpu.items()},
        **extra,
    }


def _print_table(report: dict[str, Any]) -> None:
    from harness import print_table

    jobs, children, walls = (
        report["job_cpu_ms"],
        report["job_children_cpu_ms"],
        report["job_wall_ms"],
    )
    call = report["call_cpu_us"]
    rows = [("bare call_tool", f"{call} us", "1.0", "", "")]
    rows += [
        (
            f"job {kind}",
            f"{jobs[kind]} ms",
            f"{jobs[kind] * 1000 / call:.1f}",
            f"{children[kind]} ms",
            f"{walls[kind]} ms",
        )
        for kind in KINDS
    ]
    derived = [
        ("per call in a job: (k10 - k0) / 10", "per_call_in_job_cpu_us", "per_call_in_job_ratio"),
        ("first call in a job: k1 - k0", "first_call_cpu_us", "first_call_ratio"),
        ("old way, first call: own_k1 - k0", "own_first_call_cpu_us", "own_first_call_ratio"),
    ]
    rows += [(label, f"{report[us]} us", str(report[x]), "", "") for label, us, x in derived]
    rows += [
        (
            "old way, first call + its server's CPU",
            f"{report['own_first_call_cpu_us'] / 1000 + report['own_server_cpu_ms']:.2f} ms",
            str(report["own_first_call_with_server_ratio"]),
            "",
            "",
        ),
        ("tool permitted, not called: k0 - plain", f"{report['tool_package_ms']} ms", "", "", ""),
        (
            "first job of a worker (k1, starts the server)",
            f"{report['first_job_of_worker_cpu_ms']} ms",
            "",
            "",
            "",
        ),
    ]
    shared = report["own_vs_shared_ratio"]
    print_table(
        "Worker CPU per MCP tool call, against the call itself (one run)",
        ("measure", "worker CPU", "x bare call", "children's CPU", "wall"),
        rows,
        caption=(
            f"medians of {report['rounds']} rounds; old way over shared: first call "
            f"{shared['first_call']}x, job {shared['job']}x; servers left by jobs: "
            f"{report['servers_left_by_jobs']}"
        ),
    )
    found = report.get("profile_k10")
    if found:
        print(
            f"one k10 job under cProfile: {found['job_cpu_ms']} ms CPU (one k0 job: "
            f"{found['k0_job_cpu_ms']} ms); by thread (ms): {found['thread_cpu_ms']}"
        )
        print("top cumulative CPU of the k10 job's thread (ms, calls, where):")
        for row in found["top_cumulative_ms"]:
            print(f"{row['ms']:>9.2f} {row['calls']:>6}  {row['where']}")
        print("what grows per tool call, (k10 - k0) / 10 (ms, calls, where):")
        for row in found["per_tool_call_ms"]:
            print(f"{row['ms']:>9.3f} {row['calls']:>6.1f}  {row['where']}")


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(HERE))
    from harness import emit, parse_args, parser

    cli = parser(__doc__)
    cli.add_argument("--rounds", type=int, default=6, help="interleaved rounds")
    cli.add_argument("--jobs", type=int, default=4, help="jobs of each kind per round")
    cli.add_argument("--own-jobs", type=int, default=1, help="old-way jobs per round")
    cli.add_argument("--calls", type=int, default=100, help="bare calls per round")
    cli.add_argument(
        "--profile", type=int, default=0, help="profile a k10 and a k0 job: top N rows"
    )
    args = parse_args(cli, argv, quick="smoke run: 2 rounds of 1 job per kind, 20 calls")
    if args.quick:
        args.rounds, args.jobs, args.own_jobs, args.calls = 2, 1, 1, 20
    if not (
        1 <= args.rounds <= 40
        and 1 <= args.jobs <= 50
        and 1 <= args.own_jobs <= 10
        and 10 <= args.calls <= 2000
        and 0 <= args.profile <= 200
    ):
        cli.error(
            "--rounds 1..40, --jobs 1..50, --own-jobs 1..10, --calls 10..2000, --profile 0..200"
        )
    with contextlib.redirect_stdout(sys.stderr):
        report = measure(
            rounds=args.rounds,
            jobs=args.jobs,
            own_jobs=args.own_jobs,
            calls=args.calls,
            profile=args.profile,
        )
    emit(report, as_json=args.json, table=_print_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
