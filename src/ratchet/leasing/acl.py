"""Least-privilege Redis users for a ratchet fleet (Redis ACLs, Redis 6.2 or later).

What Redis can and cannot enforce decides the design:

* Redis checks every command a Lua script issues against the ACL of the user who called
  the script. There is no "may only write through this script" privilege: a user that can
  run the commit script must itself hold ``SET``/``HSET`` on the run keys. So the users
  below hold exactly the commands their scripts issue (read from the shipped ``.lua``
  files, so the list cannot drift) plus the few direct calls they make, and nothing more.
* Key patterns apply to every command of a user, not per command (selectors need Redis 7).
  RQ needs broad writes on its own keys. So the queue gets its **own user** limited to
  ``rq:*`` keys and channels, and a worker opens two connections: the store's (user
  ``ratchet-worker``, ``ratchet:*`` keys only) and the queue's (``ratchet-queue``).

Users (each is ``-@all`` plus what is listed; none may ``EVAL``, ``SCRIPT LOAD``/``FLUSH``,
``FLUSHALL``/``FLUSHDB``, ``CONFIG``, ``KEYS``, ``DEBUG``, ``ACL`` or touch another user's
keys):

``ratchet-admin``     everything; loads the scripts (``ratchet redis load-scripts``) after
                      every Redis start (the script cache is not persisted).
``ratchet-worker``    ``EVALSHA`` of the worker scripts and what they issue; the expiry
                      index (``ZADD``/``ZREM``/``ZRANGEBYSCORE``), nonce claims
                      (``SET NX``/``GET``), inbox and incident reads. No ``DEL``,
                      ``UNLINK``, ``RENAME``, ``EXPIRE``, ``HDEL`` outside the scripts' set,
                      so not ``purge_run`` either: under these ACLs retention runs as the
                      operator (``ratchet purge`` on a schedule), not in the workers.
``ratchet-operator``  submit, approve, review, cancel, purge: ``create_run``,
                      ``post_evidence``, ``read_run``, ``purge_run`` (its ``DEL`` of a
                      finished run's keys) and the runs index. Cannot acquire or commit.
``ratchet-reader``    ``ratchet show``/``runs`` and the console: ``read_run`` and reads
                      only. Its ``EVALSHA`` of a writing script fails at the first write
                      (Redis checks it), before anything is written.
``ratchet-queue``     RQ 3: the commands RQ issues (below), on ``rq:*`` keys and channels
                      only, including its own ``EVALSHA``/``SCRIPT LOAD`` (RQ's Lua runs
                      under this user's ACL, so it too is confined to ``rq:*``).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from importlib import resources

from ratchet.errors import ConfigurationError
from ratchet.leasing.keyspace import PREFIX
from ratchet.leasing.scripts import ScriptName

__all__ = [
    "QUEUE_COMMANDS",
    "AclUser",
    "Role",
    "acl_file",
    "acl_setuser_lines",
    "role_commands",
    "script_commands",
]


class Role(StrEnum):
    ADMIN = "admin"
    WORKER = "worker"
    OPERATOR = "operator"
    READER = "reader"
    QUEUE = "queue"


_WORKER_SCRIPTS = (
    ScriptName.ACQUIRE_LEASE,
    ScriptName.RENEW_LEASE,
    ScriptName.RELEASE_LEASE,
    ScriptName.COMMIT,
    ScriptName.READ_RUN,
    ScriptName.CLAIM_REAP,
    ScriptName.DROP_EXPIRY_ENTRY,
    ScriptName.RECORD_INCIDENT,
    ScriptName.INDEX_RUN,
    ScriptName.LEDGER_INIT,
    ScriptName.LEDGER_ADMIT,
    ScriptName.LEDGER_RECORD,
    ScriptName.LEDGER_PIN,
)
_SCRIPTS: Mapping[Role, tuple[ScriptName, ...]] = {
    Role.WORKER: _WORKER_SCRIPTS,
    Role.OPERATOR: (
        ScriptName.CREATE_RUN,
        ScriptName.READ_RUN,
        ScriptName.POST_EVIDENCE,
        ScriptName.REPLACE_DOCUMENT,
        ScriptName.PURGE_RUN,
        ScriptName.INDEX_RUN,
        ScriptName.LEDGER_INIT,
    ),
    Role.READER: (ScriptName.READ_RUN,),
}
# Direct calls of RedisStore besides the scripts (see store.py).
# ``info``: workers and submit read ``maxmemory_policy`` from INFO memory (CONFIG is not
# theirs) to refuse an evicting Redis.
# ``hmget``, ``llen``, ``zcard``: listings (a page's hashes and incident counts, the exact
# counts per phase; see listing.py).
_READS = ("get", "lrange", "zrange", "zrangebyscore", "time", "info", "hmget", "llen", "zcard")
# ``wait``: with RATCHET_MIN_REPLICAS_ACK, creates and commits are confirmed by replicas.
# ``multi``/``exec``: a purged run's index entries removed in one transaction on its
# shard's slot (Redis Cluster), see sharded.py.
_DIRECT: Mapping[Role, tuple[str, ...]] = {
    # the expiry index; SET NX nonce claims
    Role.WORKER: (*_READS, "zadd", "zrem", "set", "wait"),
    # index removal after a purge on Redis Cluster
    Role.OPERATOR: (*_READS, "zadd", "zrem", "multi", "exec", "wait"),
    Role.READER: _READS,
}
_CONNECTION = ("ping", "hello", "client|setname", "client|getname")

#: What RQ 3 sends, from its source and a traced run (enqueue, burst and blocking workers,
#: registries, job results, worker registration, the pubsub command channel, its Lua).
QUEUE_COMMANDS = (
    # keys and strings
    "exists",
    "get",
    "set",
    "del",
    "expire",
    "persist",
    "rename",
    "ttl",
    "type",
    # hashes
    "hset",
    "hget",
    "hgetall",
    "hexists",
    "hdel",
    "hincrby",
    "hincrbyfloat",
    "hmget",
    # lists (BLMOVE/BLPOP: the blocking dequeue; LMOVE: the intermediate queue)
    "rpush",
    "lpush",
    "lpop",
    "lrem",
    "lrange",
    "llen",
    "lpos",
    "lmove",
    "blmove",
    "blpop",
    "lindex",
    # sets and sorted sets (registries)
    "sadd",
    "srem",
    "smembers",
    "scard",
    "sismember",
    "zadd",
    "zrem",
    "zrange",
    "zrangebyscore",
    "zremrangebyscore",
    "zremrangebyrank",
    "zcard",
    "zscore",
    # streams (job results)
    "xadd",
    "xread",
    "xrevrange",
    "xlen",
    "xtrim",
    # transactions
    "multi",
    "exec",
    "discard",
    "watch",
    "unwatch",
    # RQ's own scripts (confined to rq:* keys by this user's key pattern)
    "evalsha",
    "script|load",
    "script|exists",
    # pubsub: the worker's command channel
    "subscribe",
    "unsubscribe",
    "publish",
    # worker registration
    "info",
    "client|setname",
    "client|getname",
    "client|info",
    "ping",
    "hello",
    "time",
)

_CALL = re.compile(r"redis\.p?call\(\s*'([A-Za-z]+)'")


def script_commands(name: ScriptName) -> frozenset[str]:
    """The commands one shipped script issues (lower case), read from its source."""
    text = (
        resources.files("ratchet.leasing")
        .joinpath("lua", f"{name.value}.lua")
        .read_text(encoding="utf-8")
    )
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("--"))
    return frozenset(cmd.lower() for cmd in _CALL.findall(body))


def role_commands(role: Role) -> tuple[str, ...]:
    """The commands ``role`` may run, sorted. Raises ConfigurationError for ADMIN (all)."""
    if role is Role.ADMIN:
        raise ConfigurationError("the admin role may run every command", field="role")
    if role is Role.QUEUE:
        return tuple(sorted(set(QUEUE_COMMANDS)))
    commands: set[str] = {"evalsha", *_CONNECTION, *_DIRECT[role]}
    for script in _SCRIPTS[role]:
        commands |= script_commands(script)
    return tuple(sorted(commands))


@dataclass(frozen=True, slots=True)
class AclUser:
    """One ACL user: its name, role, and the SHA-256 of its password (never the password)."""

    name: str
    role: Role
    password_sha256: str

    @classmethod
    def with_password(cls, name: str, role: Role, password: str) -> AclUser:
        """Raises ConfigurationError for a short password or a bad user name."""
        if len(password) < 16:
            raise ConfigurationError("Redis passwords must be at least 16 characters")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", name):
            raise ConfigurationError("bad Redis user name", field="user")
        return cls(name, role, hashlib.sha256(password.encode()).hexdigest())

    def rules(self) -> str:
        """The user's ACL rules (``ACL SETUSER`` / ``aclfile`` syntax)."""
        head = f"reset on #{self.password_sha256}"
        if self.role is Role.ADMIN:
            return f"{head} ~* &* +@all"
        if self.role is Role.QUEUE:
            scope = "~rq:* resetchannels &rq:*"
        else:
            scope = f"~{PREFIX}:* resetchannels"
        allowed = " ".join(f"+{command}" for command in role_commands(self.role))
        return f"{head} {scope} -@all {allowed}"


def acl_setuser_lines(users: Iterable[AclUser]) -> list[str]:
    """``ACL SETUSER`` commands, e.g. for ``redis-cli`` as an admin (no secrets: hashes)."""
    return [f"ACL SETUSER {user.name} {user.rules()}" for user in users]


def acl_file(users: Iterable[AclUser], *, default_user: str = "ping") -> str:
    """The content of a Redis ``aclfile``.

    ``default_user``: ``"ping"`` leaves the unauthenticated default user able to run only
    ``PING`` (health checks); ``"off"`` disables it. Raises ConfigurationError otherwise.
    """
    if default_user == "ping":
        default = "user default on nopass resetkeys resetchannels -@all +ping +hello"
    elif default_user == "off":
        default = "user default off resetkeys resetchannels -@all"
    else:
        raise ConfigurationError("default_user must be 'ping' or 'off'", field="default_user")
    lines = [default] + [
        f"user {user.name} {user.rules().removeprefix('reset ')}" for user in users
    ]
    return "\n".join(lines) + "\n"
