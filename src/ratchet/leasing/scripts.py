"""The Lua scripts, loaded from package data, and the runner that calls them by SHA.

Each script is one ``.lua`` file under ``ratchet/leasing/lua/`` whose header names every
``KEYS[i]``, every ``ARGV[i]`` with its unit, and every reply.

:class:`ScriptRunner` calls ``EVALSHA`` with the script's SHA-1. Only if the server
answers ``NOSCRIPT`` (a fresh server, ``SCRIPT FLUSH``, a restart, a failover to a node
that never saw the script) does it send ``SCRIPT LOAD`` and repeat the call once.
Repeating is safe: a script that was not found did not run. So a client whose Redis user
may only ``EVALSHA`` (see :mod:`ratchet.leasing.acl`) works as long as an admin loaded
the scripts (``RedisStore.load_scripts``); if they are missing it fails with a
:class:`StoreProtocolError` that says so instead of loading them. redis-py ``Script``
objects are not used, because inside pipelines they add a ``SCRIPT EXISTS`` round trip
per execute.

The hot path (``run(..., hot=True)``, the commit script: every step of every run) goes
over a connection of its own when the client is a plain ``redis.Redis`` with a pool: one
connection made by that pool (same address, credentials, TLS, timeouts and retry policy),
kept for these calls and used under a lock, so a call costs the send and the read and not
the pool's bookkeeping around them (measured: about 30 us less CPU per call). A
connection error disconnects it and is retried by the connection's own retry policy, as
redis-py does; a forked child never touches the parent's socket (it makes its own on first
use). Every other call, and every other kind of client (Cluster, fakeredis, a
single-connection client), goes through the client as usual.
"""

from __future__ import annotations

import hashlib
import os
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from importlib import resources
from typing import Any

import hiredis
import redis
from redis.cluster import RedisCluster
from redis.exceptions import NoPermissionError, NoScriptError

from ratchet.errors import StoreProtocolError

__all__ = ["LuaScript", "ScriptName", "ScriptRunner", "load_script"]


class ScriptName(StrEnum):
    """The scripts ratchet ships; the value is the file name without ``.lua``."""

    CREATE_RUN = "create_run"
    ACQUIRE_LEASE = "acquire_lease"
    RENEW_LEASE = "renew_lease"
    RELEASE_LEASE = "release_lease"
    COMMIT = "commit"
    READ_RUN = "read_run"
    CLAIM_REAP = "claim_reap"
    DROP_EXPIRY_ENTRY = "drop_expiry_entry"
    RECORD_INCIDENT = "record_incident"
    POST_EVIDENCE = "post_evidence"
    REPLACE_DOCUMENT = "replace_document"
    PURGE_RUN = "purge_run"
    INDEX_RUN = "index_run"
    LEDGER_INIT = "ledger_init"
    LEDGER_ADMIT = "ledger_admit"
    LEDGER_RECORD = "ledger_record"
    LEDGER_PIN = "ledger_pin"


@dataclass(frozen=True, slots=True)
class LuaScript:
    name: StrEnum
    source: str
    sha: str


def load_script(name: StrEnum, package: str = "ratchet.leasing") -> LuaScript:
    """Read one script from package data and compute its SHA-1 (what Redis names it by).

    The file is ``<package>/lua/<name>.lua``; other ratchet packages that ship scripts
    (``ratchet.langgraph``) pass their own ``package``.
    """
    source = (
        resources.files(package).joinpath("lua", f"{name.value}.lua").read_text(encoding="utf-8")
    )
    sha = hashlib.sha1(source.encode("utf-8"), usedforsecurity=False).hexdigest()
    return LuaScript(name=name, source=source, sha=sha)


_SCRIPTS: dict[StrEnum, LuaScript] = {name: load_script(name) for name in ScriptName}


