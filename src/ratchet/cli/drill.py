"""``ratchet drill``: a chaos drill against real workers, Redis and adapters."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from types import FrameType
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ratchet.chaos.drill.hostplan import (
    ENVIRONMENTS,
    GIT_HOST_FAULTS,
    HOST_FAULTS,
    HostDrillOptions,
    parse_host_faults,
)
from ratchet.chaos.drill.hostreport import render_hosts
from ratchet.chaos.drill.hosts import run_host_drill
from ratchet.chaos.drill.report import render, run_drill
from ratchet.chaos.drill.runner import DrillOptions
from ratchet.chaos.drill.schedule import FAULTS, parse_faults
from ratchet.cli.common import EXIT_CHECK_FAILED, JsonFlag, app, print_json, ratchet_errors
from ratchet.errors import ConfigurationError
from ratchet.worker.signals import outside_finalisers

__all__: list[str] = []


@app.command()
@ratchet_errors
def drill(
    workers: Annotated[int, typer.Option(min=2, max=32, help="Worker processes.")] = 3,
    runs: Annotated[int, typer.Option(min=1, max=5000, help="Runs to submit.")] = 32,
    lease_ttl: Annotated[
        float, typer.Option("--lease-ttl", min=0.2, max=60.0, help="Lease TTL in seconds.")
    ] = 1.0,
    duration: Annotated[
        float,
        typer.Option(
            min=5.0,
            max=24 * 3600.0,
            help="At most this many seconds of faults; then the runs left settle.",
        ),
    ] = 240.0,
    faults: Annotated[
        str, typer.Option(help=f"'all' or a comma list of: {', '.join(FAULTS)}")
    ] = "all",
    seed: Annotated[int, typer.Option(help="Seed of the fault schedule.")] = 1,
    think_ms: Annotated[
        int, typer.Option("--think-ms", min=0, max=10_000, help="Agent latency before each step.")
    ] = 150,
    folder: Annotated[
        Path | None,
        typer.Option("--dir", help="Drill folder (kept); default: a new temporary folder."),
    ] = None,
    redis_server: Annotated[
        str | None,
        typer.Option(
            "--redis-server", help="redis-server binary (7.0+ enables the rollback fault)."
        ),
    ] = None,
    topology: Annotated[
        str,
        typer.Option(
            help="single: one Redis (every fault); replicated: a primary, a replica and "
            "three Sentinels, redis-kill is a failover; cluster: three masters and the "
            "queue's own Redis, redis-kill crashes and restarts a master (on both: worker "
            "faults, duplicate-enqueue, cancel and redis-kill only)."
        ),
    ] = "single",
    min_replicas_ack: Annotated[
        int,
        typer.Option(
            "--min-replicas-ack",
            min=0,
            max=16,
            help="The fleet's RATCHET_MIN_REPLICAS_ACK (replicated topology).",
        ),
    ] = 0,
    hosts: Annotated[
        int,
        typer.Option(
            min=1,
            max=8,
            help="Hosts (2 or more: the multi-host drill, root only: each host a mount and "
            "UTS namespace with its own disk; --workers is then per host, --faults are "
            f"{', '.join(HOST_FAULTS)}).",
        ),
    ] = 1,
    host_losses: Annotated[
        int | None,
        typer.Option(
            "--host-losses", min=0, max=64, help="With --hosts: hosts lost (default N - 1)."
        ),
    ] = None,
    environment: Annotated[
        str,
        typer.Option(
            "--environment",
            help=f"With --hosts: where the runs' files live ({' or '.join(ENVIRONMENTS)}). "
            "folder: a workspace on its host's disk, bound to that host; git: a branch of "
            "one shared git remote, bound to no host (--faults then: "
            f"{', '.join(GIT_HOST_FAULTS)}).",
        ),
    ] = "folder",
    as_json: JsonFlag = False,
) -> None:
    """Start Redis, the orders service and worker processes, inject faults from a seeded
    schedule (SIGKILL at every failpoint, zombies past their lease, dropped replies,
    Redis kill -9 and rollback, duplicate enqueues), then check from the adapters' own
    records that nothing was duplicated, lost or accepted stale. Exits 0 only on pass.
    With --hosts N (N >= 2) the fleet runs on N simulated hosts, which are lost whole and
    brought back (docs/drills.md, "Many hosts"); with --environment git each run's files
    live on its own branch of one git remote, and the git server is killed mid-push."""
    os.environ.setdefault("RATCHET_LOG_LEVEL", "WARNING")
    _stop_on_sigterm()
    if environment != "folder" and hosts < 2:
        raise ConfigurationError(
            "--environment is an option of the multi-host drill (--hosts 2 or more)",
            field="environment",
        )
    if hosts > 1 or host_losses is not None:
        if topology != "single" or min_replicas_ack:
            raise ConfigurationError(
                "--hosts runs on a single Redis (no --topology, no --min-replicas-ack)",
                field="topology",
            )
        host_options = HostDrillOptions(
            hosts=hosts,
            workers=workers,
            runs=runs,
            lease_ttl_s=lease_ttl,
            duration_s=duration,
            faults=parse_host_faults(faults, environment),
            seed=seed,
            folder=folder,
            think_ms=think_ms,
            redis_server=redis_server,
            host_losses=host_losses,
            environment=environment,
        )
        _drill_hosts(host_options, as_json)
        return
    options = DrillOptions(
        workers=workers,
        runs=runs,
        lease_ttl_s=lease_ttl,
        duration_s=duration,
        faults=parse_faults(faults),
        seed=seed,
        folder=folder,
        think_ms=think_ms,
        redis_server=redis_server,
        topology=topology,
        min_replicas_ack=min_replicas_ack,
    )
    if as_json:
        report = run_drill(options)
        print_json(report)
    else:
        console = Console(stderr=True)
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        ) as bar:
            task = bar.add_task("drill", total=runs)

            def update(label: str, settled: int, total: int) -> None:
                bar.update(task, description=f"drill: {label}", completed=settled, total=total)

            report = run_drill(options, progress=update)
        render(report, Console())
    if report["verdict"] != "pass":
        raise typer.Exit(EXIT_CHECK_FAILED)


def _drill_hosts(options: HostDrillOptions, as_json: bool) -> None:
    """The multi-host drill (ratchet.chaos.drill.hosts). Raises typer.Exit unless it
    passed."""
    if as_json:
        report = run_host_drill(options)
        print_json(report)
    else:
        console = Console(stderr=True)
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        ) as bar:
            task = bar.add_task("drill --hosts", total=options.runs)

            def update(label: str, settled: int, total: int) -> None:
                bar.update(task, description=f"drill: {label}", completed=settled, total=total)

            report = run_host_drill(options, progress=update)
        render_hosts(report, Console())
    if report["verdict"] != "pass":
        raise typer.Exit(EXIT_CHECK_FAILED)


def _stop_on_sigterm() -> None:
    """SIGTERM ends a drill as Ctrl-C does: every process it started is stopped and every
    tmpfs it mounted (Redis' folder, the workspaces) unmounted before it exits."""

    def stop(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the clean-up
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, outside_finalisers(stop))


@app.command()
@ratchet_errors
def sim(
    schedules: Annotated[
        int, typer.Option(min=1, max=100_000_000, help="How many seeded schedules to explore.")
    ] = 1000,
    seed: Annotated[int, typer.Option(min=0, help="The first seed (or the one replayed).")] = 0,
    schedule: Annotated[
        str | None,
        typer.Option(help="Replay this (minimised) schedule in the world of --seed."),
    ] = None,
    processes: Annotated[
        int, typer.Option(min=1, max=64, help="Processes exploring in parallel.")
    ] = 1,
    keep_going: Annotated[
        bool, typer.Option("--keep-going", help="Explore on past the first failure.")
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """The deterministic simulator: the real runtime and Lua scripts, simulated workers,
    adapters, clocks and crashes, every schedule drawn from one seed, every invariant
    checked after every step. A failure prints its seed and a minimised schedule that
    ``--seed N --schedule '...'`` replays. Exits 0 only when every invariant held."""
    from ratchet.chaos.sim.__main__ import main as sim_main  # noqa: PLC0415 - lupa, lazily

    argv = ["--seed", str(seed), "--schedules", str(schedules), "--processes", str(processes)]
    if schedule is not None:
        argv += ["--schedule", schedule]
    if keep_going:
        argv.append("--keep-going")
    if as_json:
        argv.append("--json")
    code = sim_main(argv)
    if code != 0:
        raise typer.Exit(code)
