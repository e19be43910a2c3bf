"""The store's identity: its epoch record and whether it may evict keys.

``ratchet:store:epoch`` is written once, when a store is initialised (``ratchet store
init``; the embedded default does it when it creates its store). A store without it, or
with another one than a process started with, is not the same store: it was wiped,
restarted without its AOF, lost keys to eviction, or is another one, and nothing runs on
it. A ``maxmemory-policy`` other than ``noeviction`` may drop runs, leases and high-water
marks silently, so workers and submit refuse it (see ``Fleet.check_eviction_policy``).

:class:`ratchet.leasing.store.RedisStore` holds one :class:`StoreIdentity` as
``store.identity``.
"""

from __future__ import annotations

import secrets
from typing import Any

from redis.exceptions import RedisError

from ratchet.errors import StoreEpochError, StoreProtocolError
from ratchet.leasing.keyspace import EPOCH_KEY
from ratchet.leasing.plumbing import call

__all__ = ["StoreIdentity"]


class StoreIdentity:
    """The epoch record and the eviction policy of the store on ``client`` (see the module
    docstring)."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def init_epoch(self) -> str:
        """Give a new store its epoch (``SET NX``); an initialised store keeps its own.
        Returns the store's epoch. Raises StoreUnavailableError, StoreFullError."""
        fresh = f"ep-{secrets.token_hex(12)}"
        call("epoch init", None, lambda: self._client.set(EPOCH_KEY, fresh.encode(), nx=True))
        epoch = self.read_epoch()
        if epoch is None:
            raise StoreProtocolError("the store's epoch could not be written")
        return epoch

    def read_epoch(self) -> str | None:
        """The store's epoch, or None when it has none. Raises StoreUnavailableError,
        StoreProtocolError (a malformed record)."""
        raw = call("epoch read", None, lambda: self._client.get(EPOCH_KEY))
        if raw is None:
            return None
        text = raw.decode("ascii", "replace") if isinstance(raw, bytes) else str(raw)
        if not text.startswith("ep-") or len(text) != 27:
            raise StoreProtocolError("the store's epoch record is malformed")
        return text

    def check_epoch(self, expected: str | None = None) -> str:
        """The store's epoch, checked: present, and ``expected`` when given.

        Raises:
            StoreEpochError: no epoch (wiped, restarted without its AOF, evicted, or never
                initialised) or another one than ``expected``.
        """
        epoch = self.read_epoch()
        if epoch is None:
            raise StoreEpochError(
                "the store has no epoch record: it was wiped, restarted without its AOF, "
                "lost keys to eviction, or was never initialised. Nothing runs on it; if "
                "it is a new store, initialise it with `ratchet store init`",
                reason="missing",
            )
        if expected is not None and epoch != expected:
            raise StoreEpochError(
                "the store's epoch changed since this process started: it is not the same store",
                reason="changed",
                expected=expected,
                found=epoch,
            )
        return epoch

    def eviction_policy(self) -> str | None:
        """Redis' ``maxmemory-policy`` (``CONFIG GET``, else ``INFO memory``), or None when
        neither may be read (an ACL forbids both)."""
        try:
            reply = self._client.config_get("maxmemory-policy")
            value = reply.get("maxmemory-policy") if isinstance(reply, dict) else None
            if value is not None:
                return value.decode() if isinstance(value, bytes) else str(value)
        except RedisError:
            pass
        try:
            info = self._client.info("memory")
        except RedisError:
            return None
        value = info.get("maxmemory_policy") if isinstance(info, dict) else None
        return None if value is None else str(value)
