"""The saver's protocol, without I/O: each operation is a generator that yields the Redis
calls it needs (:class:`Script`, :class:`Command`) and the tuples it produces
(:class:`Emit`), and receives each call's raw reply. :mod:`ratchet.langgraph.saver`
drives the same generators with a sync and with an asyncio client, so the sync and async
methods cannot drift apart.

Freshness, in the order it is checked on every read:

1. the signed head record verifies (key ring, binding to the thread);
2. its generation equals the high-water mark Redis returned in the same step (a head
   rolled back or replayed on its own is refused: ``stale_generation``);
3. that high-water mark is not below the highest one this process has seen for the thread
   (a whole thread rolled back under a running process is refused: ``rolled_back``);
4. the checkpoint Redis resolved as a namespace's head is the one the signed head names
   (``head_mismatch``), and every record is signed for exactly its place (``binding``).

Listing across threads (a config without a thread id) finds the threads with one
:class:`Scan` of the saver's key layout (``ratchet:lg:{*}:meta``) rather than an index the
saver would keep: every thread has a meta hash from its first claim or write on (kept
through deletes), so the scan is complete by construction, costs the hot path nothing (no
extra cross-slot write per thread, no cache of what was indexed), and also finds threads
written before it existed. Its price is a pass over the keyspace per listing, which suits
an operator's or a dashboard's listing, not a per-step call.
"""

from __future__ import annotations

import builtins
import threading
from collections import OrderedDict
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    get_checkpoint_id,
    get_serializable_checkpoint_metadata,
)

from ratchet.errors import (
    CheckpointError,
    ContractError,
    GenerationMismatchError,
    StoreProtocolError,
)
from ratchet.langgraph.codec import RecordCodec, version_key
from ratchet.langgraph.keyspace import (
    META_PATTERN,
    ThreadKeys,
    blob_field,
    checkpoint_digest,
    meta_tag,
    namespace_digest,
    run_index_key,
    thread_keys,
    write_digest,
)
from ratchet.langgraph.replies import (
    LEASE_KEY,
    Entry,
    GenerationMoved,
    decode_list,
    decode_put,
    decode_put_writes,
    decode_read,
)
from ratchet.langgraph.scripts import LgScript
from ratchet.leasing.keyspace import check_id
from ratchet.leasing.scripts import ScriptName

__all__ = ["Command", "Emit", "Loaded", "Protocol", "Scan", "Script", "View"]

MAX_ATTEMPTS = 16
PAGE = 32
SCAN_COUNT = 1000
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Script:
    name: LgScript | ScriptName  # ScriptName: the lease scripts shared with runs
    keys: tuple[str, ...]
    args: tuple[str | bytes | int, ...]


@dataclass(frozen=True, slots=True)
class Command:
    args: tuple[str | bytes, ...]


@dataclass(frozen=True, slots=True)
class Scan:
    """Every key matching the glob ``match``: SCAN with MATCH and COUNT, on every primary
    of a cluster. The reply is the list of keys (bytes or str), duplicates possible."""

    match: str
    count: int


@dataclass(frozen=True, slots=True)
class Emit:
    item: CheckpointTuple


Step = Script | Command | Scan | Emit
Op = Generator[Step, Any, _T]


@dataclass(frozen=True, slots=True)
class View:
    """A verified head record: the generation and each namespace's head checkpoint id."""

    generation: int
    heads: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class Slot:
    task_id: str
    task_path: str
    idx: int
    channel: str
    value: Any


@dataclass(frozen=True, slots=True)
class Loaded:
    """A verified checkpoint with what LangGraph needs and what copy_thread needs."""

    ns: str
    generation: int
    parent_id: str | None
    checkpoint: Checkpoint
    metadata: CheckpointMetadata
    slots: list[Slot]

    def as_tuple(self, thread_id: str) -> CheckpointTuple:
        conf = {
            "thread_id": thread_id,
            "checkpoint_ns": self.ns,
            "checkpoint_id": self.checkpoint["id"],
        }
        parent = None
        if self.parent_id is not None:
            parent = {
                "configurable": {
                    "thread_id": thread_id,
                    "checkpoint_ns": self.ns,
                    "checkpoint_id": self.parent_id,
                }
            }
        writes = [(s.task_id, s.channel, s.value) for s in self.slots]
        return CheckpointTuple(
            {"configurable": conf},
            self.checkpoint,
            self.metadata,
            parent,  # type: ignore[arg-type]
            writes,
        )


