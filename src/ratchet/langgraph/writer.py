"""Write ownership of a thread: LangGraph's proposed ``write_ownership`` convention
(``aclaim_write_ownership`` / ``acheck_write_ownership``, langgraph issue #8796) on
:class:`~ratchet.langgraph.saver.RatchetSaver`'s thread leases.

A claim is a thread lease acquire (the runs' ``acquire_lease`` script): free, expired, or
already this saver's owner id gives a new lease version that fences out every earlier
holder, including an earlier claim of the same owner id. Another owner's live lease is
refused (LeaseHeldElsewhereError) unless the claim is the operator's explicit takeover
(``takeover=True`` with a ``reason``, ``lua/takeover.lua``), which is recorded in the
thread's takeover log.

The claim returns a :class:`ThreadWriter`: a checkpoint saver bound to that one lease (owner
and lease version). Every write it makes carries that lease, whatever lease the config it
is given carries, and is fenced by the Lua script that writes (``put``, ``put_writes``,
``rewrite``): a superseded writer's put, put_writes, delete_thread or prune raises
:class:`~ratchet.errors.LeaseLostError`, whose class sets ``is_stale_write_owner_error =
True``, and nothing of it is stored. Once a writer has seen that it lost its lease (a
refused write, a failed renewal, the barrier), it stays lost: later writes raise before
anything is sent. Reads go to the saver and need no ownership.

:meth:`ThreadWriter.check_write_ownership` (and ``acheck_write_ownership``) is the
barrier: it reads the lease as Redis sees it now and raises the same error when this
writer is no longer the current, unexpired owner, without writing.

With ``heartbeat=True`` the writer renews its lease every TTL/3 from a background thread
(:class:`~ratchet.langgraph.heartbeat.LeaseHeartbeat`) until it is released, so a node may
run longer than the TTL; a renewal that finds the lease lost (or cannot tell) stops the
heartbeat and makes the next write raise.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
)

from ratchet.errors import ContractError, LeaseLostError, StoreError
from ratchet.langgraph import admin
from ratchet.langgraph.heartbeat import LeaseHeartbeat
from ratchet.langgraph.replies import LEASE_KEY, LeaseInfo, Takeover, ThreadLease

if TYPE_CHECKING:
    from collections.abc import Collection

    from ratchet.langgraph.saver import RatchetSaver

__all__ = ["ThreadWriter"]


class _Claim:
    """The state one claim's writers share (a writer and its ``with_allowlist`` clones)."""

    def __init__(self, lease: ThreadLease, takeover: Takeover | None) -> None:
        self.lock = threading.Lock()
        self.lease = lease
        self.takeover = takeover
        self.lost: LeaseLostError | None = None
        self.ended: str | None = None  # "released" or "deleted" by this claim's writer
        self.heartbeat: LeaseHeartbeat | None = None

    def mark_lost(self, exc: LeaseLostError) -> None:
        with self.lock:
            if self.lost is None:
                self.lost = exc


def _lost_from(info: LeaseInfo, lease: ThreadLease) -> LeaseLostError | None:
    """The refusal a write under ``lease`` would get from the lease Redis has now, or None
    when ``lease`` is the current, unexpired one (the same judgement as put.lua)."""
    if info.owner == lease.owner and info.lease_version == lease.lease_version:
        if info.now_ms < info.expires_at_ms:
            return None
        reason = "lease_expired"
    elif info.lease_version < lease.lease_version:
        reason = "store_rolled_back"
    else:
        reason = "lease_lost"
    return LeaseLostError(
        f"the lease is no longer held ({reason})",
        thread_id=lease.thread_id,
        owner=lease.owner,
        lease_version=lease.lease_version,
        reason=reason,
        current_owner=info.owner,
        current_lease_version=info.lease_version,
        expires_at_ms=info.expires_at_ms,
        now_ms=info.now_ms,
    )


