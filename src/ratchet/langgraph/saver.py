"""``RatchetSaver``: a LangGraph checkpointer on Redis that refuses stale writers and
unsigned or rolled-back state. See ``docs/langgraph.md``.

Every method drives one generator of :mod:`ratchet.langgraph.protocol` (or ``admin``):
the sync methods with a sync Redis client, the async methods with an asyncio client (or,
when only a sync client was given, the sync method in a worker thread). Both therefore
check and store exactly the same things.
"""

from __future__ import annotations

import asyncio
import builtins
import copy
import logging
import os
import secrets
import socket
from collections.abc import AsyncIterator, Collection, Iterator, Sequence
from typing import Any, TypeVar

import redis
import redis.asyncio
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
)
from langgraph.checkpoint.serde.base import SerializerProtocol
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ratchet.errors import (
    ConfigurationError,
    ContractError,
    LeaseLostError,
    StoreProtocolError,
    StoreUnavailableError,
)
from ratchet.langgraph import admin
from ratchet.langgraph.codec import RecordCodec
from ratchet.langgraph.heartbeat import LeaseHeartbeat
from ratchet.langgraph.keyspace import thread_keys
from ratchet.langgraph.protocol import Command, Emit, Op, Protocol, Scan, Script, Step
from ratchet.langgraph.replies import (
    LeaseInfo,
    Takeover,
    ThreadLease,
    decode_claim,
    decode_lease_info,
    decode_release,
    decode_renew,
    decode_takeover,
    decode_takeover_log,
)
from ratchet.langgraph.scripts import AsyncScriptRunner, LgScript, sync_runner
from ratchet.langgraph.writer import ThreadWriter, _Claim
from ratchet.leasing.keyspace import check_id
from ratchet.leasing.scripts import ScriptName
from ratchet.runtime.signing import KeyRing

__all__ = ["DEFAULT_LEASE_TTL_MS", "RatchetSaver", "default_serde"]

DEFAULT_LEASE_TTL_MS = 30_000
TAKEOVER_LOG_SIZE = 64  # takeover records kept per thread, newest first
MAX_REASON_CHARS = 500
_T = TypeVar("_T")
log = logging.getLogger("ratchet.langgraph")
_UNAVAILABLE = (RedisConnectionError, RedisTimeoutError, OSError)


def default_serde() -> JsonPlusSerializer:
    """LangGraph's serializer with no pickle fallback and strict msgpack revival.

    ``pickle_fallback=False``: a value msgpack cannot encode is an error, never pickled.
    ``allowed_msgpack_modules=None``: only LangGraph's built-in safe types are revived on
    load; graphs add their own state types through ``with_allowlist`` when they compile.
    """
    return JsonPlusSerializer(pickle_fallback=False, allowed_msgpack_modules=None)


def _default_owner() -> str:
    host = "".join(c if c.isalnum() or c in "._-" else "-" for c in socket.gethostname())
    return f"{host[:64] or 'host'}-{os.getpid()}-{secrets.token_hex(4)}"


def _decodes(client: Any) -> bool:
    pool = getattr(client, "connection_pool", None)
    kwargs = getattr(pool, "connection_kwargs", None) if pool is not None else None
    return bool(isinstance(kwargs, dict) and kwargs.get("decode_responses"))


