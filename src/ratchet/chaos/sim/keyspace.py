"""An in-process Redis for the simulator: a small keyspace that runs ratchet's real Lua
scripts, with ``TIME`` answered by the simulation's store clock.

Why not fakeredis: measured here, fakeredis costs about 74 us per plain command and
157 us per ``EVALSHA`` through redis-py, most of it in its RESP emulation and generic
command table. The simulator makes a few dozen script calls per schedule and a CI run
makes 10,000 schedules, so the store's share is kept to a few microseconds per
``redis.call``: the scripts run unchanged in a Lua 5.1 VM (``lupa``, the one fakeredis
uses, with Redis' own Lua version) and each ``redis.call`` is one Python dispatch.

Only the commands ratchet's scripts and the store's plain calls use are implemented
(``EXISTS TIME HSET HMGET HGET HDEL GET SET APPEND DEL LPUSH RPUSH LTRIM LRANGE LLEN SADD
SISMEMBER ZADD ZREM ZSCORE``; the client adds ``zrangebyscore``, ``zrange``, ``lrange``,
``get``, ``set``, ``zadd``, ``zrem``, ``time``), each with Redis' semantics where the
scripts can see them: a wrong type raises ``WRONGTYPE``, an emptied container key is
deleted, Lua numbers reach commands formatted as ``%.17g``, a script's reply is converted
as Redis converts it (numbers truncated to integers, ``false`` to nil, an array cut at its
first nil, ``{err=...}`` to an error reply). ``tests/chaos/sim/test_parity.py`` pins it:
the same seeded sequences of script calls against a real ``redis-server`` and against
this keyspace give the same replies and the same final keyspace.

:class:`SimRedis` is the client object :class:`ratchet.leasing.RedisStore` is given: the
real store code (argument checks, reply decoding, commit retries with the same commit id)
runs on top of it. Each simulated worker has its own client, so the network faults of one
worker's calls (a request dropped, a reply lost after the script ran) are decided per
call by the simulation through ``net``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError

from ratchet.errors import ConfigurationError
from ratchet.leasing.scripts import ScriptName, load_script

__all__ = ["Audit", "Keyspace", "Net", "SimRedis", "lua_runtime"]

_WRONGTYPE = "WRONGTYPE Operation against a key holding the wrong kind of value"

# What a call's network does (decided by the simulation per call).
Net = Callable[[str], str]  # script or command name -> "ok" | "drop" | "lose"


class _Hash(dict[bytes, bytes]):
    pass


class _List(list[bytes]):
    pass


class _Set(set[bytes]):
    pass


class _ZSet(dict[bytes, float]):
    pass


def lua_runtime() -> Any:
    """A Lua 5.1 runtime (Redis' Lua version). Raises ConfigurationError without lupa."""
    try:
        from lupa import lua51  # noqa: PLC0415 - optional
    except ImportError:  # pragma: no cover - depends on the environment
        raise ConfigurationError("the simulator needs lupa: pip install 'ratchet[sim]'") from None
    return lua51.LuaRuntime(encoding=None, unpack_returned_tuples=True, register_eval=False)


# redis.call returns (tag, values...): 0 a scalar, 1 an array (nil elements already
# false), 2 an error reply, 3 a status reply. The wrapper sets KEYS and ARGV as Redis does.
_PRELUDE = """
local pycall = ...
local unpack, select, error = unpack, select, error
local function convert(tag, ...)
  if tag == 0 then return (...) end
  if tag == 1 then return {...} end
  if tag == 3 then return {ok = (...)} end
  error({err = (...)}, 0)
end
local fmt, type = string.format, type
redis = {}
function redis.call(...)
  local n = select('#', ...)
  for i = 1, n do
    if type((select(i, ...))) ~= 'string' then
      -- A number goes to the command as Redis formats it (%.17g); anything else is an error.
      local args = {...}
      for j = 1, n do
        local a = args[j]
        if type(a) == 'number' then
          args[j] = fmt('%.17g', a)
        elseif type(a) ~= 'string' then
          error({err = 'ERR Lua redis lib command arguments must be strings or integers'}, 0)
        end
      end
      return convert(pycall(unpack(args, 1, n)))
    end
  end
  return convert(pycall(...))
end
function redis.pcall(...)
  local ok, result = pcall(redis.call, ...)
  if ok then return result end
  return result
end
function redis.error_reply(text) return {err = text} end
function redis.status_reply(text) return {ok = text} end
os, io, loadfile, dofile = nil, nil, nil, nil
-- A script's reply, flattened for Python: (1, n) an array of n items, (2, i) an integer
-- (Lua numbers truncated toward zero, as Redis does), (3, s) a bulk string, (4) nil,
-- (5, s) a status; an error reply ends the script's call with (1, message).
local floor, ceil = math.floor, math.ceil
local function flatten(v, out)
  local t = type(v)
  if t == 'table' then
    if v.err ~= nil then error(v, 0) end
    if v.ok ~= nil then out[#out + 1] = 5; out[#out + 1] = v.ok; return end
    local n = 0
    while v[n + 1] ~= nil do n = n + 1 end
    out[#out + 1] = 1; out[#out + 1] = n
    for i = 1, n do flatten(v[i], out) end
  elseif t == 'number' then
    out[#out + 1] = 2; out[#out + 1] = (v >= 0) and floor(v) or ceil(v)
  elseif t == 'string' then
    out[#out + 1] = 3; out[#out + 1] = v
  elseif t == 'boolean' and v then
    out[#out + 1] = 2; out[#out + 1] = 1
  else
    out[#out + 1] = 4
  end
end
local function body(f, out) flatten(f(), out) end
return function(f, nkeys, ...)
  local keys, argv = {...}, {}
  for i = nkeys + 1, select('#', ...) do
    argv[i - nkeys] = keys[i]
    keys[i] = nil
  end
  KEYS, ARGV = keys, argv
  local out = {}
  local ok, result = pcall(body, f, out)
  if ok then return 0, unpack(out) end
  if type(result) == 'table' and result.err then return 1, result.err end
  return 1, tostring(result)
end
"""


def _num(value: object) -> bytes:
    """A Lua number as Redis passes it to a command (``%.17g``)."""
    if isinstance(value, bool):
        raise ResponseError("ERR Lua redis lib command arguments must be strings or integers")
    if isinstance(value, int):
        return str(value).encode()
    if isinstance(value, float):
        return (str(int(value)) if value.is_integer() else f"{value:.17g}").encode()
    if isinstance(value, bytes):
        return value
    raise ResponseError("ERR Lua redis lib command arguments must be strings or integers")


def _unflatten(flat: tuple[Any, ...], at: int) -> tuple[Any, int]:
    """One reply value from the flattened form (see the prelude) and the next position."""
    tag = flat[at]
    if tag == 1:
        items = []
        at += 2
        for _ in range(flat[at - 1]):
            item, at = _unflatten(flat, at)
            items.append(item)
        return items, at
    if tag == 4:
        return None, at + 1
    return flat[at + 1], at + 2


def _score(value: float) -> bytes:
    return (str(int(value)) if value.is_integer() else f"{value:.17g}").encode()


def _int_arg(raw: bytes) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ResponseError("ERR value is not an integer or out of range") from None


class Audit:
    """What the simulation watches around each script call (nothing by default)."""

    def before(self, name: str, keys: list[bytes], args: list[bytes]) -> Any:
        """Called before the script runs; the value is passed to :meth:`after`."""
        return None

    def after(
        self, token: Any, name: str, keys: list[bytes], args: list[bytes], reply: Any
    ) -> None:
        """Called after the script ran (its reply already converted)."""


class Keyspace:
    """The data, the scripts (by SHA) and the clock of one simulated Redis."""

    def __init__(self, clock_ms: Callable[[], int], audit: Audit | None = None) -> None:
        self.data: dict[bytes, Any] = {}
        self.clock_ms = clock_ms
        self.audit = audit or Audit()
        self.script_calls = 0
        self._lua = lua_runtime()
        self._runner = self._lua.execute(_PRELUDE, self._dispatch)
        self._compiled: dict[str, Any] = {}
        self._names: dict[str, str] = {}
        self._loadstring = self._lua.eval("loadstring")
        known = {load_script(name).sha: name.value for name in ScriptName}
        self._known: dict[str, str] = known
        self._commands: dict[bytes, Callable[[tuple[bytes, ...]], tuple[Any, ...]]] = {
            b"EXISTS": self._exists,
            b"TIME": self._time,
            b"HSET": self._hset,
            b"HMGET": self._hmget,
            b"HGET": self._hget,
            b"HDEL": self._hdel,
            b"GET": self._get,
            b"SET": self._set,
            b"APPEND": self._append,
            b"DEL": self._del,
            b"LPUSH": self._lpush,
            b"RPUSH": self._rpush,
            b"LTRIM": self._ltrim,
            b"LRANGE": self._lrange,
            b"LLEN": self._llen,
            b"SADD": self._sadd,
            b"SISMEMBER": self._sismember,
            b"ZADD": self._zadd,
            b"ZREM": self._zrem,
            b"ZSCORE": self._zscore,
        }

    # -- scripts ---------------------------------------------------------------------------

    def compile(self, source: str) -> Any:
        """Compile a script's source into a Lua function (what ``SCRIPT LOAD`` keeps)."""
        compiled = self._loadstring(source.encode("utf-8"), b"=user_script")
        if isinstance(compiled, tuple):  # nil and the message: it did not compile
            raise ResponseError(f"ERR Error compiling script: {compiled[-1]!r}")
        return compiled

    def load(self, source: str) -> str:
        sha = hashlib.sha1(source.encode("utf-8"), usedforsecurity=False).hexdigest()
        if sha not in self._compiled:
            self._compiled[sha] = self.compile(source)
            self._names[sha] = self._known.get(sha, sha[:12])
        return sha

    def name_of(self, sha: str) -> str:
        """The script's name (its ``ScriptName`` value). Raises NoScriptError when it was
        never loaded (redis-py's client then loads it, as on a fresh server)."""
        name = self._names.get(sha)
        if name is None:
            raise NoScriptError("NOSCRIPT No matching script. Please use EVAL.")
        return name

    def run(self, sha: str, keys: list[bytes], args: list[bytes]) -> Any:
        """Run a loaded script. Raises NoScriptError, ResponseError (a script error)."""
        fn = self._compiled.get(sha)
        if fn is None:
            raise NoScriptError("NOSCRIPT No matching script. Please use EVAL.")
        name = self._names[sha]
        token = self.audit.before(name, keys, args)
        self.script_calls += 1
        flat = self._runner(fn, len(keys), *keys, *args)
        if flat[0]:
            text = (
                flat[1].decode("utf-8", "replace") if isinstance(flat[1], bytes) else str(flat[1])
            )
            raise ResponseError(text if text[:1].isupper() else f"ERR user_script: {text}")
        reply, _ = _unflatten(flat, 1)
        self.audit.after(token, name, keys, args, reply)
        return reply

    def _dispatch(self, name: bytes = b"", *args: bytes) -> tuple[Any, ...]:
        # Every argument is a Lua string by now (the prelude formats numbers).
        command = self._commands.get(name) or self._commands.get(name.upper())
        if command is None:
            if not name:
                return (2, b"ERR Please specify at least one argument for this redis lib call")
            return (2, b"ERR unknown command '" + name + b"' in the simulator's keyspace")
        try:
            return command(args)
        except ResponseError as exc:
            return (2, str(exc).encode())

    # -- typed access ----------------------------------------------------------------------

    def _typed(self, key: bytes, kind: type, create: bool = False) -> Any:
        value = self.data.get(key)
        if value is None:
            if not create:
                return None
            value = self.data[key] = kind()
            return value
        if type(value) is not kind:
            raise ResponseError(_WRONGTYPE)
        return value

    def _drop_if_empty(self, key: bytes, value: Any) -> None:
        if not value:
            self.data.pop(key, None)

    # -- commands (args are bytes; each returns (tag, values...)) --------------------------

    def _exists(self, args: tuple[bytes, ...]) -> tuple[Any, ...]:
        return (0, sum(1 for key in args if key in self.data))

    def _time(self, args: tuple[bytes, ...]) -> tuple[Any, ...]:
        now = self.clock_ms()
        return (1, str(now // 1000).encode(), str((now % 1000) * 1000).encode())

    def _hset(self, args: tuple[bytes, ...]) -> tuple[Any, ...]:
        if len(args) < 3 or len(args) % 2 == 0:
            raise ResponseError("ERR wrong number of arguments for 'hset' command")
        table = self._typed(args[0], _Hash, create=True)
        added = 0
        for i in range(1, len(args), 2):
            added += args[i] not in table
            table[args[i]] = args[i + 1]
        return (0, added)

    def _hmget(self, args: tuple[bytes, ...]) -> tuple[Any, ...]:
        table = self._typed(args[0], _Hash) or {}
        return (1, *[table.get(f, False) for f in args[1:]])

    def _hget(self, args: tuple[bytes, ...]) -> tuple[Any, ...]:
        table = self._typed(args[0], _Hash) or {}
        return (0, table.get(args[1], False))

    def _hdel(self, args: tuple[bytes, ...]) -> tuple[Any, ...]:
        table = self._typed(args[0], _Hash)
        if table is None:
            return (0, 0)
        removed = sum(1 for f in args[1:] if table.pop(f, None) is not None)
        self._drop_if_empty(args[0], table)
        return (0, removed)

    def _get(self, args: tuple[bytes, ...]) -> tuple[Any, ...]:
        value = self._typed(args[0], bytes)
        return (0, False if value is None else value)

    def _set(self, args: tuple[bytes, ...]) -> tuple[Any, ...]:
        if len(args) != 2:
            raise ResponseError("ERR the simulator's SET takes no options inside scripts")
        self.data[args[0]] = bytes(args[1])
        return (3, b"OK")

    def _append(self, args: tuple[bytes, ...]) -> tuple[Any, ...]:
        if len(args) != 2:
            raise ResponseError("ERR wrong number of arguments for 'append' command")
        value = (self._typed(args[0], bytes) or b"") + bytes(args[1])
        self.data[args[0]] = value
        return (0, len(value))

    def _del(self, args: tuple[bytes, ...]) -> tuple[Any, ...]:
        return (0, sum(1 for key in args if self.data.pop(key, None) is not None))

    def _lpush(self, args: tuple[bytes, ...]) -> tuple[Any, ...]:
        items = self._typed(args[0], _List, create=True)
        items[:0] = reversed(args[1:])
        return (0, len(items))

    def _rpush(self, args: tuple[bytes, ...]) -> tuple[Any, ...]:
        items = self._typed(args[0], _List, create=True)
        items.extend(args[1:])
        return (0, len(items))

    @staticmethod
    def _span(length: int, start: int, stop: int) -> tuple[int, int]:
        if start < 0:
            start = max(length + start, 0)
        if stop < 0:
            stop = length + stop
        return start, min(stop, length - 1)

    def _ltrim(self, args: tuple[bytes, ...]) -> tuple[Any, ...]:
        items = self._typed(args[0], _List)
        if items is not None:
            start, stop = self._span(len(items), _int_arg(args[1]), _int_arg(args[2]))
            items[:] = items[start : stop + 1] if start <= stop else []
            self._drop_if_empty(args[0], items)
        return (3, b"OK")

    def lrange(self, key: bytes, start: int, stop: int) -> list[bytes]:
        items = self._typed(key, _List) or []
        first, last = self._span(len(items), start, stop)
        return list(items[first : last + 1]) if first <= last else []

    def _lrange(self, args: tuple[bytes, ...]) -> tuple[Any, ...]:
        return (1, *self.lrange(args[0], _int_arg(args[1]), _int_arg(args[2])))

    def _llen(self, args: tuple[bytes, ...]) -> tuple[Any, ...]:
        return (0, len(self._typed(args[0], _List) or ()))

    def _sadd(self, args: tuple[bytes, ...]) -> tuple[Any, ...]:
        members = self._typed(args[0], _Set, create=True)
        before = len(members)
        members.update(args[1:])
        return (0, len(members) - before)

    def _sismember(self, args: tuple[bytes, ...]) -> tuple[Any, ...]:
        members = self._typed(args[0], _Set) or ()
        return (0, 1 if args[1] in members else 0)

    def zadd(self, key: bytes, pairs: Iterable[tuple[float, bytes]], flags: set[str]) -> int:
        """ZADD with NX / XX / GT / LT; returns how many members were added."""
        zset = self._typed(key, _ZSet, create=True)
        added = 0
        for score, member in pairs:
            current = zset.get(member)
            if current is None:
                if "XX" in flags:
                    continue
                zset[member] = score
                added += 1
                continue
            if "NX" in flags:
                continue
            if ("GT" in flags and score <= current) or ("LT" in flags and score >= current):
                continue
            zset[member] = score
        self._drop_if_empty(key, zset)
        return added

    def _zadd(self, args: tuple[bytes, ...]) -> tuple[Any, ...]:
        flags: set[str] = set()
        rest = args[1:]
        while rest and rest[0].upper() in (b"NX", b"XX", b"GT", b"LT", b"CH"):
            flags.add(rest[0].upper().decode())
            rest = rest[1:]
        if not rest or len(rest) % 2:
            raise ResponseError("ERR syntax error")
        try:
            pairs = [(float(rest[i]), rest[i + 1]) for i in range(0, len(rest), 2)]
        except ValueError:
            raise ResponseError("ERR value is not a valid float") from None
        return (0, self.zadd(args[0], pairs, flags))

    def zrem(self, key: bytes, members: Iterable[bytes]) -> int:
        zset = self._typed(key, _ZSet)
        if zset is None:
            return 0
        removed = sum(1 for m in members if zset.pop(m, None) is not None)
        self._drop_if_empty(key, zset)
        return removed

    def _zrem(self, args: tuple[bytes, ...]) -> tuple[Any, ...]:
        return (0, self.zrem(args[0], args[1:]))

    def _zscore(self, args: tuple[bytes, ...]) -> tuple[Any, ...]:
        zset = self._typed(args[0], _ZSet) or {}
        score = zset.get(args[1])
        return (0, False if score is None else _score(score))

    def zsorted(self, key: bytes) -> list[tuple[bytes, float]]:
        zset = self._typed(key, _ZSet) or {}
        return sorted(zset.items(), key=lambda item: (item[1], item[0]))


def _b(value: object) -> bytes:
    """An argument as redis-py encodes it."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, bool):
        raise ResponseError("ERR a boolean is not a valid argument")
    if isinstance(value, int | float):
        return _num(value)
    raise ResponseError(f"ERR unsupported argument type {type(value).__name__}")


class SimRedis:
    """The redis-py client surface :class:`ratchet.leasing.RedisStore` uses, over a
    :class:`Keyspace`. ``net`` decides each call's network fault (None: none)."""

    def __init__(self, space: Keyspace, *, net: Net | None = None, name: str = "") -> None:
        self.space = space
        self.net = net
        self.name = name
        # The client host's own wall clock (ms): nothing in the store reads it; it is there
        # so a test can show what a store that trusted its clients' clocks would do.
        self.host_clock_ms: Callable[[], int] | None = None

    def __repr__(self) -> str:
        return f"SimRedis(name={self.name!r})"

    def _faulted(self, what: str, call: Callable[[], Any]) -> Any:
        fault = self.net(what) if self.net is not None else "ok"
        if fault == "drop":
            raise RedisConnectionError(f"simulated: request for {what} dropped")
        result = call()
        if fault == "lose":
            raise RedisConnectionError(f"simulated: reply to {what} lost")
        return result

    # -- scripts ---------------------------------------------------------------------------

    def script_load(self, source: str) -> str:
        return self.space.load(source)

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> Any:
        name = self.space.name_of(sha)
        raw = [a if type(a) is bytes else _b(a) for a in keys_and_args]
        keys, args = raw[:numkeys], raw[numkeys:]
        return self._faulted(name, lambda: self.space.run(sha, keys, args))

    # -- plain commands ----------------------------------------------------------------------

    def time(self) -> tuple[int, int]:
        now = self.space.clock_ms()
        reply: tuple[int, int] = self._faulted("TIME", lambda: (now // 1000, (now % 1000) * 1000))
        return reply

    def get(self, name: str | bytes) -> bytes | None:
        key = _b(name)

        def call() -> bytes | None:
            value = self.space._typed(key, bytes)
            return None if value is None else bytes(value)

        return self._faulted("GET", call)  # type: ignore[no-any-return]

    def set(self, name: str | bytes, value: Any, *, nx: bool = False, ex: int | None = None) -> Any:
        key, data = _b(name), _b(value)

        def call() -> bool | None:
            if nx and key in self.space.data:
                return None
            self.space.data[key] = data  # an ``ex`` expiry is not simulated (nonces only)
            return True

        return self._faulted("SET", call)

    def zadd(
        self,
        name: str | bytes,
        mapping: dict[Any, float],
        *,
        nx: bool = False,
        xx: bool = False,
        gt: bool = False,
        lt: bool = False,
    ) -> int:
        flags = {f for f, on in (("NX", nx), ("XX", xx), ("GT", gt), ("LT", lt)) if on}
        pairs = [(float(score), _b(member)) for member, score in mapping.items()]
        return self._faulted(  # type: ignore[no-any-return]
            "ZADD", lambda: self.space.zadd(_b(name), pairs, flags)
        )

    def zrem(self, name: str | bytes, *values: Any) -> int:
        return self._faulted(  # type: ignore[no-any-return]
            "ZREM", lambda: self.space.zrem(_b(name), [_b(v) for v in values])
        )

    def lrange(self, name: str | bytes, start: int, end: int) -> list[bytes]:
        return self._faulted(  # type: ignore[no-any-return]
            "LRANGE", lambda: self.space.lrange(_b(name), start, end)
        )

    def zrange(self, name: str | bytes, start: int, end: int) -> list[bytes]:
        def call() -> list[bytes]:
            members = [m for m, _ in self.space.zsorted(_b(name))]
            first, last = Keyspace._span(len(members), start, end)
            return members[first : last + 1] if first <= last else []

        return self._faulted("ZRANGE", call)  # type: ignore[no-any-return]

    def zrangebyscore(
        self,
        name: str | bytes,
        low: Any,
        high: Any,
        start: int | None = None,
        num: int | None = None,
        withscores: bool = False,
    ) -> list[Any]:
        lo = float("-inf") if low == "-inf" else float(low)
        hi = float("inf") if high == "+inf" else float(high)

        def call() -> list[Any]:
            hits = [(m, s) for m, s in self.space.zsorted(_b(name)) if lo <= s <= hi]
            if start is not None and num is not None:
                hits = hits[start : start + num]
            return [(m, s) for m, s in hits] if withscores else [m for m, _ in hits]

        return self._faulted("ZRANGEBYSCORE", call)  # type: ignore[no-any-return]