def read_lease(conf: Mapping[str, Any]) -> tuple[str, int] | None:
    """The (owner, lease version) in ``conf["ratchet_lease"]``, or None when absent.

    Raises ContractError for anything but ``{"owner": <id>, "version": <int >= 1>}``.
    """
    raw = conf.get(LEASE_KEY)
    if raw is None:
        return None
    if not isinstance(raw, Mapping) or set(raw) != {"owner", "version"}:
        raise ContractError(
            f"configurable[{LEASE_KEY!r}] must be {{'owner': str, 'version': int}}", field=LEASE_KEY
        )
    owner, version = raw["owner"], raw["version"]
    check_id(owner, "owner")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ContractError("the lease version must be an integer >= 1", field=LEASE_KEY)
    return owner, version


def thread_of(config: RunnableConfig | None) -> tuple[str, str | None, Mapping[str, Any]]:
    """(thread id, namespace or None, configurable) of a config. Raises ContractError."""
    conf = (config or {}).get("configurable") or {}
    thread_id = conf.get("thread_id")
    if thread_id is None or thread_id == "":
        raise ContractError("config['configurable']['thread_id'] is required", field="thread_id")
    ns = conf.get("checkpoint_ns")
    if ns is not None and not isinstance(ns, str):
        raise ContractError("checkpoint_ns must be a string", field="checkpoint_ns")
    return str(thread_id), ns, conf