class RatchetSaver(BaseCheckpointSaver[str]):
    """A LangGraph checkpointer with fenced writes, signed records and a generation mark.

    ``client`` is a sync Redis client (``redis.Redis``, ``RedisCluster``,
    ``fakeredis.FakeRedis``) and ``aclient`` an asyncio one (``redis.asyncio.Redis``,
    ``fakeredis.FakeAsyncRedis``); give one or both, created with
    ``decode_responses=False``. ``keyring`` signs and verifies every record. ``owner``
    names this worker in leases (default: host, pid and a random suffix);
    ``lease_ttl_ms`` is how long a claim or a fenced write keeps the thread's lease.
    :meth:`claim_write_ownership` hands out writers bound to one claim (LangGraph's
    write-ownership convention; see :mod:`ratchet.langgraph.writer`).

    Raises ConfigurationError for a client that decodes responses, no client at all, a
    serializer that falls back to pickle, or a bad owner or ttl.
    """

    def __init__(
        self,
        client: Any = None,
        *,
        keyring: KeyRing,
        aclient: Any = None,
        owner: str | None = None,
        lease_ttl_ms: int = DEFAULT_LEASE_TTL_MS,
        serde: SerializerProtocol | None = None,
        max_threads: int = 10_000,
    ) -> None:
        if client is None and aclient is None:
            raise ConfigurationError("RatchetSaver needs a sync or an async Redis client")
        if any(_decodes(c) for c in (client, aclient) if c is not None):
            raise ConfigurationError("the Redis client must use decode_responses=False")
        if getattr(serde, "pickle_fallback", False):
            raise ConfigurationError("a serializer with pickle_fallback is refused")
        if isinstance(lease_ttl_ms, bool) or not isinstance(lease_ttl_ms, int) or lease_ttl_ms < 1:
            raise ConfigurationError(
                "lease_ttl_ms must be a positive integer", field="lease_ttl_ms"
            )
        if not isinstance(keyring, KeyRing):
            raise ConfigurationError("keyring must be a ratchet KeyRing")
        super().__init__(serde=serde or default_serde())
        self.owner = check_id(owner or _default_owner(), "owner")
        self.lease_ttl_ms = lease_ttl_ms
        self._client = client
        self._aclient = aclient
        self._runner = sync_runner(client) if client is not None else None
        self._arunner = AsyncScriptRunner(aclient) if aclient is not None else None
        self._protocol = Protocol(
            RecordCodec(keyring, self.serde),
            owner=self.owner,
            lease_ttl_ms=lease_ttl_ms,
            max_threads=max_threads,
        )

    @classmethod
    def from_url(cls, url: str, *, keyring: KeyRing, **kwargs: Any) -> RatchetSaver:
        """A saver with a sync and an asyncio client for ``url`` (``redis://host:port/db``)."""
        return cls(
            redis.Redis.from_url(url, decode_responses=False),
            keyring=keyring,
            aclient=redis.asyncio.Redis.from_url(url, decode_responses=False),
            **kwargs,
        )

    def __repr__(self) -> str:
        return f"RatchetSaver(owner={self.owner!r}, lease_ttl_ms={self.lease_ttl_ms})"

    def with_allowlist(self, extra_allowlist: Collection[tuple[str, ...]]) -> RatchetSaver:
        """A shallow clone whose serializer also revives ``extra_allowlist`` types.

        The clone shares the clients and the per-thread witness with this saver.
        """
        clone = super().with_allowlist(extra_allowlist)
        if clone is self or not isinstance(clone, RatchetSaver):
            return self
        protocol = copy.copy(self._protocol)
        protocol.codec = RecordCodec(self._protocol.codec.keyring, clone.serde)
        clone._protocol = protocol
        return clone

    def get_next_version(self, current: str | None, channel: None) -> str:
        """Versions with a random suffix, so a fork never reuses a version of another branch
        (the same scheme as LangGraph's own savers)."""
        if current is None:
            number = 0
        elif isinstance(current, int):
            number = current
        else:
            number = int(str(current).split(".")[0])
        return f"{number + 1:032}.{secrets.randbelow(10**16):016}"

    # -- drivers --------------------------------------------------------------------------

    def _call(self, step: Script | Command | Scan) -> Any:
        if self._runner is None:
            raise ConfigurationError("this saver has no sync Redis client")
        try:
            if isinstance(step, Script):
                return self._runner.run(step.name, step.keys, step.args)
            if isinstance(step, Scan):
                # scan_iter walks every primary of a RedisCluster, and one server otherwise.
                return [*self._client.scan_iter(match=step.match, count=step.count)]
            return self._client.execute_command(*step.args)
        except _UNAVAILABLE as exc:
            raise StoreUnavailableError(f"Redis unavailable: {type(exc).__name__}") from None
        except ResponseError as exc:
            raise StoreProtocolError(f"Redis refused a call: {exc}") from None

    async def _acall(self, step: Script | Command | Scan) -> Any:
        if self._arunner is None:
            raise ConfigurationError("this saver has no async Redis client")
        try:
            if isinstance(step, Script):
                return await self._arunner.run(step.name, step.keys, step.args)
            if isinstance(step, Scan):
                return [
                    k async for k in self._aclient.scan_iter(match=step.match, count=step.count)
                ]
            return await self._aclient.execute_command(*step.args)
        except _UNAVAILABLE as exc:
            raise StoreUnavailableError(f"Redis unavailable: {type(exc).__name__}") from None
        except ResponseError as exc:
            raise StoreProtocolError(f"Redis refused a call: {exc}") from None

    def _drive(self, op: Op[_T]) -> _T:
        reply: Any = None
        while True:
            try:
                step: Step = op.send(reply)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            if isinstance(step, Emit):
                raise StoreProtocolError("an operation emitted outside a listing")
            reply = self._call(step)

    async def _adrive(self, op: Op[_T]) -> _T:
        reply: Any = None
        while True:
            try:
                step: Step = op.send(reply)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            if isinstance(step, Emit):
                raise StoreProtocolError("an operation emitted outside a listing")
            reply = await self._acall(step)

    def _iterate(self, op: Op[None]) -> Iterator[CheckpointTuple]:
        reply: Any = None
        while True:
            try:
                step: Step = op.send(reply)
            except StopIteration:
                return
            if isinstance(step, Emit):
                reply = None
                yield step.item
            else:
                reply = self._call(step)

    async def _aiterate(self, op: Op[None]) -> AsyncIterator[CheckpointTuple]:
        reply: Any = None
        while True:
            try:
                step: Step = op.send(reply)
            except StopIteration:
                return
            if isinstance(step, Emit):
                reply = None
                yield step.item
            else:
                reply = await self._acall(step)

    async def _arun(self, make: Any) -> Any:
        if self._arunner is not None:
            return await self._adrive(make())
        return await asyncio.to_thread(self._drive, make())

    # -- BaseCheckpointSaver: sync --------------------------------------------------------

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """The checkpoint named by ``config`` (or its namespace's head) with its values and
        pending writes, or None. Raises CheckpointError for anything that does not verify
        or is not fresh, StoreUnavailableError, StoreProtocolError."""
        return self._drive(self._protocol.get_tuple(config))

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        """Checkpoints of a thread, newest first by the store's generation (not by id).
        ``checkpoint_ns`` absent lists every namespace.

        With ``config`` None (or no thread id in it), the checkpoints of every thread:
        threads in thread id order (found with one SCAN of the saver's keys), each newest
        first; ``filter`` and ``limit`` apply across them, and ``before`` (a listed
        tuple's config: thread id and checkpoint id) resumes after that checkpoint.
        Raises ContractError (a checkpoint id without a thread id, such a ``before``
        without both), CheckpointError, StoreUnavailableError."""
        return self._iterate(self._protocol.list(config, filter=filter, before=before, limit=limit))

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        """Store a checkpoint as its namespace's head, fenced by the thread's lease.

        Returns the config of the stored checkpoint, with the lease it was written under.
        Raises LeaseLostError, LeaseHeldElsewhereError, GenerationMismatchError,
        ContractError, CheckpointError, StoreUnavailableError (outcome unknown).
        """
        return self._drive(self._protocol.put(config, checkpoint, metadata, new_versions))

    def put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        """Store pending writes, fenced like :meth:`put`. Raises the same errors."""
        self._drive(self._protocol.put_writes(config, writes, task_id, task_path))

    def delete_thread(self, thread_id: str) -> None:
        """Drop a thread's checkpoints and writes under a new generation; end its lease."""
        self._drive(admin.delete_thread(self._protocol, str(thread_id)))

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Drop the checkpoints of the given LangGraph runs; heads move forward."""
        self._drive(admin.delete_for_runs(self._protocol, run_ids))

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """``keep_latest`` keeps each namespace's head; ``delete`` deletes the threads."""
        self._drive(admin.prune(self._protocol, [str(t) for t in thread_ids], strategy))

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy every checkpoint and write, re-signed, onto the target (claimed)."""
        self._drive(admin.copy_thread(self._protocol, str(source_thread_id), str(target_thread_id)))

    # -- BaseCheckpointSaver: async -------------------------------------------------------

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """Async :meth:`get_tuple`."""
        result: CheckpointTuple | None = await self._arun(lambda: self._protocol.get_tuple(config))
        return result

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        """Async :meth:`list`."""
        op = self._protocol.list(config, filter=filter, before=before, limit=limit)
        if self._arunner is not None:
            async for item in self._aiterate(op):
                yield item
            return
        for item in await asyncio.to_thread(lambda: [*self._iterate(op)]):
            yield item

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        """Async :meth:`put`."""
        result: RunnableConfig = await self._arun(
            lambda: self._protocol.put(config, checkpoint, metadata, new_versions)
        )
        return result

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        """Async :meth:`put_writes`."""
        await self._arun(lambda: self._protocol.put_writes(config, writes, task_id, task_path))

    async def adelete_thread(self, thread_id: str) -> None:
        """Async :meth:`delete_thread`."""
        await self._arun(lambda: admin.delete_thread(self._protocol, str(thread_id)))

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Async :meth:`delete_for_runs`."""
        await self._arun(lambda: admin.delete_for_runs(self._protocol, run_ids))

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """Async :meth:`prune`."""
        await self._arun(
            lambda: admin.prune(self._protocol, [str(t) for t in thread_ids], strategy)
        )

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Async :meth:`copy_thread`."""
        await self._arun(
            lambda: admin.copy_thread(self._protocol, str(source_thread_id), str(target_thread_id))
        )

    # -- leases ---------------------------------------------------------------------------

    def _claim(self, thread_id: str, ttl_ms: int | None) -> Op[ThreadLease]:
        keys = thread_keys(thread_id)
        reply = yield Script(
            ScriptName.ACQUIRE_LEASE,
            (keys.meta, keys.meta),
            (self.owner, ttl_ms or self.lease_ttl_ms, "", thread_id),
        )
        return decode_claim(reply, thread_id, self.owner)

    def _renew(self, lease: ThreadLease, ttl_ms: int | None) -> Op[ThreadLease]:
        reply = yield Script(
            ScriptName.RENEW_LEASE,
            (thread_keys(lease.thread_id).meta,),
            (lease.owner, lease.lease_version, ttl_ms or self.lease_ttl_ms),
        )
        return decode_renew(reply, lease)

    def _release(self, lease: ThreadLease) -> Op[None]:
        reply = yield Script(
            ScriptName.RELEASE_LEASE,
            (thread_keys(lease.thread_id).meta,),
            (lease.owner, lease.lease_version),
        )
        decode_release(reply, lease)

    def _lease_info(self, thread_id: str) -> Op[LeaseInfo]:
        reply = yield Script(LgScript.LEASE_INFO, (thread_keys(thread_id).meta,), ())
        return decode_lease_info(reply, thread_id)

    def claim(self, thread_id: str, *, ttl_ms: int | None = None) -> ThreadLease:
        """Take the thread's lease (free, expired or already ours): a new lease version that
        fences out every earlier holder. Raises LeaseHeldElsewhereError."""
        return self._drive(self._claim(str(thread_id), ttl_ms))

    def renew(self, lease: ThreadLease, *, ttl_ms: int | None = None) -> ThreadLease:
        """Extend a live lease. Raises LeaseLostError (lost or expired)."""
        return self._drive(self._renew(lease, ttl_ms))

    def release(self, lease: ThreadLease) -> None:
        """Give a lease up (the version stays). Raises LeaseLostError."""
        self._drive(self._release(lease))

    def lease_info(self, thread_id: str) -> LeaseInfo:
        """The thread's lease and generation as Redis reads them now."""
        return self._drive(self._lease_info(str(thread_id)))

    async def aclaim(self, thread_id: str, *, ttl_ms: int | None = None) -> ThreadLease:
        """Async :meth:`claim`."""
        result: ThreadLease = await self._arun(lambda: self._claim(str(thread_id), ttl_ms))
        return result

    async def arenew(self, lease: ThreadLease, *, ttl_ms: int | None = None) -> ThreadLease:
        """Async :meth:`renew`."""
        result: ThreadLease = await self._arun(lambda: self._renew(lease, ttl_ms))
        return result

    async def arelease(self, lease: ThreadLease) -> None:
        """Async :meth:`release`."""
        await self._arun(lambda: self._release(lease))

    async def alease_info(self, thread_id: str) -> LeaseInfo:
        """Async :meth:`lease_info`."""
        result: LeaseInfo = await self._arun(lambda: self._lease_info(str(thread_id)))
        return result

    # -- write ownership (LangGraph's write_ownership convention) ---------------------------

    def _takeover(self, thread_id: str, reason: str) -> Op[tuple[ThreadLease, Takeover]]:
        keys = thread_keys(thread_id)
        reply = yield Script(
            LgScript.TAKEOVER,
            (keys.meta, keys.takeovers),
            (self.owner, self.lease_ttl_ms, thread_id, reason, TAKEOVER_LOG_SIZE),
        )
        return decode_takeover(reply, thread_id, self.owner, reason)

    def _claim_op(self, thread_id: str, reason: str | None) -> Op[_Claim]:
        if reason is not None:
            lease, record = yield from self._takeover(thread_id, reason)
            return _Claim(lease, record)
        return _Claim((yield from self._claim(thread_id, None)), None)

    def _claim_args(
        self, thread_id: str, takeover: bool, reason: str | None, heartbeat: bool
    ) -> tuple[str, str | None]:
        tid = str(thread_id)
        thread_keys(tid)  # ContractError for an empty id, before anything is sent
        if heartbeat and self._runner is None:
            raise ConfigurationError(
                "the heartbeat renews from a background thread and needs a sync Redis client",
                field="heartbeat",
            )
        if not takeover:
            if reason is not None:
                raise ContractError("a reason is recorded for a takeover only", field="reason")
            return tid, None
        if (
            not isinstance(reason, str)
            or not reason.strip()
            or len(reason) > MAX_REASON_CHARS
            or not reason.isprintable()
        ):
            raise ContractError(
                f"a takeover needs a reason: one printable line of 1..{MAX_REASON_CHARS} "
                "characters",
                field="reason",
            )
        return tid, reason

    def _writer(self, claim: _Claim, heartbeat: bool) -> ThreadWriter:
        writer = ThreadWriter(self, claim)
        record = claim.takeover
        if record is not None:
            log.warning(
                "thread lease taken over by the operator",
                extra={
                    "thread_id": record.thread_id,
                    "owner": record.owner,
                    "lease_version": record.lease_version,
                    "previous_owner": record.previous_owner,
                    "previous_lease_version": record.previous_lease_version,
                    "previous_live": record.previous_live,
                    "takeover_reason": record.reason,
                },
            )
        if heartbeat:
            lease = claim.lease

            def unknown(error_type: str) -> LeaseLostError:
                return LeaseLostError(
                    "the lease could not be renewed (outcome unknown); treated as lost",
                    thread_id=lease.thread_id,
                    owner=lease.owner,
                    lease_version=lease.lease_version,
                    reason="renewal_unknown",
                    error=error_type,
                )

            claim.heartbeat = LeaseHeartbeat(
                writer.renew,
                interval_s=self.lease_ttl_ms / 3000,
                on_lost=claim.mark_lost,
                lost_error=unknown,
                name=f"ratchet-lg-heartbeat-{thread_keys(lease.thread_id).tag[:48]}",
            ).start()
        return writer

    def claim_write_ownership(
        self,
        thread_id: str,
        *,
        takeover: bool = False,
        reason: str | None = None,
        heartbeat: bool = False,
    ) -> ThreadWriter:
        """Claim write ownership of a thread: a lease acquire that returns a
        :class:`~ratchet.langgraph.writer.ThreadWriter` bound to the new lease version.

        Free, expired (by Redis time) or already this saver's owner id: granted, and every
        earlier holder, an earlier writer of this owner id too, is superseded. Another
        owner's live lease: LeaseHeldElsewhereError, unless ``takeover=True`` with a
        ``reason`` (the operator's path: it supersedes a live owner and is recorded in the
        thread's takeover log, see :meth:`takeovers`). ``heartbeat=True`` renews the lease
        every TTL/3 from a background thread until the writer is released (needs a sync
        client).

        Raises LeaseHeldElsewhereError, ContractError (a bad thread id or reason),
        ConfigurationError (a heartbeat without a sync client), StoreUnavailableError.
        """
        tid, why = self._claim_args(thread_id, takeover, reason, heartbeat)
        return self._writer(self._drive(self._claim_op(tid, why)), heartbeat)

    async def aclaim_write_ownership(
        self,
        thread_id: str,
        *,
        takeover: bool = False,
        reason: str | None = None,
        heartbeat: bool = False,
    ) -> ThreadWriter:
        """Async :meth:`claim_write_ownership` (the heartbeat still renews from a thread)."""
        tid, why = self._claim_args(thread_id, takeover, reason, heartbeat)
        claim: _Claim = await self._arun(lambda: self._claim_op(tid, why))
        return self._writer(claim, heartbeat)

    def _takeovers(self, thread_id: str) -> Op[builtins.list[Takeover]]:
        reply = yield Command(("LRANGE", thread_keys(thread_id).takeovers, "0", "-1"))
        return decode_takeover_log(reply, thread_id)

    def takeovers(self, thread_id: str) -> builtins.list[Takeover]:
        """The operator takeovers of the thread's lease, newest first (the last
        :data:`TAKEOVER_LOG_SIZE`; kept through deletes). Raises StoreProtocolError."""
        return self._drive(self._takeovers(str(thread_id)))

    async def atakeovers(self, thread_id: str) -> builtins.list[Takeover]:
        """Async :meth:`takeovers`."""
        result: builtins.list[Takeover] = await self._arun(lambda: self._takeovers(str(thread_id)))
        return result
