"""Redis clients from the URLs in settings: one primary, or the primary Sentinel names.

* ``redis://[user:password@]host:port/db``, ``rediss://...``, ``unix://...``: redis-py's own
  URL forms, one server.
* ``redis+sentinel://[user:password@]host:port[,host:port...]/service[/db]``: ask these
  Sentinels which server is the primary of ``service``; every new connection asks again,
  so after a failover the client reconnects to the promoted replica. The credentials are
  the data servers' (the Sentinels are asked without any). redis-py's
  :class:`redis.sentinel.Sentinel` does the asking.

The URL may hold a password: nothing here puts it in a message (errors name the scheme and
the part that is wrong, never the URL).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from redis.sentinel import Sentinel

from ratchet.errors import ConfigurationError

__all__ = ["SENTINEL_SCHEME", "SentinelTarget", "parse_sentinel_url", "redis_client"]

SENTINEL_SCHEME = "redis+sentinel"


class SentinelTarget:
    """What a ``redis+sentinel://`` URL names (see the module docstring)."""

    __slots__ = ("db", "password", "sentinels", "service", "username")

    def __init__(
        self,
        sentinels: list[tuple[str, int]],
        service: str,
        db: int,
        username: str | None,
        password: str | None,
    ) -> None:
        self.sentinels = sentinels
        self.service = service
        self.db = db
        self.username = username
        self.password = password

    def __repr__(self) -> str:  # never the password
        return f"SentinelTarget(sentinels={self.sentinels!r}, service={self.service!r})"


def _bad(part: str) -> ConfigurationError:
    return ConfigurationError(
        f"the {SENTINEL_SCHEME}:// URL's {part} is malformed "
        f"(expected {SENTINEL_SCHEME}://[user:password@]host:port[,host:port]/service[/db])",
        field="redis_url",
    )


def parse_sentinel_url(url: str) -> SentinelTarget:
    """Parse a ``redis+sentinel://`` URL. Raises ConfigurationError (never quoting it)."""
    parts = urlsplit(url)
    if parts.scheme != SENTINEL_SCHEME:
        raise _bad("scheme")
    netloc = parts.netloc
    username = password = None
    if "@" in netloc:
        userinfo, _, netloc = netloc.rpartition("@")
        user, sep, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if sep else None
    sentinels = []
    for address in netloc.split(","):
        host, sep, port = address.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise _bad("host:port list")
        sentinels.append((host.strip("[]"), int(port)))
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise _bad("service name")
    db = 0
    if len(path) == 2:
        if not path[1].isdigit():
            raise _bad("database number")
        db = int(path[1])
    return SentinelTarget(sentinels, unquote(path[0]), db, username, password)


def redis_client(url: str, **kwargs: Any) -> redis.Redis:
    """A client for ``url`` (``decode_responses`` left False; ``kwargs`` are connection
    options such as ``socket_timeout``). Raises ConfigurationError for a malformed URL."""
    if urlsplit(url).scheme != SENTINEL_SCHEME:
        try:
            return redis.Redis.from_url(url, **kwargs)
        except ValueError:
            raise ConfigurationError(
                "the Redis URL is malformed (redis://, rediss://, unix:// or "
                f"{SENTINEL_SCHEME}://)",
                field="redis_url",
            ) from None
    target = parse_sentinel_url(url)
    asking = {k: v for k, v in kwargs.items() if k in ("socket_timeout", "socket_connect_timeout")}
    sentinel = Sentinel(target.sentinels, sentinel_kwargs=asking, **kwargs)
    client: redis.Redis = sentinel.master_for(
        target.service,
        db=target.db,
        username=target.username,
        password=target.password,
        **kwargs,
    )
    return client