class _Line:
    """One connection made by a client's pool, kept for the hot script calls."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool
        self._conn: Any = None
        self._lock = threading.Lock()
        _LINES.add(self)

    def _forget(self) -> None:
        """In a forked child: the socket is the parent's; never use or close it here."""
        self._conn, self._lock = None, threading.Lock()

    def call(self, *command: Any) -> Any:
        """Send one command and read its reply. Raises what redis-py raises for it."""
        with self._lock:
            conn = self._connection()
            return conn.retry.call_with_retry(
                lambda: self._send(conn, command), lambda _error: conn.disconnect()
            )

    def call_then_wait(self, command: tuple[Any, ...], replicas: int, timeout_ms: int) -> Any:
        """Send ``command`` and ``WAIT replicas timeout_ms`` together on this connection
        and read both replies. Returns ``(reply, replicas counted)``; the command's error
        reply is raised after both replies were read (the connection stays usable)."""
        with self._lock:
            conn = self._connection()
            return conn.retry.call_with_retry(
                lambda: _send_then_wait(conn, command, replicas, timeout_ms),
                lambda _error: conn.disconnect(),
            )

    def _connection(self) -> Any:
        conn = self._conn
        if conn is None:
            conn = self._conn = self._pool.make_connection()
        return conn

    @staticmethod
    def _send(conn: Any, command: tuple[Any, ...]) -> Any:
        _connected(conn)
        # Commit arguments are all str or bytes: hiredis packs them as they are (redis-py's
        # packer, which takes ints and more, re-checks every argument first).
        try:
            packed = [_pack(command)] if _pack is not None else conn.pack_command(*command)
        except TypeError:
            packed = conn.pack_command(*command)
        conn.send_packed_command(packed)
        return conn.read_response()

    def close(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.disconnect()


def _connected(conn: Any) -> None:
    """Connect ``conn`` through its own ``connect()`` when it has no socket. redis-py's
    send path connects to the connection's last host and port (for a new one, its
    defaults) without asking: a Sentinel-managed connection must ask Sentinel where the
    primary is, which only its ``connect()`` does."""
    if getattr(conn, "_sock", None) is None:
        conn.connect()


def _send_then_wait(conn: Any, command: tuple[Any, ...], replicas: int, timeout_ms: int) -> Any:
    """Both commands go out in one write; WAIT then counts this connection's own writes."""
    _connected(conn)
    conn.send_packed_command(
        conn.pack_commands([command, ("WAIT", str(replicas), str(timeout_ms))])
    )
    failure: Exception | None = None
    try:
        reply = conn.read_response()
    except redis.exceptions.ResponseError as exc:  # a script error: WAIT's reply still comes
        failure, reply = exc, None
    counted = conn.read_response()
    if failure is not None:
        raise failure
    return reply, counted


_pack: Any = getattr(hiredis, "pack_command", None)
_LINES: weakref.WeakSet[_Line] = weakref.WeakSet()


def _forget_lines() -> None:
    for line in list(_LINES):
        line._forget()


os.register_at_fork(after_in_child=_forget_lines)


def _is_cluster(client: Any) -> bool:
    return isinstance(client, RedisCluster)


def _line_for(client: Any) -> _Line | None:
    """A line for a plain ``redis.Redis`` with a pool; None for any other client."""
    pool = getattr(client, "connection_pool", None)
    if (
        type(client) is not redis.Redis
        or getattr(client, "connection", None) is not None
        or not callable(getattr(pool, "make_connection", None))
    ):
        return None
    return _Line(pool)


class ScriptRunner:
    """Runs ratchet's scripts on one client (a ``redis.Redis``, ``RedisCluster`` or fake).

    ``scripts`` names the set it runs (by default the leasing scripts); other packages pass
    their own scripts, loaded with :func:`load_script`.
    """

    def __init__(self, client: Any, scripts: Mapping[StrEnum, LuaScript] | None = None) -> None:
        self._client = client
        self._scripts: Mapping[StrEnum, LuaScript] = _SCRIPTS if scripts is None else scripts
        self._loaded: set[StrEnum] = set()
        self._lock = threading.Lock()
        self._line = _line_for(client)

    def sha_of(self, name: StrEnum) -> str:
        """The SHA-1 Redis names script ``name`` by (for a call the runner does not make)."""
        return self._scripts[name].sha

    def close(self) -> None:
        """Close the hot path's own connection, if one was made (the next call reopens)."""
        if self._line is not None:
            self._line.close()

    def load_all(self) -> None:
        """Load every script now (otherwise each is loaded on its first NOSCRIPT)."""
        for script in self._scripts.values():
            self._load(script)

    def _load(self, script: LuaScript, key: str | None = None) -> None:
        # On a cluster client SCRIPT LOAD goes to every primary; with ``key``, only to the
        # node serving its slot (the one that answered NOSCRIPT), so a reload there does
        # not wait for, or fail on, another master that is down.
        client: Any = self._client
        if key is not None and _is_cluster(client):
            node = client.get_node_from_key(key)
            sha = client.execute_command("SCRIPT LOAD", script.source, target_nodes=node)
        else:
            sha = self._client.script_load(script.source)
        if isinstance(sha, bytes):
            sha = sha.decode("ascii", errors="replace")
        if sha != script.sha:
            raise StoreProtocolError(
                "SCRIPT LOAD returned an unexpected SHA", script=script.name.value
            )
        with self._lock:
            self._loaded.add(script.name)

    def run(
        self,
        name: StrEnum,
        keys: Sequence[str],
        args: Sequence[str | bytes | int],
        *,
        hot: bool = False,
    ) -> Any:
        """Run script ``name`` with ``keys`` and ``args`` and return the raw reply
        (``hot``: over the runner's own connection, when it has one).

        Raises redis ConnectionError / TimeoutError as they come (the caller decides what an
        unknown outcome means), redis ResponseError for a script error (NoPermissionError
        when the Redis user may not run a command the script issues), and
        StoreProtocolError when the script is missing and this user may not load it.
        """
        script = self._scripts[name]
        line = self._line if hot else None
        try:
            if line is not None:
                return line.call("EVALSHA", script.sha, str(len(keys)), *keys, *args)
            return self._client.evalsha(script.sha, len(keys), *keys, *args)
        except NoScriptError:
            self._reload(script, keys)
            if line is not None:
                return line.call("EVALSHA", script.sha, str(len(keys)), *keys, *args)
            return self._client.evalsha(script.sha, len(keys), *keys, *args)

    def run_and_wait(
        self,
        name: StrEnum,
        keys: Sequence[str],
        args: Sequence[str | bytes | int],
        *,
        replicas: int,
        timeout_ms: int,
    ) -> tuple[Any, int]:
        """Run script ``name`` and ``WAIT replicas timeout_ms`` on the same connection, in
        one round trip. Returns ``(raw reply, replicas counted)``.

        WAIT counts the replicas that received every write *this connection* made, so the
        two must share a connection: the hot line when there is one, else a pipeline
        (which holds one connection for both). A script that wrote nothing (a retry that
        found its commit applied) makes the count meaningless: the caller judges that.

        Raises what :meth:`run` raises, and StoreProtocolError for a WAIT reply that is
        not a count.
        """
        script = self._scripts[name]
        command = ("EVALSHA", script.sha, str(len(keys)), *keys, *args)
        for attempt in range(2):
            try:
                if self._line is not None:
                    reply, counted = self._line.call_then_wait(command, replicas, timeout_ms)
                else:
                    pipe = self._client.pipeline(transaction=False)
                    pipe.execute_command(*command)
                    pipe.execute_command("WAIT", str(replicas), str(timeout_ms))
                    reply, counted = pipe.execute(raise_on_error=False)
                    for answer in (reply, counted):
                        if isinstance(answer, Exception):
                            raise answer
            except NoScriptError:
                if attempt:
                    raise
                self._reload(script, keys)  # the script did not run; WAIT counted nothing
                continue
            if isinstance(counted, bool) or not isinstance(counted, int) or counted < 0:
                raise StoreProtocolError("WAIT did not answer a count", script=name.value)
            return reply, counted
        raise StoreProtocolError("unreachable", script=name.value)  # pragma: no cover

    def _reload(self, script: LuaScript, keys: Sequence[str]) -> None:
        try:
            self._load(script, keys[0] if keys else None)
        except NoPermissionError:
            # A least-privilege user (EVALSHA only) never loads scripts itself.
            raise StoreProtocolError(
                "the script is not loaded on the server and this Redis user may not "
                "load it; load the scripts with the admin user "
                "(ratchet redis load-scripts)",
                script=script.name.value,
            ) from None
