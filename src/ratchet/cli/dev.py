"""``ratchet dev topology replicated | cluster``: a many-server Redis on this machine's
loopback, without Docker, for development, the docs and drills.

Each command starts real ``redis-server`` processes under ``--dir`` (which must be empty
or absent: a topology starts fresh), prints what the fleet is given on its first line of
stdout (``--json``: one JSON object), and stays in the foreground until SIGINT or SIGTERM;
then it stops every process it started and exits 0. SIGKILL leaves them running (they
work under ``--dir``).

* ``replicated``: a primary, ``--replicas`` replicas (``--replicaof`` the primary) and
  ``--sentinels`` Sentinels that monitor it as service ``ratchet`` with a majority quorum
  (:class:`ratchet.testing.sentinel.LocalReplicated`); every server AOF ``always``. The
  first line is the ``redis+sentinel://`` URL for ``RATCHET_REDIS_URL``.
* ``cluster``: a Redis Cluster of ``--masters`` masters, no replicas, AOF ``always``
  (:class:`ratchet.testing.cluster.LocalCluster`). The first line is its nodes'
  addresses (a cluster client's start-up nodes).
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Annotated, Any

import typer

from ratchet.cli.common import JsonFlag, app, print_json, ratchet_errors
from ratchet.errors import ConfigurationError
from ratchet.redis_server import LOOPBACK, RedisServer
from ratchet.testing.cluster import LocalCluster
from ratchet.testing.sentinel import SERVICE, LocalReplicated

__all__: list[str] = []

MAX_REPLICAS = 8
MAX_SENTINELS = 9
MAX_MASTERS = 16

dev_app = typer.Typer(
    help="Set-ups for development and drills on this machine.", no_args_is_help=True
)
topology_app = typer.Typer(
    help="A many-server Redis on loopback, in the foreground until SIGINT or SIGTERM.",
    no_args_is_help=True,
)
dev_app.add_typer(topology_app, name="topology")
app.add_typer(dev_app, name="dev")

DirOption = Annotated[
    Path,
    typer.Option("--dir", help="Folder for the servers' data and logs (created; must be empty)."),
]


class _Stop(BaseException):
    """SIGINT or SIGTERM arrived (a BaseException, like KeyboardInterrupt, so that no
    ``except Exception`` on the way swallows it)."""


def _check_count(value: int, option: str, low: int, high: int) -> None:
    if not low <= value <= high:
        raise ConfigurationError(
            f"{option} must be between {low} and {high}, not {value}", field=option
        )


def _fresh_folder(folder: Path) -> Path:
    """``folder`` made absolute and created; refused when it holds anything (old data
    files or configs would bring back another topology's state). Raises
    ConfigurationError."""
    folder = folder.expanduser().resolve()
    if folder.exists() and not folder.is_dir():
        raise ConfigurationError(f"{folder} is not a folder", field="--dir")
    if folder.is_dir() and any(folder.iterdir()):
        raise ConfigurationError(
            f"{folder} is not empty; a topology starts in an empty folder", field="--dir"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigurationError(
            f"cannot create {folder}: {exc.strerror or exc}", field="--dir"
        ) from None
    return folder


def _address(server: RedisServer) -> str:
    return f"{LOOPBACK}:{server.port}"


def _run_until_stopped(
    start: Callable[[], object], ready: Callable[[], None], stop: Callable[[], None]
) -> None:
    """Start, report, wait for SIGINT or SIGTERM, stop. A signal during start-up stops
    what was started too; a start-up error stops it and propagates."""

    def on_signal(signum: int, frame: FrameType | None) -> None:
        raise _Stop(signum)

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        signal.signal(sig, on_signal)
    try:
        try:
            start()
            ready()
            while True:
                signal.pause()
        except _Stop:
            pass
        finally:
            for sig in previous:  # a second signal must not cut the clean-up short
                signal.signal(sig, signal.SIG_IGN)
            stop()
    finally:
        for sig, handler in previous.items():
            if handler is not None:  # None: not installed from Python, nothing to restore
                signal.signal(sig, handler)


@topology_app.command("replicated")
@ratchet_errors
def replicated(
    folder: DirOption,
    replicas: Annotated[int, typer.Option(help=f"Replicas (1 to {MAX_REPLICAS}).")] = 1,
    sentinels: Annotated[
        int, typer.Option(help=f"Sentinels (1 to {MAX_SENTINELS}; quorum: a majority).")
    ] = 3,
    as_json: JsonFlag = False,
) -> None:
    """A primary, its replicas and Sentinels on loopback (AOF always). Prints the
    redis+sentinel:// URL for RATCHET_REDIS_URL, then runs until SIGINT or SIGTERM."""
    _check_count(replicas, "--replicas", 1, MAX_REPLICAS)
    _check_count(sentinels, "--sentinels", 1, MAX_SENTINELS)
    base = _fresh_folder(folder)
    topology = LocalReplicated(base, replicas=replicas, sentinels=sentinels)

    def ready() -> None:
        report: dict[str, Any] = {
            "topology": "replicated",
            "redis_url": topology.url,
            "service": SERVICE,
            "primary": _address(topology.primary),
            "replicas": [_address(s) for s in topology.replicas],
            "sentinels": [f"{LOOPBACK}:{s.port}" for s in topology.sentinels],
            "quorum": topology.sentinels[0].quorum,
            "dir": str(base),
        }
        if as_json:
            print_json(report)
            return
        typer.echo(topology.url)
        typer.echo(
            f"primary {report['primary']}, replicas {', '.join(report['replicas'])}; "
            f"{sentinels} Sentinels (quorum {report['quorum']}) monitor it as "
            f"service {SERVICE!r}; data in {base}. Give the fleet the URL above as "
            f"RATCHET_REDIS_URL, with RATCHET_MIN_REPLICAS_ACK at most {replicas}. "
            "Ctrl-C or SIGTERM stops them all.",
            err=True,
        )

    def stop() -> None:
        for sentinel in topology.sentinels:  # first: no failover while servers stop
            sentinel.stop()
        for server in reversed(topology.servers):  # the replicas, then the first primary
            server.stop()
        if not as_json:
            typer.echo("stopped", err=True)

    _run_until_stopped(topology.start, ready, stop)


@topology_app.command("cluster")
@ratchet_errors
def cluster(
    folder: DirOption,
    masters: Annotated[int, typer.Option(help=f"Masters (3 to {MAX_MASTERS}).")] = 3,
    as_json: JsonFlag = False,
) -> None:
    """A Redis Cluster of masters on loopback, no replicas (AOF always). Prints its
    nodes' addresses, then runs until SIGINT or SIGTERM."""
    _check_count(masters, "--masters", 3, MAX_MASTERS)
    base = _fresh_folder(folder)
    topology = LocalCluster(base, masters=masters, appendfsync="always")

    def ready() -> None:
        nodes = [_address(s) for s in topology.servers]
        if as_json:
            print_json(
                {"topology": "cluster", "nodes": nodes, "masters": masters, "dir": str(base)}
            )
            return
        typer.echo(",".join(nodes))
        typer.echo(
            f"a Redis Cluster of {masters} masters, no replicas, every slot assigned; "
            f"data in {base}. Ctrl-C or SIGTERM stops them all.",
            err=True,
        )

    def stop() -> None:
        topology.stop()
        if not as_json:
            typer.echo("stopped", err=True)

    _run_until_stopped(topology.start, ready, stop)
