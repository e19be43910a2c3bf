"""The Lua scripts, loaded from package data, and the runner that calls them by SHA.

Each script is one ``.lua`` file under ``ratchet/leasing/lua/`` whose header names every
``KEYS[i]``, every ``ARGV[i]`` with its unit, and every reply.

:class:`ScriptRunner` sends ``SCRIPT LOAD`` once per script and client, then calls
``EVALSHA`` with the loaded SHA. If the server answers ``NOSCRIPT`` (after ``SCRIPT
FLUSH``, a restart without the script cache, or a failover to a node that never saw the
script) it loads the script again and repeats the call once. Repeating is safe: a script
that was not found did not run. redis-py ``Script`` objects are not used, because inside
pipelines they add a ``SCRIPT EXISTS`` round trip per execute.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from importlib import resources
from typing import Any

from redis.exceptions import NoScriptError

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


@dataclass(frozen=True, slots=True)
class LuaScript:
    name: ScriptName
    source: str
    sha: str


def load_script(name: ScriptName) -> LuaScript:
    """Read one script from package data and compute its SHA-1 (what Redis names it by)."""
    source = resources.files("ratchet.leasing").joinpath("lua", f"{name.value}.lua").read_text(
        encoding="utf-8"
    )
    sha = hashlib.sha1(source.encode("utf-8"), usedforsecurity=False).hexdigest()
    return LuaScript(name=name, source=source, sha=sha)


_SCRIPTS: dict[ScriptName, LuaScript] = {name: load_script(name) for name in ScriptName}


class ScriptRunner:
    """Runs ratchet's scripts on one client (a ``redis.Redis``, ``RedisCluster`` or fake)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._loaded: set[ScriptName] = set()
        self._lock = threading.Lock()

    def load_all(self) -> None:
        """Load every script now (otherwise each is loaded on first use)."""
        for name in ScriptName:
            self._load(_SCRIPTS[name])

    def _load(self, script: LuaScript) -> None:
        # On a cluster client SCRIPT LOAD goes to every primary.
        sha = self._client.script_load(script.source)
        if isinstance(sha, bytes):
            sha = sha.decode("ascii", errors="replace")
        if sha != script.sha:
            raise StoreProtocolError(
                "SCRIPT LOAD returned an unexpected SHA", script=script.name.value
            )
        with self._lock:
            self._loaded.add(script.name)

    def run(self, name: ScriptName, keys: Sequence[str], args: Sequence[str | bytes | int]) -> Any:
        """Run script ``name`` with ``keys`` and ``args`` and return the raw reply.

        Raises redis ConnectionError / TimeoutError as they come (the caller decides what an
        unknown outcome means) and redis ResponseError for a script error.
        """
        script = _SCRIPTS[name]
        if name not in self._loaded:
            self._load(script)
        try:
            return self._client.evalsha(script.sha, len(keys), *keys, *args)
        except NoScriptError:
            self._load(script)
            return self._client.evalsha(script.sha, len(keys), *keys, *args)
