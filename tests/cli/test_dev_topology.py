"""``ratchet dev topology replicated | cluster``: real servers on loopback, started as a
user would, reachable at the address the first line names, all gone after SIGTERM or
SIGINT; bad input is one line and exit code 2, and starts nothing."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.cluster import ClusterNode, RedisCluster
from typer.testing import CliRunner

from ratchet.cli import app
from ratchet.fleet.redisurl import parse_sentinel_url, redis_client
from ratchet.redis_server import RedisServer, free_port
from tests.worker.fleet_harness import poll

RATCHET = [sys.executable, "-m", "ratchet.cli.entry"]
runner = CliRunner()


def redis_processes_under(folder: Path, parent: int | None = None) -> list[int]:
    """Pids of live redis-server processes (servers, Sentinels and their forks) working in
    ``folder`` or below: each changes into its own data folder and rewrites its command
    line. ``parent``: only its children (a server's fork for a replica's sync or an AOF
    rewrite is not one)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
            state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            cwd = Path(os.readlink(entry / "cwd"))
        except OSError:
            continue
        if parent is not None and int(ppid) != parent:
            continue
        if comm.startswith("redis-server") and state != "Z" and cwd.is_relative_to(folder):
            pids.append(int(entry.name))
    return pids


def first_line(proc: subprocess.Popen[bytes], log: Path, deadline_s: float) -> str:
    """The command's first line of stdout, within the deadline."""
    assert proc.stdout is not None
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        readable, _, _ = select.select([proc.stdout], [], [], 0.1)
        if readable:
            line = proc.stdout.readline().decode()
            if line:
                return line
            code = proc.wait(timeout=30)
            raise AssertionError(f"exit {code} before printing: {log.read_text(errors='replace')}")
    raise AssertionError("the command printed nothing in time")


