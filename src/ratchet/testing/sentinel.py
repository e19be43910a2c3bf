"""A replicated Redis on loopback for tests, drills and the docs: one primary, its
replicas and Sentinels that watch them, all real ``redis-server`` processes (Sentinel is
the same binary run with ``--sentinel``).

``LocalReplicated(folder).start()`` starts the primary, then each replica with
``--replicaof`` the primary, then each Sentinel with a config that monitors the primary as
:data:`SERVICE`, and waits until every replica is in sync and every Sentinel sees every
replica. :attr:`LocalReplicated.url` is the ``redis+sentinel://`` URL the fleet is given
(:mod:`ratchet.fleet.redisurl`). :meth:`LocalReplicated.kill_primary` SIGKILLs whichever
server is primary now and :meth:`LocalReplicated.wait_failover` waits for the Sentinels to
name another one. Timings are short (the primary is judged down after
``down_after_ms``, 1 s by default) so a failover takes a few seconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from ratchet.errors import ConfigurationError
from ratchet.redis_server import LOOPBACK, RedisServer, find_redis_server, free_port

__all__ = ["SERVICE", "LocalReplicated", "SentinelProcess"]

SERVICE = "ratchet"
_POLL_S = 0.02


class SentinelProcess:
    """One Sentinel (``redis-server <conf> --sentinel``) on loopback."""

    def __init__(
        self,
        folder: Path,
        executable: str,
        monitor_port: int,
        quorum: int,
        *,
        down_after_ms: int,
        failover_timeout_ms: int,
    ) -> None:
        self.folder = folder
        self.executable = executable
        self.port = free_port()
        self.monitor_port = monitor_port
        self.quorum = quorum
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self._proc: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        return f"SentinelProcess(port={self.port})"

    def start(self, deadline_s: float = 15.0) -> SentinelProcess:
        self.folder.mkdir(parents=True, exist_ok=True)
        conf = self.folder / "sentinel.conf"  # Sentinel rewrites it as it learns
        conf.write_text(
            "\n".join(
                [
                    f"port {self.port}",
                    f"bind {LOOPBACK}",
                    f"dir {os.fspath(self.folder)}",
                    f"logfile {os.fspath(self.folder / 'sentinel.log')}",
                    f"sentinel monitor {SERVICE} {LOOPBACK} {self.monitor_port} {self.quorum}",
                    f"sentinel down-after-milliseconds {SERVICE} {self.down_after_ms}",
                    f"sentinel failover-timeout {SERVICE} {self.failover_timeout_ms}",
                    f"sentinel parallel-syncs {SERVICE} 1",
                    "",
                ]
            )
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
        self._proc = subprocess.Popen(  # noqa: S603 - fixed argument list, no shell
            [self.executable, os.fspath(conf), "--sentinel"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        end = time.monotonic() + deadline_s
        while True:
            if self._proc.poll() is not None:
                raise ConfigurationError("a Sentinel exited during start-up", port=self.port)
            try:
                if self.client().ping():
                    return self
            except RedisError:
                pass
            if time.monotonic() > end:
                raise ConfigurationError("a Sentinel was not ready in time", port=self.port)
            time.sleep(_POLL_S)

    def client(self) -> redis.Redis:
        return redis.Redis(
            host=LOOPBACK, port=self.port, socket_timeout=2.0, socket_connect_timeout=1.0
        )

    def _ask(self, *command: str) -> Any:
        client: Any = self.client()
        try:
            return client.execute_command(*command)
        finally:
            client.close()

    def primary_address(self) -> tuple[str, int] | None:
        """Where this Sentinel says the primary is now (None: it cannot say)."""
        try:
            reply = self._ask("SENTINEL", "get-master-addr-by-name", SERVICE)
        except RedisError:
            return None
        if not reply:
            return None
        host, port = reply
        return (host.decode() if isinstance(host, bytes) else str(host), int(port))

    def primary_settled(self) -> bool:
        """Whether this Sentinel judges the primary up with no failover under way (what
        redis-py's Sentinel client requires before it names the primary)."""
        try:
            masters = self._ask("SENTINEL", "masters")
        except RedisError:
            return False
        for entry in masters or []:
            fields = _fields(entry)
            name = fields.get(b"name", b"")
            if (name.decode() if isinstance(name, bytes) else str(name)) != SERVICE:
                continue
            raw = fields.get(b"flags", b"")
            flags = set((raw.decode() if isinstance(raw, bytes) else str(raw)).split(","))
            return "master" in flags and not flags & {"s_down", "o_down", "failover_in_progress"}
        return False

    def sees_replicas(self) -> int:
        """How many replicas this Sentinel knows and does not judge down."""
        try:
            replicas = self._ask("SENTINEL", "replicas", SERVICE)
        except RedisError:
            return 0
        count = 0
        for entry in replicas or []:
            fields = _fields(entry)
            flags = fields.get(b"flags", fields.get("flags", b""))
            flags = flags.decode() if isinstance(flags, bytes) else str(flags)
            if "down" not in flags and "disconnected" not in flags:
                count += 1
        return count

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)


