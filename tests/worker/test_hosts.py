"""Many hosts: runs whose workspace is on one host's disk go to that host, and wait for it.

Each host is a mount and UTS namespace (as root): its own disk bound at the same path
(``/…/disk``) and its own host name, with real ``ratchet worker`` processes inside and one
real redis-server for the fleet. Before hosts were recorded, a job that landed on another
host froze the run (``workspace root is not a directory``); a host lost mid-run stranded
its runs on the other host's reaper.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from ratchet.demo.examples import RIGHT_GREETING, greeting_scenario, make_greeting_workspace
from ratchet.fleet.context import Fleet
from ratchet.fleet.settings import Settings
from ratchet.ops import inspect_run
from ratchet.redis_server import RedisServer
from tests.conftest import test_sandbox_mode
from tests.worker.conftest import CHECKPOINT_KEY_HEX
from tests.worker.fleet_harness import poll

pytestmark = pytest.mark.slow

RATCHET = [sys.executable, "-m", "ratchet.cli.entry"]


def _namespaces_usable() -> str | None:
    if os.geteuid() != 0:
        return "hosts are mount and UTS namespaces: the test needs root"
    for tool in ("unshare", "nsenter", "mount", "hostname"):
        if shutil.which(tool) is None:
            return f"{tool} (util-linux) is not installed"
    return None


class Host:
    """A simulated host: its own mount and UTS namespace, its disk (``backing``, a folder
    of the test's) bound at ``mountpoint``, and the processes started in it."""

    def __init__(self, name: str, backing: Path, mountpoint: Path, env: dict[str, str]) -> None:
        self.name = name
        self.backing = backing
        self.mountpoint = mountpoint
        self.env = env
        self.holder: subprocess.Popen[bytes] | None = None
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> Host:
        self.backing.mkdir(parents=True, exist_ok=True)
        script = (
            f"mount --bind {self.backing} {self.mountpoint} && hostname {self.name} "
            "&& exec sleep 3600"
        )
        self.holder = subprocess.Popen(
            ["unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c", script]
        )
        poll(
            lambda: self.run(["hostname"]).stdout.strip() == self.name,
            deadline_s=30,
            what=f"host {self.name} is up",
        )
        return self

    def _enter(self) -> list[str]:
        """nsenter into the host, its working directory the host's disk (a cwd set before
        entering would be the folder under the mount, not the host's disk)."""
        if self.holder is None:
            raise AssertionError("the host is not started")
        pid = str(self.holder.pid)
        # nsenter's --wd resolves its folder before it enters: cd inside instead.
        into = ["sh", "-c", 'cd "$0" && exec "$@"', str(self.mountpoint)]
        return ["nsenter", "-t", pid, "-m", "-u", "--", *into]

    def run(self, argv: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self._enter(), *argv],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    def ratchet(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.run([*RATCHET, *args])

    def start_workers(self, log: Path) -> None:
        with log.open("ab") as out:
            self.procs.append(
                subprocess.Popen(
                    [*self._enter(), *RATCHET, "worker", "--concurrency", "1"],
                    env=self.env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=out,
                    start_new_session=True,
                )
            )

    def lose(self) -> None:
        """Every process of the host SIGKILLed (each process in its mount namespace: the
        pool's worker processes lead groups of their own), its namespace and mount gone."""
        if self.holder is None:
            return
        namespace = os.readlink(f"/proc/{self.holder.pid}/ns/mnt")
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if os.readlink(f"/proc/{entry}/ns/mnt") == namespace:
                    os.kill(int(entry), signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
        for proc in (*self.procs, self.holder):
            proc.wait(timeout=30)
        self.procs.clear()
        self.holder = None


@pytest.fixture
def hosts(redis_server: RedisServer, tmp_path: Path) -> Iterator[dict[str, Host]]:
    reason = _namespaces_usable()
    if reason is not None:
        pytest.skip(reason)
    mountpoint = tmp_path / "disk"
    mountpoint.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env.update(
        RATCHET_REDIS_URL=redis_server.url,
        RATCHET_CHECKPOINT_KEY=CHECKPOINT_KEY_HEX,
        RATCHET_QUEUE=f"hosts-{tmp_path.name}",
        RATCHET_LEASE_TTL_MS="1500",
        RATCHET_REAPER_INTERVAL_MS="200",
        RATCHET_PICKUP_TIMEOUT_MS="3000",
        RATCHET_HOST_TIMEOUT_MS="2000",
        RATCHET_LOG_LEVEL="INFO",
        # The verifier is the example's own test: bubblewrap where it works, else the
        # explicit opt-out.
        RATCHET_VERIFIER_SANDBOX=test_sandbox_mode().value,
    )
    made = {
        name: Host(name, tmp_path / f"disk-of-{name}", mountpoint, env).start()
        for name in ("host-a", "host-b")
    }
    try:
        yield made
    finally:
        for host in made.values():
            host.lose()


def submit_on(host: Host, name: str, *, think_ms: int = 0) -> str:
    """A greeting run whose workspace is on ``host``'s disk, submitted there."""
    make_greeting_workspace(host.backing / name)
    task = {
        "scenario": greeting_scenario().model_dump(mode="json"),
        "environment": {
            "root": name,
            "verifiers": {"unit": {"argv": [sys.executable, "test_app.py"]}},
        },
        "agent_config": {"think_ms": think_ms},
    }
    (host.backing / f"{name}.yaml").write_text(yaml.safe_dump(task))
    done = host.ratchet("submit", f"{name}.yaml", "--agent", "greeting", "--json")
    assert done.returncode == 0, done.stderr
    return str(json.loads(done.stdout)["run_id"])


def fleet_of(redis_server: RedisServer, env: dict[str, str]) -> Fleet:
    return Fleet.connect(
        Settings.model_validate(
            {
                "redis_url": redis_server.url,
                "checkpoint_key": CHECKPOINT_KEY_HEX,
                "queue": env["RATCHET_QUEUE"],
                "host_timeout_ms": 2000,
            }
        )
    )


def phase(fleet: Fleet, run_id: str) -> str:
    return inspect_run(fleet, run_id).state.phase.value


def test_runs_submitted_on_two_hosts_each_complete_on_their_own_host(
    hosts: dict[str, Host], redis_server: RedisServer, tmp_path: Path
) -> None:
    a, b = hosts["host-a"], hosts["host-b"]
    runs = {submit_on(a, f"ws-a-{i}"): (a, f"ws-a-{i}") for i in range(4)}
    runs |= {submit_on(b, f"ws-b-{i}"): (b, f"ws-b-{i}") for i in range(4)}
    fleet = fleet_of(redis_server, a.env)
    for run_id, (host, _) in runs.items():
        view = inspect_run(fleet, run_id)
        assert view.document.environment.host == host.name  # signed at submit
        assert fleet.store.hosts.run_host(run_id) == host.name
    # Workers on both hosts take from one fleet: every job that lands on the wrong host
    # is handed on, never opened there.
    a.start_workers(tmp_path / "a.log")
    b.start_workers(tmp_path / "b.log")
    poll(
        lambda: all(phase(fleet, r) == "completed" for r in runs),
        deadline_s=120,
        what="every run completed",
    )
    for run_id, (host, name) in runs.items():
        assert (host.backing / name / "app.py").read_text() == RIGHT_GREETING
        assert fleet.store.records.incidents(run_id) == [], run_id  # nothing froze, nothing refused


def test_a_lost_host_s_runs_wait_for_it_visibly_and_finish_when_it_comes_back(
    hosts: dict[str, Host], redis_server: RedisServer, tmp_path: Path
) -> None:
    a, b = hosts["host-a"], hosts["host-b"]
    fleet = fleet_of(redis_server, a.env)
    b.start_workers(tmp_path / "b.log")
    slow = submit_on(b, "ws-b-slow", think_ms=4000)
    poll(
        lambda: fleet.store.read_run(slow).lease_live,
        deadline_s=60,
        what="host B's worker holds its run",
    )
    b.lose()  # every worker of B SIGKILLed mid-run; its disk is unreachable
    a.start_workers(tmp_path / "a.log")
    fast = submit_on(a, "ws-a-fast")
    poll(lambda: phase(fleet, fast) == "completed", deadline_s=60, what="A's run completed")
    # B's run: its lease expired, A's reaper holds it for B (never hands it to A, never
    # records a fault), and `show` says it waits for host B.
    poll(
        lambda: not fleet.host_seen("host-b").alive,
        deadline_s=30,
        what="host B shows as gone",
    )
    shown = a.ratchet("show", slow, "--json")
    assert shown.returncode == 0, shown.stderr
    status = json.loads(shown.stdout)["status"]
    assert status["host"] == "host-b" and status["host_alive"] is False
    assert status["waiting_for_host"] is True and "waiting for host host-b" in status["summary"]
    listed = json.loads(a.ratchet("runs", "--json").stdout)["runs"]
    row = next(r for r in listed if r["run_id"] == slow)
    assert row["waiting_for_host"] is True and row["host"] == "host-b"
    assert fleet.store.records.incidents(slow) == []
    assert phase(fleet, slow) == "running"
    # B comes back with its disk: the run finishes there, its write done once.
    b.start()
    b.start_workers(tmp_path / "b2.log")
    poll(lambda: phase(fleet, slow) == "completed", deadline_s=90, what="B's run completed")
    assert (b.backing / "ws-b-slow" / "app.py").read_text() == RIGHT_GREETING
    # The only record: B's new worker took the lease over from B's dead one.
    assert {i["kind"] for i in fleet.store.records.incidents(slow)} == {"lease_taken_over"}
    view = inspect_run(fleet, slow)
    assert len(view.state.executed) == 1


def test_a_lost_host_s_disk_attached_elsewhere_moves_its_run_there_once_proven(
    hosts: dict[str, Host], redis_server: RedisServer, tmp_path: Path
) -> None:
    """Host B is lost but its disk is not: mounted on a new machine (host C), `ratchet
    attach` there proves the run's environment is the same instance at the version the
    run recorded, and the run finishes on C. On a host whose disk holds no such workspace,
    or another one at the same path, the command refuses in one line and moves nothing."""
    a, b = hosts["host-a"], hosts["host-b"]
    fleet = fleet_of(redis_server, a.env)
    b.start_workers(tmp_path / "b.log")
    slow = submit_on(b, "ws-b-moved", think_ms=4000)
    poll(lambda: fleet.store.read_run(slow).lease_live, deadline_s=60, what="B holds its run")
    b.lose()
    poll(lambda: not fleet.host_seen("host-b").alive, deadline_s=30, what="B shows as gone")
    poll(lambda: not fleet.store.read_run(slow).lease_live, deadline_s=30, what="lease gone")
    # Host A's disk has no such workspace: refused, nothing moved.
    refused = a.ratchet("attach", slow, "--reason", "try A")
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "not a directory" in refused.stderr, refused.stderr
    # Another workspace at the same path (another instance): refused too.
    make_greeting_workspace(a.backing / "ws-b-moved")
    other = a.run(
        [
            sys.executable,
            "-c",
            "from ratchet.adapters import WorkspaceAdapter as W; "
            "W('ws-b-moved', ['app.py']).close()",
        ]
    )
    assert other.returncode == 0, other.stderr
    impostor = a.ratchet("attach", slow, "--reason", "try a copy")
    assert impostor.returncode == 2 and "not the run's" in impostor.stderr, impostor.stderr
    where = fleet.store.hosts
    assert where.placement(slow) is None and where.run_host(slow) == "host-b"
    # B's disk, mounted on a new machine C: proven, moved, finished there, once.
    c = Host("host-c", b.backing, b.mountpoint, b.env).start()
    hosts["host-c"] = c  # stopped with the others
    c.start_workers(tmp_path / "c.log")
    moved = c.ratchet("attach", slow, "--reason", "B's disk moved to C", "--json")
    assert moved.returncode == 0, moved.stderr
    info = json.loads(moved.stdout)
    assert info["host"] == "host-c" and info["moved_from"] == "host-b" and info["seq"] == 1
    poll(lambda: phase(fleet, slow) == "completed", deadline_s=90, what="the run completed on C")
    assert (b.backing / "ws-b-moved" / "app.py").read_text() == RIGHT_GREETING
    view = inspect_run(fleet, slow)
    assert len(view.state.executed) == 1
    kinds = [i["kind"] for i in fleet.store.records.incidents(slow)]
    assert "placement_moved" in kinds and "restore_refused" not in kinds
    shown = json.loads(a.ratchet("show", slow, "--json").stdout)["status"]
    assert shown["host"] == "host-c" and shown["moved"]["from"] == "host-b"
