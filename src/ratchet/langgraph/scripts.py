"""The saver's Lua scripts (package data under ``ratchet/langgraph/lua/``) and their runners.

The sync runner is :class:`ratchet.leasing.scripts.ScriptRunner` given this package's
scripts. :class:`AsyncScriptRunner` is the same pattern for ``redis.asyncio`` clients:
``SCRIPT LOAD`` once per script and client, then ``EVALSHA``; on ``NOSCRIPT`` (after
``SCRIPT FLUSH``, a restart or a failover) load again and repeat the call once, which is
safe because a script that was not found did not run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Any

from redis.exceptions import NoScriptError

from ratchet.errors import StoreProtocolError
from ratchet.leasing.scripts import LuaScript, ScriptName, ScriptRunner, load_script

__all__ = ["SCRIPTS", "AsyncScriptRunner", "LgScript", "sync_runner"]


class LgScript(StrEnum):
    """The saver's scripts; the value is the file name without ``.lua``."""

    PUT = "put"
    PUT_WRITES = "put_writes"
    READ = "read"
    LIST = "list"
    REWRITE = "rewrite"
    LEASE_INFO = "lease_info"
    TAKEOVER = "takeover"


# Claiming, renewing and releasing a thread's lease are the runs' own scripts (one lease
# core: ratchet/leasing/lua/acquire_lease.lua, renew_lease.lua and release_lease.lua, on
# the thread's meta hash). Only the operator's takeover of a live lease, which runs never
# do, is the saver's own (lua/takeover.lua).
LEASE_SCRIPTS = (ScriptName.ACQUIRE_LEASE, ScriptName.RENEW_LEASE, ScriptName.RELEASE_LEASE)
SCRIPTS: Mapping[StrEnum, LuaScript] = {
    **{name: load_script(name, "ratchet.langgraph") for name in LgScript},
    **{name: load_script(name) for name in LEASE_SCRIPTS},
}


def sync_runner(client: Any) -> ScriptRunner:
    """A runner of the saver's scripts on a sync client (redis.Redis, RedisCluster, fake)."""
    return ScriptRunner(client, SCRIPTS)


class AsyncScriptRunner:
    """Runs the saver's scripts on an asyncio client (``redis.asyncio.Redis`` or fake)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._loaded: set[StrEnum] = set()

    async def _load(self, script: LuaScript) -> None:
        sha = await self._client.script_load(script.source)
        if isinstance(sha, bytes):
            sha = sha.decode("ascii", errors="replace")
        if sha != script.sha:
            raise StoreProtocolError(
                "SCRIPT LOAD returned an unexpected SHA", script=script.name.value
            )
        self._loaded.add(script.name)

    async def run(
        self, name: StrEnum, keys: Sequence[str], args: Sequence[str | bytes | int]
    ) -> Any:
        """Run script ``name`` and return the raw reply.

        Raises redis ConnectionError / TimeoutError as they come and redis ResponseError for
        a script error.
        """
        script = SCRIPTS[name]
        if name not in self._loaded:
            # Two coroutines may both load a script the first time; loading is idempotent.
            await self._load(script)
        try:
            return await self._client.evalsha(script.sha, len(keys), *keys, *args)
        except NoScriptError:
            await self._load(script)
            return await self._client.evalsha(script.sha, len(keys), *keys, *args)
