"""Where runs live: a run's host (a routing hint) and when each host was last seen.

A run whose environment is host-local (a workspace folder on one machine's disk) is
bound to its host by its signed run document. Two unsigned records help the fleet route
it without opening it:

* ``host`` in the run's state hash (``ratchet:{<run>}:state``): the host named by the
  document, written at submit. Every path that enqueues the run (the reaper, approve,
  review, retry, cancel) reads it to pick the host's queue. It is a hint and harmless by
  construction: a worker that takes a job checks the signed document's host before it
  builds anything, and routes a misrouted run on. Absent for runs created before it, and
  for runs on shared environments only: those go to the shared queue.
* ``ratchet:hosts`` (zset): host name scored by the Redis time (ms) a worker of that host
  last reported in (each reaper tick). A host not seen for ``host_timeout_ms`` is gone:
  its runs wait for it visibly, and the reaper stops handing them to its queue.

:class:`ratchet.leasing.store.RedisStore` holds one :class:`HostRecords` as
``store.hosts``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ratchet.errors import ContractError
from ratchet.leasing.keyspace import HOSTS_KEY, check_id, run_keys
from ratchet.leasing.plumbing import call

__all__ = ["HostRecords"]


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class HostRecords:
    """The host records of a store (see the module docstring), on its ``client``;
    ``clock`` is Redis' time in ms (the store's ``server_time_ms``), what "last seen" is
    measured in."""

    def __init__(self, client: Any, clock: Callable[[], int]) -> None:
        self._client = client
        self._clock = clock

    def set_run_host(self, run_id: str, host: str) -> None:
        """Record ``host`` as where ``run_id``'s jobs go. Raises StoreUnavailableError."""
        check_id(run_id, "run_id")
        check_id(host, "host")
        key = run_keys(run_id).state
        call("run host", run_id, lambda: self._client.hset(key, "host", host))

    def run_host(self, run_id: str) -> str | None:
        """The host ``run_id``'s jobs go to (None: the shared queue). A value that is not a
        host name reads as none: the worker that takes the job routes it by the signed
        document. Raises StoreUnavailableError."""
        check_id(run_id, "run_id")
        key = run_keys(run_id).state
        raw = call("run host", run_id, lambda: self._client.hmget(key, ["host"]))
        value = raw[0] if isinstance(raw, list) and raw else None
        if value is None:
            return None
        try:
            return check_id(_text(value), "host")
        except ContractError:  # junk in an unsigned hint routes nowhere special
            return None

    def placement(self, run_id: str) -> bytes | None:
        """The run's stored placement (signed bytes; None: never moved). Raises
        StoreUnavailableError."""
        key = run_keys(run_id).placement
        value = call("placement", run_id, lambda: self._client.get(key))
        return value if isinstance(value, bytes) else None

    def set_placement(self, run_id: str, blob: bytes) -> None:
        """Store the run's placement (signed by the caller). Raises StoreUnavailableError."""
        key = run_keys(run_id).placement
        call("placement", run_id, lambda: self._client.set(key, blob))

    def note(self, host: str) -> int:
        """Record that a worker of ``host`` is alive now (Redis time). Returns that time.

        Raises StoreUnavailableError, StoreProtocolError.
        """
        check_id(host, "host")
        now_ms = self._clock()
        call("hosts", None, lambda: self._client.zadd(HOSTS_KEY, {host: now_ms}))
        return now_ms

    def seen(self) -> tuple[dict[str, int], int]:
        """Every host ever seen with the Redis time (ms) it was last seen, and Redis' now.

        Raises StoreUnavailableError.
        """
        raw = call("hosts", None, lambda: self._client.zrange(HOSTS_KEY, 0, -1, withscores=True))
        seen = {_text(member): int(score) for member, score in raw}
        return seen, self._clock()