class ThreadWriter(BaseCheckpointSaver[str]):
    """The write owner of one thread: a checkpoint saver bound to one claim of its lease.

    Made by :meth:`RatchetSaver.claim_write_ownership` (or its async form), never directly.
    Use it as a graph's checkpointer (``builder.compile(checkpointer=writer)``) or call its
    methods; it is a context manager (sync and async) that releases the lease on exit.

    Writes (put, put_writes, delete_thread, prune, sync and async) raise LeaseLostError
    (``is_stale_write_owner_error``) once this claim is superseded, with nothing stored,
    and ContractError for a config naming another thread. Reads go to the saver.
    """

    def __init__(self, saver: RatchetSaver, claim: _Claim) -> None:
        super().__init__(serde=saver.serde)
        self._saver = saver
        self._claim = claim

    def __repr__(self) -> str:
        lease = self.lease
        return (
            f"ThreadWriter(thread_id={lease.thread_id!r}, owner={lease.owner!r}, "
            f"lease_version={lease.lease_version})"
        )

    # -- what the claim holds ---------------------------------------------------------------

    @property
    def thread_id(self) -> str:
        """The thread this writer owns."""
        return self._claim.lease.thread_id

    @property
    def lease(self) -> ThreadLease:
        """The lease of this claim, as last granted or renewed (Redis time)."""
        with self._claim.lock:
            return self._claim.lease

    @property
    def takeover(self) -> Takeover | None:
        """What the operator's takeover that made this claim replaced, or None."""
        return self._claim.takeover

    @property
    def heartbeat(self) -> LeaseHeartbeat | None:
        """The background renewal of this claim (``heartbeat=True``), or None."""
        return self._claim.heartbeat

    @property
    def lost(self) -> LeaseLostError | None:
        """Why this writer knows it is no longer the owner, or None while it may be."""
        with self._claim.lock:
            return self._claim.lost

    def config(self, **configurable: Any) -> dict[str, Any]:
        """A LangGraph config for this thread carrying this writer's lease."""
        return self.lease.config(**configurable)

    # -- fencing --------------------------------------------------------------------------

    def _raise_if_lost(self) -> None:
        with self._claim.lock:
            lost, ended = self._claim.lost, self._claim.ended
            lease = self._claim.lease
        if lost is not None:
            # A new instance each time, with the same fields: raising one exception object
            # twice would chain tracebacks across unrelated calls.
            raise LeaseLostError(lost.message, **lost.context)
        if ended is not None:
            raise LeaseLostError(
                f"the lease is no longer held ({ended} by this writer)",
                thread_id=lease.thread_id,
                owner=lease.owner,
                lease_version=lease.lease_version,
                reason=ended,
            )

    def _own(self, thread_id: object) -> str:
        if thread_id is None or thread_id == "":
            return self.thread_id
        if str(thread_id) != self.thread_id:
            raise ContractError(
                "this writer owns another thread", field="thread_id", thread_id=str(thread_id)
            )
        return self.thread_id

    def _fence(self, config: RunnableConfig) -> RunnableConfig:
        """``config`` for this thread with this writer's lease in place of any other."""
        self._raise_if_lost()
        conf = dict((config or {}).get("configurable") or {})
        conf["thread_id"] = self._own(conf.get("thread_id"))
        conf[LEASE_KEY] = self.lease.as_config()
        return {**(config or {}), "configurable": conf}

    def _lease_pair(self) -> tuple[str, int]:
        self._raise_if_lost()
        lease = self.lease
        return lease.owner, lease.lease_version

    def _refused(self, exc: LeaseLostError) -> None:
        self._claim.mark_lost(exc)

    def _after_delete(self) -> None:
        # delete_thread ends the thread's lease in the same step: nothing is left to renew.
        heartbeat = self._claim.heartbeat
        if heartbeat is not None:
            heartbeat.stop()
        with self._claim.lock:
            self._claim.ended = "deleted"

    # -- BaseCheckpointSaver: reads go to the saver -----------------------------------------

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """:meth:`RatchetSaver.get_tuple` (no ownership needed)."""
        return self._saver.get_tuple(config)

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        """:meth:`RatchetSaver.list` (no ownership needed)."""
        return self._saver.list(config, filter=filter, before=before, limit=limit)

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """:meth:`RatchetSaver.aget_tuple` (no ownership needed)."""
        return await self._saver.aget_tuple(config)

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        """:meth:`RatchetSaver.alist` (no ownership needed)."""
        async for item in self._saver.alist(config, filter=filter, before=before, limit=limit):
            yield item

    def get_next_version(self, current: str | None, channel: None) -> str:
        """The saver's version scheme."""
        return self._saver.get_next_version(current, channel)

    def with_allowlist(self, extra_allowlist: Collection[tuple[str, ...]]) -> ThreadWriter:
        """A writer of the same claim on the saver's ``with_allowlist`` clone."""
        saver = self._saver.with_allowlist(extra_allowlist)
        if saver is self._saver:
            return self
        return ThreadWriter(saver, self._claim)

    # -- BaseCheckpointSaver: fenced writes -------------------------------------------------

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        """:meth:`RatchetSaver.put` under this writer's lease. Raises LeaseLostError when
        superseded (nothing stored), ContractError for another thread, and the saver's
        errors."""
        fenced = self._fence(config)
        try:
            return self._saver.put(fenced, checkpoint, metadata, new_versions)
        except LeaseLostError as exc:
            self._refused(exc)
            raise

    def put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        """:meth:`RatchetSaver.put_writes` under this writer's lease; raises like :meth:`put`."""
        fenced = self._fence(config)
        try:
            self._saver.put_writes(fenced, writes, task_id, task_path)
        except LeaseLostError as exc:
            self._refused(exc)
            raise

    def delete_thread(self, thread_id: str) -> None:
        """Delete this writer's thread, fenced by its lease in the same step; the delete
        ends the lease, so this writer writes no more. Raises LeaseLostError when
        superseded (nothing deleted), ContractError for another thread."""
        tid = self._own(thread_id)
        lease = self._lease_pair()
        try:
            self._saver._drive(admin.delete_thread(self._saver._protocol, tid, lease))
        except LeaseLostError as exc:
            self._refused(exc)
            raise
        self._after_delete()

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """Prune this writer's thread (``thread_ids`` must name only it), fenced by its lease.
        A prune with nothing to drop writes nothing, so the barrier runs first: a superseded
        writer is told either way. Raises LeaseLostError, ContractError."""
        tids = sorted({self._own(t) for t in thread_ids})
        self.check_write_ownership()
        lease = self._lease_pair()
        try:
            self._saver._drive(admin.prune(self._saver._protocol, tids, strategy, lease))
        except LeaseLostError as exc:
            self._refused(exc)
            raise
        if strategy == "delete" and tids:
            self._after_delete()

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        """Async :meth:`put`."""
        fenced = self._fence(config)
        try:
            return await self._saver.aput(fenced, checkpoint, metadata, new_versions)
        except LeaseLostError as exc:
            self._refused(exc)
            raise

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        """Async :meth:`put_writes`."""
        fenced = self._fence(config)
        try:
            await self._saver.aput_writes(fenced, writes, task_id, task_path)
        except LeaseLostError as exc:
            self._refused(exc)
            raise

    async def adelete_thread(self, thread_id: str) -> None:
        """Async :meth:`delete_thread`."""
        tid = self._own(thread_id)
        lease = self._lease_pair()
        try:
            await self._saver._arun(lambda: admin.delete_thread(self._saver._protocol, tid, lease))
        except LeaseLostError as exc:
            self._refused(exc)
            raise
        self._after_delete()

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """Async :meth:`prune`."""
        tids = sorted({self._own(t) for t in thread_ids})
        await self.acheck_write_ownership()
        lease = self._lease_pair()
        try:
            await self._saver._arun(
                lambda: admin.prune(self._saver._protocol, tids, strategy, lease)
            )
        except LeaseLostError as exc:
            self._refused(exc)
            raise
        if strategy == "delete" and tids:
            self._after_delete()

    # -- the barrier ----------------------------------------------------------------------

    def check_write_ownership(self) -> None:
        """Return if this writer is the thread's current, unexpired owner as Redis sees it
        now (its clock); raise LeaseLostError (``is_stale_write_owner_error``) otherwise.
        Writes nothing. A passing check is no promise for later: writes stay fenced."""
        self._raise_if_lost()
        self._judge(self._saver.lease_info(self.thread_id))

    async def acheck_write_ownership(self) -> None:
        """Async :meth:`check_write_ownership`."""
        self._raise_if_lost()
        self._judge(await self._saver.alease_info(self.thread_id))

    def _judge(self, info: LeaseInfo) -> None:
        lost = _lost_from(info, self.lease)
        if lost is not None:
            self._refused(lost)
            raise lost

    # -- renew and release ----------------------------------------------------------------

    def _renewed(self, lease: ThreadLease) -> ThreadLease:
        with self._claim.lock:
            self._claim.lease = lease
        return lease

    def renew(self) -> ThreadLease:
        """Extend the lease by the saver's TTL (what the heartbeat calls). Raises
        LeaseLostError when superseded or expired."""
        self._raise_if_lost()
        try:
            return self._renewed(self._saver.renew(self.lease))
        except LeaseLostError as exc:
            self._refused(exc)
            raise

    async def arenew(self) -> ThreadLease:
        """Async :meth:`renew`."""
        self._raise_if_lost()
        try:
            return self._renewed(await self._saver.arenew(self.lease))
        except LeaseLostError as exc:
            self._refused(exc)
            raise

    def _stop_heartbeat(self) -> bool:
        """Stop the heartbeat; True when the claim still has a lease to release."""
        heartbeat = self._claim.heartbeat
        if heartbeat is not None:
            heartbeat.stop()
        with self._claim.lock:
            return self._claim.ended is None

    def release(self) -> None:
        """Stop the heartbeat and give the lease up (once; again is a no-op). Raises
        LeaseLostError when the lease was already lost."""
        if not self._stop_heartbeat():
            return
        self._raise_if_lost()
        try:
            self._saver.release(self.lease)
        except LeaseLostError as exc:
            self._refused(exc)
            raise
        with self._claim.lock:
            self._claim.ended = "released"

    async def arelease(self) -> None:
        """Async :meth:`release`."""
        if not self._stop_heartbeat():
            return
        self._raise_if_lost()
        try:
            await self._saver.arelease(self.lease)
        except LeaseLostError as exc:
            self._refused(exc)
            raise
        with self._claim.lock:
            self._claim.ended = "released"

    def __enter__(self) -> ThreadWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.release()  # a lease lost by the end of the block is reported here
            return
        with contextlib.suppress(StoreError):  # the block's own exception is the one to see
            self.release()

    async def __aenter__(self) -> ThreadWriter:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            await self.arelease()
            return
        with contextlib.suppress(StoreError):  # the block's own exception is the one to see
            await self.arelease()