class Protocol:
    """Builds and checks every call of the saver. Thread-safe; holds no connection."""

    def __init__(
        self, codec: RecordCodec, *, owner: str, lease_ttl_ms: int, max_threads: int = 10_000
    ) -> None:
        self.codec = codec
        self.owner = owner
        self.lease_ttl_ms = lease_ttl_ms
        self._max_threads = max_threads
        self._views: OrderedDict[str, View] = OrderedDict()
        self._runs: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._lock = threading.Lock()

    # -- the witness: the newest verified head per thread ---------------------------------

    def cached(self, thread_id: str) -> View | None:
        with self._lock:
            return self._views.get(thread_id)

    def remember(self, thread_id: str, view: View) -> None:
        with self._lock:
            old = self._views.get(thread_id)
            if old is None or view.generation >= old.generation:
                self._views[thread_id] = view
            self._views.move_to_end(thread_id)
            while len(self._views) > self._max_threads:
                self._views.popitem(last=False)

    def verify_head(self, thread_id: str, generation: int, head: bytes) -> View:
        """Check a head record against the high-water mark read with it (see module doc).

        Raises CheckpointError (``stale_generation``, ``rolled_back``, ``missing`` or a
        record reason).
        """
        seen = self.cached(thread_id)
        if seen is not None and generation < seen.generation:
            raise CheckpointError(
                "the thread's generation went backwards in Redis: rolled back or replayed",
                reason="rolled_back",
                thread_id=thread_id,
                generation=generation,
                seen_generation=seen.generation,
            )
        if generation == 0 and not head:
            view = View(0, {})
        else:
            binding, value = self.codec.open(head, {"kind": "head", "thread_id": thread_id})
            if binding["generation"] != generation:
                raise CheckpointError(
                    "the head record is not at the high-water mark",
                    reason="stale_generation",
                    thread_id=thread_id,
                    generation=binding["generation"],
                    high_water=generation,
                )
            heads = value.get("heads") if isinstance(value, dict) else None
            if not isinstance(heads, dict):
                raise CheckpointError(
                    "the head record is malformed", reason="malformed", thread_id=thread_id
                )
            view = View(generation, dict(heads))
        self.remember(thread_id, view)
        return view

    # -- put ------------------------------------------------------------------------------

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: Mapping[str, Any],
    ) -> Op[RunnableConfig]:
        """Store a checkpoint as its namespace's new head (see lua/put.lua)."""
        thread_id, ns_or_none, conf = thread_of(config)
        ns = ns_or_none or ""
        lease = read_lease(conf)
        owner, held = lease if lease is not None else (self.owner, 0)
        keys = thread_keys(thread_id)
        body: dict[str, Any] = {k: v for k, v in checkpoint.items() if k != "channel_values"}
        values = checkpoint["channel_values"]
        versions = checkpoint["channel_versions"]
        values_at = {ch: version_key(versions[ch]) for ch in values if ch in versions}
        blob_args: list[str | bytes] = []
        for ch, ver in new_versions.items():
            if ch not in values:
                continue
            vkey = version_key(ver)
            blob_args.append(blob_field(ns, ch, vkey))
            blob_args.append(
                self.codec.seal(
                    {
                        "kind": "blob",
                        "thread_id": thread_id,
                        "ns": ns,
                        "channel": ch,
                        "version": vkey,
                    },
                    values[ch],
                )
            )
        refs = " ".join(sorted(blob_field(ns, ch, vk) for ch, vk in values_at.items()))
        meta = get_serializable_checkpoint_metadata(config, metadata)
        content = {"checkpoint": body, "metadata": meta, "values_at": values_at}
        parent_id = conf.get("checkpoint_id") or None
        checkpoint_id = checkpoint["id"]
        run_id = meta.get("run_id")
        if isinstance(run_id, str) and run_id:
            yield from self._index_run(run_id, thread_id)
        view = self.cached(thread_id) or View(0, {})
        for _ in range(MAX_ATTEMPTS):
            generation = view.generation + 1
            heads = {**view.heads, ns: checkpoint_id}
            record = self.codec.seal(
                {
                    "kind": "checkpoint",
                    "thread_id": thread_id,
                    "ns": ns,
                    "checkpoint_id": checkpoint_id,
                    "parent_id": parent_id,
                    "generation": generation,
                },
                content,
            )
            head = self.codec.seal(
                {"kind": "head", "thread_id": thread_id, "generation": generation}, {"heads": heads}
            )
            reply = yield Script(
                LgScript.PUT,
                _put_keys(keys),
                (
                    thread_id,
                    owner,
                    held,
                    self.lease_ttl_ms,
                    view.generation,
                    head,
                    namespace_digest(ns),
                    checkpoint_digest(ns, checkpoint_id),
                    record,
                    refs,
                    *blob_args,
                ),
            )
            result = decode_put(reply, thread_id, owner, held)
            if isinstance(result, GenerationMoved):
                view = self.verify_head(thread_id, result.generation, result.head)
                continue
            self.remember(thread_id, View(result.generation, heads))
            return {
                "configurable": {
                    "thread_id": thread_id,
                    "checkpoint_ns": ns,
                    "checkpoint_id": checkpoint_id,
                    LEASE_KEY: {"owner": owner, "version": result.lease_version},
                }
            }
        raise GenerationMismatchError(
            "the thread kept moving; the put was not stored",
            thread_id=thread_id,
            attempts=MAX_ATTEMPTS,
        )

    def _index_run(self, run_id: str, thread_id: str) -> Op[None]:
        # Recorded before the checkpoint is stored, so delete_for_runs never misses a thread
        # (an entry whose put then failed only costs delete_for_runs one extra look).
        with self._lock:
            if (run_id, thread_id) in self._runs:
                return
        yield Command(("SADD", run_index_key(run_id), thread_id))
        with self._lock:
            self._runs[(run_id, thread_id)] = None
            while len(self._runs) > self._max_threads:
                self._runs.popitem(last=False)

    def forget_runs(self, run_ids: Sequence[str]) -> None:
        """Drop remembered run-index entries (their index keys were deleted)."""
        doomed = set(run_ids)
        with self._lock:
            for key in [k for k in self._runs if k[0] in doomed]:
                del self._runs[key]

    # -- put_writes -----------------------------------------------------------------------

    def put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> Op[None]:
        """Store pending writes of a checkpoint (see lua/put_writes.lua)."""
        slots = [
            Slot(task_id, task_path, WRITES_IDX_MAP.get(channel, idx), channel, value)
            for idx, (channel, value) in enumerate(writes)
        ]
        return self.put_slots(config, slots)

    def put_slots(self, config: RunnableConfig, slots: Sequence[Slot]) -> Op[None]:
        thread_id, ns_or_none, conf = thread_of(config)
        ns = ns_or_none or ""
        checkpoint_id = conf.get("checkpoint_id")
        if not isinstance(checkpoint_id, str) or not checkpoint_id:
            raise ContractError(
                "put_writes needs configurable['checkpoint_id']", field="checkpoint_id"
            )
        lease = read_lease(conf)
        owner, held = lease if lease is not None else (self.owner, 0)
        args: list[str | bytes | int] = [
            thread_id,
            owner,
            held,
            self.lease_ttl_ms,
            checkpoint_digest(ns, checkpoint_id),
        ]
        for s in slots:
            sealed = self.codec.seal(
                {
                    "kind": "write",
                    "thread_id": thread_id,
                    "ns": ns,
                    "checkpoint_id": checkpoint_id,
                    "task_id": s.task_id,
                    "task_path": s.task_path,
                    "idx": s.idx,
                    "channel": s.channel,
                },
                s.value,
            )
            args += [write_digest(s.task_id, s.idx), "replace" if s.idx < 0 else "keep", sealed]
        keys = thread_keys(thread_id)
        reply = yield Script(
            LgScript.PUT_WRITES, (keys.meta, keys.writes, keys.windex), tuple(args)
        )
        decode_put_writes(reply, thread_id, owner, held)

    # -- reads ----------------------------------------------------------------------------

    def read(self, thread_id: str, ns: str, digests: Sequence[str]) -> Op[tuple[View, list[Entry]]]:
        keys = thread_keys(thread_id)
        reply = yield Script(
            LgScript.READ,
            (keys.meta, keys.heads, keys.ckpts, keys.refs, keys.blobs, keys.writes, keys.windex),
            (namespace_digest(ns), *digests),
        )
        result = decode_read(reply)
        view = self.verify_head(thread_id, result.generation, result.head)
        return view, result.entries

    def get_tuple(self, config: RunnableConfig) -> Op[CheckpointTuple | None]:
        """The checkpoint named by the config, or its namespace's head."""
        thread_id, ns_or_none, _ = thread_of(config)
        ns = ns_or_none or ""
        checkpoint_id = get_checkpoint_id(config)
        digests = [checkpoint_digest(ns, checkpoint_id)] if checkpoint_id else []
        view, entries = yield from self.read(thread_id, ns, digests)
        if checkpoint_id is None:
            head_id = view.heads.get(ns)
            resolved = entries[0].digest if entries else None
            expected = checkpoint_digest(ns, head_id) if head_id is not None else None
            if resolved != expected:
                raise CheckpointError(
                    "Redis resolved another head than the signed head record names",
                    reason="head_mismatch",
                    thread_id=thread_id,
                )
        if not entries or not entries[0].record:
            return None
        return self.load(thread_id, ns, entries[0], view, checkpoint_id).as_tuple(thread_id)

    def load(
        self,
        thread_id: str,
        ns: str | None,
        entry: Entry,
        view: View,
        checkpoint_id: str | None = None,
    ) -> Loaded:
        """Verify one read entry (record, blobs, writes); ``ns`` None takes the record's.

        Raises CheckpointError.
        """
        expect: dict[str, Any] = {"kind": "checkpoint", "thread_id": thread_id}
        if ns is not None:
            expect["ns"] = ns
        if checkpoint_id is not None:
            expect["checkpoint_id"] = checkpoint_id
        binding, content = self.codec.open(entry.record, expect)
        cid, ns = binding["checkpoint_id"], binding["ns"]
        if not isinstance(cid, str) or not isinstance(ns, str):
            raise CheckpointError(
                "a checkpoint record is malformed", reason="malformed", thread_id=thread_id
            )
        if checkpoint_digest(ns, cid) != entry.digest:
            raise CheckpointError(
                "a checkpoint record sits in another checkpoint's place",
                reason="binding",
                thread_id=thread_id,
            )
        if binding["generation"] > view.generation:
            raise CheckpointError(
                "a checkpoint is newer than the thread's high-water mark",
                reason="rolled_back",
                thread_id=thread_id,
            )
        body, metadata, values_at = (
            content["checkpoint"],
            content["metadata"],
            content["values_at"],
        )
        wanted = {blob_field(ns, ch, vk): (ch, vk) for ch, vk in values_at.items()}
        got = dict(entry.blobs)
        if set(got) != set(wanted):
            raise CheckpointError(
                "the checkpoint's channel values are not the ones it was signed with",
                reason="missing_blob",
                thread_id=thread_id,
            )
        values: dict[str, Any] = {}
        for field, (ch, vk) in wanted.items():
            _, values[ch] = self.codec.open(
                got[field],
                {"kind": "blob", "thread_id": thread_id, "ns": ns, "channel": ch, "version": vk},
            )
        slots: list[Slot] = []
        for field, blob in entry.writes:
            wb, value = self.codec.open(
                blob, {"kind": "write", "thread_id": thread_id, "ns": ns, "checkpoint_id": cid}
            )
            if field != f"{entry.digest}|{write_digest(wb['task_id'], wb['idx'])}":
                raise CheckpointError(
                    "a pending write sits in another write's place",
                    reason="binding",
                    thread_id=thread_id,
                )
            slots.append(Slot(wb["task_id"], wb["task_path"], wb["idx"], wb["channel"], value))
        slots.sort(key=lambda s: (s.task_path, s.task_id, s.idx))
        checkpoint: Checkpoint = {**body, "channel_values": values}  # type: ignore[typeddict-item]
        return Loaded(ns, binding["generation"], binding["parent_id"], checkpoint, metadata, slots)

    def members(
        self, thread_id: str, ns: str | None, before_id: str | None, before_ns: str, limit: int
    ) -> Op[tuple[View, list[tuple[str, int, str]] | None]]:
        """The verified head and index entries newest first (None: ``before`` is unknown)."""
        keys = thread_keys(thread_id)
        before = checkpoint_digest(before_ns, before_id) if before_id else ""
        reply = yield Script(
            LgScript.LIST,
            (keys.meta, keys.index, keys.gens),
            (namespace_digest(ns) if ns is not None else "", before, limit),
        )
        result = decode_list(reply)
        view = self.verify_head(thread_id, result.generation, result.head)
        if before_id and result.before_generation == 0:
            return view, None
        members = result.members
        if ns is None:
            members = sorted(members, key=lambda m: m[1], reverse=True)
            if before_id:
                members = [m for m in members if m[1] < result.before_generation]
        return view, members

    def load_members(
        self, thread_id: str, members: Sequence[tuple[str, int, str]]
    ) -> Op[list[Loaded]]:
        """Read and verify the checkpoints of index entries, keeping their order."""
        loaded: list[Loaded] = []
        for i in range(0, len(members), PAGE):
            page = members[i : i + PAGE]
            view, entries = yield from self.read(thread_id, "", [m[2] for m in page])
            for member, entry in zip(page, entries, strict=True):
                if not entry.record:
                    continue  # dropped between the two calls
                item = self.load(thread_id, None, entry, view)
                if namespace_digest(item.ns) != member[0]:
                    raise CheckpointError(
                        "a checkpoint is indexed under another namespace",
                        reason="binding",
                        thread_id=thread_id,
                    )
                loaded.append(item)
        return loaded

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: Mapping[str, Any] | None,
        before: RunnableConfig | None,
        limit: int | None,
    ) -> Op[None]:
        """Emit matching checkpoints newest first (by generation); with no thread id in
        ``config`` (or no config), those of every thread (see :meth:`list_threads`)."""
        want = limit if limit is not None and limit > 0 else None
        given = (config or {}).get("configurable") or {}
        if given.get("thread_id") is None or given.get("thread_id") == "":
            yield from self.list_threads(given, filter=filter, before=before, want=want)
            return
        thread_id, ns, conf = thread_of(config)
        checkpoint_id = conf.get("checkpoint_id")
        if checkpoint_id:
            found = yield from self.get_tuple(config)  # type: ignore[arg-type]
            if found is not None and _matches(found.metadata, filter):
                yield Emit(found)
            return
        before_id = get_checkpoint_id(before) if before else None
        before_ns = ((before or {}).get("configurable") or {}).get("checkpoint_ns", ns or "")
        yield from self._emit_thread(thread_id, ns, filter, before_id, before_ns or "", want)

    def _emit_thread(
        self,
        thread_id: str,
        ns: str | None,
        filter: Mapping[str, Any] | None,
        before_id: str | None,
        before_ns: str,
        want: int | None,
    ) -> Op[int]:
        """Emit one thread's matching checkpoints newest first, at most ``want``; return
        how many were emitted."""
        ask = want if (want is not None and not filter and ns is not None) else 0
        _, members = yield from self.members(thread_id, ns, before_id, before_ns, ask)
        if not members:
            return 0
        emitted = 0
        for i in range(0, len(members), PAGE):
            for item in (yield from self.load_members(thread_id, members[i : i + PAGE])):
                if not _matches(item.metadata, filter):
                    continue
                yield Emit(item.as_tuple(thread_id))
                emitted += 1
                if want is not None and emitted >= want:
                    return emitted
        return emitted

    def thread_ids(self) -> Op[builtins.list[str]]:
        """Every thread the store has a meta hash for, sorted by thread id (one SCAN, see
        the module doc). A ``t=`` tag is the thread id itself; an ``h=`` tag's id is read
        from its meta hash and must map back to exactly that key. Raises CheckpointError
        (``malformed``, ``binding``) for a meta hash whose thread id does not."""
        keys = yield Scan(META_PATTERN, SCAN_COUNT)
        if not isinstance(keys, list):
            raise StoreProtocolError("SCAN did not reply with a list of keys", script="scan")
        found: set[str] = set()
        for raw in keys:
            key = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else str(raw)
            tag = meta_tag(key)
            if tag is None:
                continue  # matched the glob, but not a key this saver makes
            if tag.startswith("t="):
                found.add(tag[2:])
                continue
            reply = yield Command(("HGET", key, "thread_id"))
            if isinstance(reply, bytes):
                reply = reply.decode("utf-8", errors="replace")
            if not isinstance(reply, str) or not reply:
                raise CheckpointError(
                    "a thread's meta hash names no thread id", reason="malformed", key=key
                )
            if thread_keys(reply).meta != key:
                raise CheckpointError(
                    "a thread's meta hash names another thread", reason="binding", key=key
                )
            found.add(reply)
        return sorted(found)

    def list_threads(
        self,
        conf: Mapping[str, Any],
        *,
        filter: Mapping[str, Any] | None,
        before: RunnableConfig | None,
        want: int | None,
    ) -> Op[None]:
        """Emit the matching checkpoints of every thread: threads in thread id order, each
        thread's newest first (by its generation; threads share no store order, and
        checkpoint ids come from worker clocks, so they are never compared across threads).
        ``checkpoint_ns`` in ``conf`` limits each thread to that namespace; ``want`` counts
        across threads. ``before`` is a position in that order: it names a thread and a
        checkpoint, and the listing goes on after it (that thread's older checkpoints, then
        the threads after it), so an emitted tuple's config pages on.

        Raises ContractError for a ``checkpoint_id`` without a thread id, or a ``before``
        that does not name both a thread id and a checkpoint id.
        """
        if conf.get("checkpoint_id"):
            raise ContractError(
                "a checkpoint_id needs its thread_id (listing across threads)", field="thread_id"
            )
        ns = conf.get("checkpoint_ns")
        if ns is not None and not isinstance(ns, str):
            raise ContractError("checkpoint_ns must be a string", field="checkpoint_ns")
        after: str | None = None
        before_id: str | None = None
        before_ns = ""
        if before is not None:
            bconf = before.get("configurable") or {}
            before_id = get_checkpoint_id(before)
            if bconf.get("thread_id") in (None, "") or not before_id:
                raise ContractError(
                    "listing across threads, before must name a thread_id and a checkpoint_id",
                    field="before",
                )
            after = str(bconf["thread_id"])
            before_ns = bconf.get("checkpoint_ns", ns or "") or ""
        threads = yield from self.thread_ids()
        emitted = 0
        for thread_id in threads:
            if after is not None and thread_id < after:
                continue
            cursor = before_id if thread_id == after else None
            left = None if want is None else want - emitted
            emitted += yield from self._emit_thread(thread_id, ns, filter, cursor, before_ns, left)
            if want is not None and emitted >= want:
                return


def _matches(metadata: Mapping[str, Any], filter: Mapping[str, Any] | None) -> bool:
    return not filter or all(metadata.get(k) == v for k, v in filter.items())


def _put_keys(keys: ThreadKeys) -> tuple[str, ...]:
    return (keys.meta, keys.heads, keys.ckpts, keys.refs, keys.gens, keys.index, keys.blobs)
