"""What every part of the Redis store shares: the client, the script runner, and the one
place where redis-py errors become ratchet's typed errors.

A ``ResponseError`` is the server refusing a command (a script error, a wrong type):
:class:`~ratchet.errors.StoreProtocolError`. Every other ``RedisError`` (connection
refused, dropped, timed out, cluster down, loading) means the outcome is unknown:
:class:`~ratchet.errors.StoreUnavailableError`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, TypeVar

from redis.exceptions import OutOfMemoryError, RedisError, ResponseError

from ratchet.errors import (
    CheckpointTooLargeError,
    ConfigurationError,
    ContractError,
    StoreFullError,
    StoreProtocolError,
    StoreUnavailableError,
)
from ratchet.leasing.scripts import ScriptName, ScriptRunner

__all__ = [
    "StorePlumbing",
    "call",
    "check_blob",
    "member_text",
    "reachable",
    "run_script",
    "store_full",
]

_T = TypeVar("_T")


def _decodes_responses(client: Any) -> bool:
    kwargs: Any = None
    pool = getattr(client, "connection_pool", None)
    if pool is not None:
        kwargs = getattr(pool, "connection_kwargs", None)
    if kwargs is None and callable(getattr(client, "get_connection_kwargs", None)):
        kwargs = client.get_connection_kwargs()
    return bool(isinstance(kwargs, dict) and kwargs.get("decode_responses"))


def store_full(exc: ResponseError, what: str, run_id: str | None) -> StoreFullError | None:
    """The typed error for Redis refusing writes (``OOM``: maxmemory under noeviction;
    ``MISCONF``: persistence failing, e.g. the AOF's disk is full), else None."""
    text = str(exc)
    if (
        isinstance(exc, OutOfMemoryError)
        or text.startswith("OOM")
        or ("command not allowed when used memory" in text)
    ):
        return StoreFullError(
            f"Redis is out of memory and refuses writes ({what}): free memory or raise maxmemory",
            reason="oom",
            run_id=run_id,
        )
    if text.startswith("MISCONF") or "MISCONF" in text[:200]:
        return StoreFullError(
            f"Redis cannot persist and refuses writes ({what}): check the disk its AOF is on",
            reason="misconf",
            run_id=run_id,
        )
    return None


@contextmanager
def reachable(what: str, run_id: str | None) -> Iterator[None]:
    """Translate redis-py errors raised inside the block (see the module docstring)."""
    try:
        yield
    except ResponseError as exc:
        full = store_full(exc, what, run_id)
        if full is not None:
            raise full from exc
        raise StoreProtocolError(
            f"Redis refused {what}", run_id=run_id, cause=type(exc).__name__
        ) from exc
    except RedisError as exc:
        raise StoreUnavailableError(
            f"Redis unreachable during {what}", run_id=run_id, cause=type(exc).__name__
        ) from exc


def call(what: str, run_id: str | None, fn: Callable[[], _T]) -> _T:
    """``fn()`` with its redis-py errors translated (what the store's parts share)."""
    with reachable(what, run_id):
        return fn()


def run_script(
    runner: ScriptRunner,
    name: ScriptName,
    run_id: str | None,
    keys: Sequence[str],
    args: Sequence[str | bytes | int],
) -> Any:
    """One script call on the runner's pool, its errors translated."""
    return call(name.value, run_id, lambda: runner.run(name, keys, args))


def check_blob(blob: bytes, run_id: str, field: str, limit: int) -> None:
    """Refuse what is not non-empty bytes (ContractError) or is over ``limit``
    (CheckpointTooLargeError) before it is sent."""
    if not isinstance(blob, bytes) or not blob:
        raise ContractError(f"{field} must be non-empty bytes", field=field, run_id=run_id)
    if len(blob) > limit:
        raise CheckpointTooLargeError(
            f"{field} exceeds the configured cap",
            reason="too_large",
            field=field,
            run_id=run_id,
            size=len(blob),
            limit=limit,
        )


def member_text(value: object) -> str:
    """An index member as text. Raises StoreProtocolError for a reply that is not one."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, str):
        return value
    raise StoreProtocolError("index member is not a string")


class StorePlumbing:
    """A Redis client that must not decode responses (checkpoints are bytes), the scripts
    run on it, and error translation. Raises ConfigurationError for a decoding client."""

    def __init__(self, client: Any) -> None:
        if _decodes_responses(client):
            raise ConfigurationError("the Redis client must use decode_responses=False")
        self._client = client
        self._runner = ScriptRunner(client)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(client={type(self._client).__name__})"

    @property
    def client(self) -> Any:
        return self._client

    def _reachable(self, what: str, run_id: str | None) -> AbstractContextManager[None]:
        return reachable(what, run_id)

    def _call(self, what: str, run_id: str | None, fn: Callable[[], _T]) -> _T:
        return call(what, run_id, fn)

    def _run(
        self, name: ScriptName, run_id: str, keys: Sequence[str], args: Sequence[str | bytes | int]
    ) -> Any:
        return run_script(self._runner, name, run_id, keys, args)

    def load_scripts(self) -> None:
        """Load every script now. Raises StoreUnavailableError, StoreProtocolError."""
        self._call("SCRIPT LOAD", None, self._runner.load_all)

    def _check_blob(self, blob: bytes, run_id: str, field: str, limit: int) -> None:
        check_blob(blob, run_id, field, limit)

    @staticmethod
    def _member(value: object) -> str:
        return member_text(value)
