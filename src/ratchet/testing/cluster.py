"""A local Redis Cluster for tests and drills: three (or more) real ``redis-server``
processes on loopback with ``cluster-enabled yes``, joined by ``redis-cli --cluster
create`` into a cluster with no replicas."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ratchet.errors import ConfigurationError
from ratchet.redis_server import LOOPBACK, RedisServer, find_redis_cli

__all__ = ["LocalCluster"]

_POLL_S = 0.01


class LocalCluster:
    """A Redis Cluster of ``masters`` servers on loopback, no replicas."""

    def __init__(
        self,
        base_dir: str | os.PathLike[str],
        *,
        masters: int = 3,
        executable: str | os.PathLike[str] | None = None,
        appendfsync: Literal["always", "everysec", "no"] = "everysec",
        ready_timeout_s: float = 30.0,
    ) -> None:
        if masters < 3:
            raise ConfigurationError("a Redis Cluster needs at least three masters")
        self.base_dir = Path(base_dir)
        self.ready_timeout_s = ready_timeout_s
        self.servers = [
            RedisServer(
                self.base_dir / f"node-{i}",
                executable=executable,
                cluster=True,
                appendfsync=appendfsync,
            )
            for i in range(masters)
        ]

    def __repr__(self) -> str:
        return f"LocalCluster(ports={[s.port for s in self.servers]})"

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        return [(LOOPBACK, s.port) for s in self.servers]

    def client(self, **kwargs: Any) -> Any:
        """A ``redis.cluster.RedisCluster`` client (``decode_responses`` left False)."""
        nodes = [
            ClusterNode(host, port)  # type: ignore[no-untyped-call]
            for host, port in self.startup_nodes
        ]
        return RedisCluster(startup_nodes=nodes, **kwargs)

    def start(self) -> LocalCluster:
        """Start every node, assign the slots, wait until every node reports ``ok``.

        Raises ConfigurationError on any failure (the nodes started so far keep running;
        call :meth:`stop`).
        """
        for server in self.servers:
            server.start()
        cli = find_redis_cli(self.servers[0].executable)
        addresses = [f"{LOOPBACK}:{s.port}" for s in self.servers]
        done = subprocess.run(  # noqa: S603 - fixed argument list, no shell
            [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            input=b"yes\n",
            capture_output=True,
            timeout=self.ready_timeout_s,
            check=False,
        )
        if done.returncode != 0:
            raise ConfigurationError(
                "redis-cli --cluster create failed",
                output=done.stdout.decode(errors="replace")[-2000:],
            )
        self.wait_ok()
        return self

    def wait_ok(self) -> None:
        """Wait until every node reports ``cluster_state:ok`` with every slot assigned
        (after :meth:`start`, or after a node was restarted).

        Raises ConfigurationError when that takes longer than ``ready_timeout_s``."""
        deadline = time.monotonic() + self.ready_timeout_s
        clients = [s.client(socket_timeout=2.0) for s in self.servers]
        try:
            while True:
                if all(self._node_ok(c) for c in clients):
                    return
                if time.monotonic() > deadline:
                    raise ConfigurationError("the cluster did not reach state ok in time")
                time.sleep(_POLL_S * 5)
        finally:
            for c in clients:
                c.close()

    def _node_ok(self, client: redis.Redis) -> bool:
        try:
            info = client.execute_command("CLUSTER", "INFO")  # type: ignore[no-untyped-call]
        except (RedisConnectionError, RedisTimeoutError):
            return False
        text = info.decode() if isinstance(info, bytes) else str(info)
        fields = dict(line.split(":", 1) for line in text.split() if ":" in line)
        return (
            fields.get("cluster_state") == "ok"
            and fields.get("cluster_slots_assigned") == "16384"
            and fields.get("cluster_known_nodes") == str(len(self.servers))
        )

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def __enter__(self) -> LocalCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