@contextmanager
def topology_command(args: list[str], folder: Path, log: Path) -> Iterator[tuple[Any, ...]]:
    """Run ``ratchet dev topology ARGS --dir FOLDER --json``; yields the process and its
    report. Whatever the test's outcome, nothing it started is left running."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [*RATCHET, "dev", "topology", *args, "--dir", str(folder), "--json"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
        )
    try:
        line = first_line(proc, log, deadline_s=90)
        yield proc, json.loads(line)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        assert proc.stdout is not None
        proc.stdout.close()
        for pid in redis_processes_under(folder):
            os.kill(pid, signal.SIGKILL)


def refuses_connections(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


def stops_cleanly(
    proc: subprocess.Popen[bytes], signum: int, folder: Path, addresses: list[str], log: Path
) -> None:
    proc.send_signal(signum)
    assert proc.wait(timeout=60) == 0, log.read_text(errors="replace")
    assert proc.stdout is not None
    assert proc.stdout.read() == b""  # --json: exactly one object on stdout
    poll(lambda: redis_processes_under(folder) == [], deadline_s=10, what="no server left")
    assert all(refuses_connections(a) for a in addresses)


@pytest.mark.slow
def test_replicated_prints_a_sentinel_url_whose_primary_replicates_and_stops_on_sigterm(
    tmp_path: Path,
) -> None:
    folder, log = tmp_path / "replicated", tmp_path / "command.log"
    with topology_command(["replicated", "--sentinels", "3"], folder, log) as (proc, report):
        assert report["topology"] == "replicated"
        target = parse_sentinel_url(report["redis_url"])
        assert target.service == report["service"] == "ratchet"
        assert [f"{h}:{p}" for h, p in target.sentinels] == report["sentinels"]
        assert len(target.sentinels) == 3
        assert report["quorum"] == 2
        assert len(report["replicas"]) == 1
        # One primary, one replica and three Sentinels, all working under --dir.
        assert len(redis_processes_under(folder, parent=proc.pid)) == 5

        client = redis_client(report["redis_url"], socket_timeout=5, socket_connect_timeout=2)
        try:
            assert client.ping() is True
            info = client.info("replication")
            assert info["role"] == "master"
            assert (
                f"127.0.0.1:{client.connection_pool.get_master_address()[1]}" == (report["primary"])
            )
            replica_port = int(report["replicas"][0].rsplit(":", 1)[1])
            poll(
                lambda: any(
                    v.get("port") == replica_port and v.get("state") == "online"
                    for k, v in client.info("replication").items()
                    if k.startswith("slave") and isinstance(v, dict)
                ),
                deadline_s=30,
                what="the replica online at the primary",
            )
            # A write through the URL reaches the replica: WAIT counts it.
            client.set("dev-topology-probe", b"1")
            assert client.execute_command("WAIT", 1, 5000) == 1
        finally:
            client.close()
        replica = redis.Redis(host="127.0.0.1", port=replica_port, socket_timeout=5)
        try:
            assert replica.info("replication")["role"] == "slave"
            assert replica.get("dev-topology-probe") == b"1"
        finally:
            replica.close()

        addresses = [report["primary"], *report["replicas"], *report["sentinels"]]
        stops_cleanly(proc, signal.SIGTERM, folder, addresses, log)


@pytest.mark.slow
@pytest.mark.cluster
def test_cluster_prints_its_nodes_which_serve_every_slot_and_stops_on_sigint(
    tmp_path: Path,
) -> None:
    folder, log = tmp_path / "cluster", tmp_path / "command.log"
    with topology_command(["cluster"], folder, log) as (proc, report):
        assert report["topology"] == "cluster"
        assert report["masters"] == 3
        nodes = report["nodes"]
        assert len(nodes) == len(set(nodes)) == 3
        assert len(redis_processes_under(folder, parent=proc.pid)) == 3
        startup = [ClusterNode(n.rsplit(":", 1)[0], int(n.rsplit(":", 1)[1])) for n in nodes]
        client = RedisCluster(startup_nodes=startup, socket_timeout=5)
        try:
            info = client.cluster_info()
            assert info["cluster_state"] == "ok"
            assert int(info["cluster_slots_assigned"]) == 16384
            assert int(info["cluster_known_nodes"]) == 3
            for key in ("{a}probe", "{b}probe", "{c}probe"):
                client.set(key, b"1")
                assert client.get(key) == b"1"
        finally:
            client.close()
        stops_cleanly(proc, signal.SIGINT, folder, nodes, log)


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["replicated", "--sentinels", "0"], "--sentinels"),
        (["replicated", "--replicas", "0"], "--replicas"),
        (["replicated", "--sentinels", "10"], "--sentinels"),
        (["cluster", "--masters", "2"], "--masters"),
    ],
)
def test_a_bad_count_is_one_typed_line_with_exit_2_and_starts_nothing(
    tmp_path: Path, args: list[str], option: str
) -> None:
    folder = tmp_path / "topology"
    result = runner.invoke(app, ["dev", "topology", *args, "--dir", str(folder)])
    assert result.exit_code == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("ratchet: error: ")
    assert f"(field: {option})" in lines[0]
    assert "Traceback" not in result.stderr
    assert not folder.exists()  # refused before anything was created or started


@pytest.mark.parametrize("kind", ["replicated", "cluster"])
def test_a_folder_that_holds_anything_is_refused_with_exit_2(tmp_path: Path, kind: str) -> None:
    folder = tmp_path / "topology"
    folder.mkdir()
    (folder / "appendonly.aof").write_text("left over")
    result = runner.invoke(app, ["dev", "topology", kind, "--dir", str(folder)])
    assert result.exit_code == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith("ratchet: error: ") and "not empty" in line
    assert "(field: --dir)" in line
    assert sorted(p.name for p in folder.iterdir()) == ["appendonly.aof"]


@pytest.mark.slow
def test_the_console_script_path_gives_the_same_one_line_error(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    done = subprocess.run(
        [
            *RATCHET,
            "dev",
            "topology",
            "replicated",
            "--dir",
            str(tmp_path / "t"),
            "--sentinels",
            "0",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        "ratchet: error: --sentinels must be between 1 and 9, not 0 (field: --sentinels)"
    ]


def test_a_cluster_node_gets_a_port_its_bus_port_can_follow() -> None:
    """Redis refuses a cluster node whose port + 10000 is not a port; the kernel's
    ephemeral range goes past 55535, so a cluster server picks its port with that in mind
    (about 2 % of three-node cluster start-ups failed before)."""
    for _ in range(200):
        assert 0 < free_port(cluster=True) <= 65535 - 10000
        assert RedisServer(Path("unused"), cluster=True).port <= 65535 - 10000