class LocalReplicated:
    """A primary, ``replicas`` replicas and ``sentinels`` Sentinels (quorum: a majority)."""

    def __init__(
        self,
        base_dir: str | os.PathLike[str],
        *,
        replicas: int = 1,
        sentinels: int = 1,
        executable: str | os.PathLike[str] | None = None,
        appendfsync: Literal["always", "everysec", "no"] = "always",
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 5000,
        ready_timeout_s: float = 30.0,
    ) -> None:
        if replicas < 1 or sentinels < 1:
            raise ConfigurationError("a replicated Redis needs a replica and a Sentinel")
        self.base_dir = Path(base_dir)
        self.executable = find_redis_server(executable)
        self.ready_timeout_s = ready_timeout_s
        self.servers = [
            RedisServer(
                self.base_dir / "redis-0", executable=self.executable, appendfsync=appendfsync
            )
        ]
        for i in range(1, replicas + 1):
            self.servers.append(
                RedisServer(
                    self.base_dir / f"redis-{i}",
                    executable=self.executable,
                    appendfsync=appendfsync,
                    extra_args=("--replicaof", LOOPBACK, str(self.servers[0].port)),
                )
            )
        self.sentinels = [
            SentinelProcess(
                self.base_dir / f"sentinel-{i}",
                self.executable,
                self.servers[0].port,
                sentinels // 2 + 1,
                down_after_ms=down_after_ms,
                failover_timeout_ms=failover_timeout_ms,
            )
            for i in range(sentinels)
        ]

    def __repr__(self) -> str:
        return (
            f"LocalReplicated(servers={[s.port for s in self.servers]}, "
            f"sentinels={[s.port for s in self.sentinels]})"
        )

    @property
    def url(self) -> str:
        """The fleet's ``RATCHET_REDIS_URL`` for this topology."""
        nodes = ",".join(f"{LOOPBACK}:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{nodes}/{SERVICE}"

    def server_at(self, port: int) -> RedisServer:
        for server in self.servers:
            if server.port == port:
                return server
        raise ConfigurationError("no server of this topology listens there", port=port)

    @property
    def primary(self) -> RedisServer:
        """The server the Sentinels name as primary now."""
        for sentinel in self.sentinels:
            address = sentinel.primary_address()
            if address is not None:
                return self.server_at(address[1])
        raise ConfigurationError("no Sentinel names a primary")

    @property
    def replicas(self) -> list[RedisServer]:
        primary = self.primary
        return [s for s in self.servers if s is not primary]

    def start(self) -> LocalReplicated:
        """Start everything and wait until it is in sync. Raises ConfigurationError."""
        for server in self.servers:
            server.start()
        for sentinel in self.sentinels:
            sentinel.start()
        self.wait_in_sync()
        return self

    def wait_in_sync(self) -> None:
        """Until the primary counts every live replica online and every Sentinel sees
        them. Raises ConfigurationError past the deadline."""
        end = time.monotonic() + self.ready_timeout_s
        while True:
            try:
                primary = self.primary
                live = [s for s in self.servers if s is not primary and s.running]
                online = _online_replicas(primary.client())
                seen = min(s.sees_replicas() for s in self.sentinels)
                if online >= len(live) and seen >= len(live):
                    return
            except (ConfigurationError, RedisError):
                pass
            if time.monotonic() > end:
                raise ConfigurationError("the replicated Redis did not get in sync in time")
            time.sleep(_POLL_S)

    def kill_primary(self) -> RedisServer:
        """SIGKILL the primary now; returns it (stopped)."""
        primary = self.primary
        primary.kill()
        return primary

    def wait_failover(self, old: RedisServer, deadline_s: float = 60.0) -> RedisServer:
        """Until every Sentinel names a primary other than ``old`` that answers as a
        primary. Returns it. Raises ConfigurationError past the deadline."""
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            addresses = {s.primary_address() for s in self.sentinels}
            if len(addresses) == 1 and None not in addresses:
                (address,) = addresses
                if address is not None and address[1] != old.port:
                    promoted = self.server_at(address[1])
                    if _role(promoted.client()) == "master" and all(
                        s.primary_settled() for s in self.sentinels
                    ):
                        return promoted
            time.sleep(_POLL_S)
        raise ConfigurationError("no failover within the deadline", old_port=old.port)

    def rejoin(self, server: RedisServer) -> None:
        """Start a killed ``server`` again on its own folder as a replica of the primary
        the Sentinels name now (never as a stale primary that clients could still write
        to before Sentinel demotes it), and wait until it is in sync."""
        primary = self.primary
        args = list(server.extra_args)
        if "--replicaof" in args:
            at = args.index("--replicaof")
            del args[at : at + 3]
        server.extra_args = (*args, "--replicaof", LOOPBACK, str(primary.port))
        server.start()
        self.wait_in_sync()

    def stop(self) -> None:
        for sentinel in self.sentinels:
            sentinel.stop()
        for server in self.servers:
            server.kill()

    def __enter__(self) -> LocalReplicated:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _fields(entry: Any) -> dict[Any, Any]:
    """A Sentinel reply entry as a mapping (RESP2 answers a flat list, RESP3 a map)."""
    if isinstance(entry, dict):
        return entry
    return dict(zip(entry[::2], entry[1::2], strict=False))


def _info(client: Any) -> dict[str, Any]:
    try:
        info: dict[str, Any] = client.info("replication")
        return info
    except RedisConnectionError:
        return {}
    finally:
        client.close()


def _role(client: Any) -> str:
    return str(_info(client).get("role", ""))


def _online_replicas(client: Any) -> int:
    info = _info(client)
    if info.get("role") != "master":
        return 0
    return sum(
        1
        for key, value in info.items()
        if key.startswith("slave") and isinstance(value, dict) and value.get("state") == "online"
    )
