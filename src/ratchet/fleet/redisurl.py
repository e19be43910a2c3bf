"""Redis clients from the URLs in settings: one primary, or the primary Sentinel names.

* ``redis://[user:password@]host:port/db``, ``rediss://...``, ``unix://...``: redis-py's own
  URL forms, one server.
* ``redis+cluster://[user:password@]host:port[,host:port...]``: a Redis Cluster, these
  nodes as its start-up nodes (redis-py's :class:`redis.cluster.RedisCluster` finds the
  rest and follows slot moves and failovers). RQ cannot use a Cluster: the queue then
  needs ``RATCHET_QUEUE_REDIS_URL`` on a server of its own.
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
from redis.cluster import ClusterNode, RedisCluster
from redis.sentinel import Sentinel

from ratchet.errors import ConfigurationError

__all__ = [
    "CLUSTER_SCHEME",
    "SENTINEL_SCHEME",
    "SentinelTarget",
    "is_cluster_url",
    "parse_cluster_url",
    "parse_sentinel_url",
    "redis_client",
]

SENTINEL_SCHEME = "redis+sentinel"
CLUSTER_SCHEME = "redis+cluster"


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


_FORMS = {
    SENTINEL_SCHEME: f"{SENTINEL_SCHEME}://[user:password@]host:port[,host:port]/service[/db]",
    CLUSTER_SCHEME: f"{CLUSTER_SCHEME}://[user:password@]host:port[,host:port]",
}


def _bad(part: str, scheme: str = SENTINEL_SCHEME) -> ConfigurationError:
    return ConfigurationError(
        f"the {scheme}:// URL's {part} is malformed (expected {_FORMS[scheme]})",
        field="redis_url",
    )


def _nodes(netloc: str, scheme: str) -> tuple[list[tuple[str, int]], str | None, str | None]:
    """``[user:password@]host:port[,host:port]``: the addresses and the credentials."""
    username = password = None
    if "@" in netloc:
        userinfo, _, netloc = netloc.rpartition("@")
        user, sep, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if sep else None
    nodes = []
    for address in netloc.split(","):
        host, sep, port = address.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise _bad("host:port list", scheme)
        nodes.append((host.strip("[]"), int(port)))
    return nodes, username, password


def is_cluster_url(url: str) -> bool:
    return urlsplit(url).scheme == CLUSTER_SCHEME


def parse_cluster_url(url: str) -> tuple[list[tuple[str, int]], str | None, str | None]:
    """``(start-up nodes, username, password)`` of a ``redis+cluster://`` URL. Raises
    ConfigurationError (never quoting it)."""
    parts = urlsplit(url)
    if parts.scheme != CLUSTER_SCHEME:
        raise _bad("scheme", CLUSTER_SCHEME)
    if parts.path.strip("/"):
        raise _bad("path (a Cluster has one database)", CLUSTER_SCHEME)
    return _nodes(parts.netloc, CLUSTER_SCHEME)


def parse_sentinel_url(url: str) -> SentinelTarget:
    """Parse a ``redis+sentinel://`` URL. Raises ConfigurationError (never quoting it)."""
    parts = urlsplit(url)
    if parts.scheme != SENTINEL_SCHEME:
        raise _bad("scheme")
    sentinels, username, password = _nodes(parts.netloc, SENTINEL_SCHEME)
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise _bad("service name")
    db = 0
    if len(path) == 2:
        if not path[1].isdigit():
            raise _bad("database number")
        db = int(path[1])
    return SentinelTarget(sentinels, unquote(path[0]), db, username, password)


def redis_client(url: str, **kwargs: Any) -> Any:
    """A client for ``url`` (``decode_responses`` left False; ``kwargs`` are connection
    options such as ``socket_timeout``): a ``redis.Redis``, or a ``RedisCluster`` for a
    ``redis+cluster://`` URL. Raises ConfigurationError for a malformed URL."""
    if is_cluster_url(url):
        nodes, username, password = parse_cluster_url(url)
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in nodes],  # type: ignore[no-untyped-call]
            username=username,
            password=password,
            **kwargs,
        )
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
