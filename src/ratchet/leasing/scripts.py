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
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from importlib import resources
from typing import Any

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
    source = resources.files(package).joinpath("lua", f"{name.value}.lua").read_text(
        encoding="utf-8"
    )
    sha = hashlib.sha1(source.encode("utf-8"), usedforsecurity=False).hexdigest()
    return LuaScript(name=name, source=source, sha=sha)


_SCRIPTS: dict[StrEnum, LuaScript] = {name: load_script(name) for name in ScriptName}


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

    def load_all(self) -> None:
        """Load every script now (otherwise each is loaded on its first NOSCRIPT)."""
        for script in self._scripts.values():
            self._load(script)

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

    def run(self, name: StrEnum, keys: Sequence[str], args: Sequence[str | bytes | int]) -> Any:
        """Run script ``name`` with ``keys`` and ``args`` and return the raw reply.

        Raises redis ConnectionError / TimeoutError as they come (the caller decides what an
        unknown outcome means), redis ResponseError for a script error (NoPermissionError
        when the Redis user may not run a command the script issues), and
        StoreProtocolError when the script is missing and this user may not load it.
        """
        script = self._scripts[name]
        try:
            return self._client.evalsha(script.sha, len(keys), *keys, *args)
        except NoScriptError:
            self._reload(script)
            return self._client.evalsha(script.sha, len(keys), *keys, *args)

    def _reload(self, script: LuaScript) -> None:
        try:
            self._load(script)
        except NoPermissionError:
            # A least-privilege user (EVALSHA only) never loads scripts itself.
            raise StoreProtocolError(
                "the script is not loaded on the server and this Redis user may not "
                "load it; load the scripts with the admin user "
                "(ratchet redis load-scripts)", script=script.name.value) from None
