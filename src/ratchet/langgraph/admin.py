"""The saver's administrative operations, without I/O (driven like the protocol's).

None of them resets a thread: each is a compare-and-set on the thread's generation that
stores a new signed head record one generation up (see ``lua/rewrite.lua``), so a replayed
older head or checkpoint is refused as stale afterwards. ``delete_thread`` and
``prune(strategy="delete")`` also end the current lease, so a worker still running on the
thread cannot resurrect it with its next write; ``keep_latest`` and ``delete_for_runs``
leave the lease alone.

Given a ``lease`` (the (owner, lease version) of a claimed writer, see
:mod:`ratchet.langgraph.writer`), ``delete_thread`` and ``prune`` are fenced like a put:
the rewrite script checks that lease in the same step and a superseded writer gets
LeaseLostError with nothing changed.
"""

from __future__ import annotations

from collections.abc import Sequence

from ratchet.errors import ContractError, GenerationMismatchError, StoreProtocolError
from ratchet.langgraph.keyspace import (
    checkpoint_digest,
    namespace_digest,
    run_index_key,
    thread_keys,
)
from ratchet.langgraph.protocol import MAX_ATTEMPTS, Command, Loaded, Op, Protocol, Script, View
from ratchet.langgraph.replies import GenerationMoved, decode_rewrite
from ratchet.langgraph.scripts import LgScript

__all__ = ["copy_thread", "delete_for_runs", "delete_thread", "prune"]


def _rewrite(
    p: Protocol,
    thread_id: str,
    view: View,
    heads: dict[str, str],
    mode: str,
    fence: bool,
    drop: Sequence[str],
    updates: Sequence[str],
    lease: tuple[str, int] | None = None,
) -> Op[View | GenerationMoved | None]:
    k = thread_keys(thread_id)
    owner, held = lease if lease is not None else ("", 0)
    head = p.codec.seal(
        {"kind": "head", "thread_id": thread_id, "generation": view.generation + 1},
        {"heads": heads},
    )
    reply = yield Script(
        LgScript.REWRITE,
        (k.meta, k.heads, k.ckpts, k.refs, k.gens, k.index, k.blobs, k.writes, k.windex),
        (
            view.generation,
            head,
            mode,
            "1" if fence else "0",
            owner,
            held,
            len(drop),
            *drop,
            *updates,
        ),
    )
    result = decode_rewrite(reply, thread_id, lease)
    if result is None or isinstance(result, GenerationMoved):
        return result
    new = View(result.generation, heads)
    p.remember(thread_id, new)
    return new


def delete_thread(p: Protocol, thread_id: str, lease: tuple[str, int] | None = None) -> Op[None]:
    """Drop every checkpoint, value and write of a thread; keep its generation and lease
    version moving forward, and end its lease. Raises GenerationMismatchError when the
    thread kept changing, CheckpointError for a head that does not verify, LeaseLostError
    when ``lease`` is given and is not the thread's current one."""
    view = p.cached(thread_id) or View(0, {})
    for _ in range(MAX_ATTEMPTS):
        result = yield from _rewrite(p, thread_id, view, {}, "wipe", True, (), (), lease)
        if not isinstance(result, GenerationMoved):
            return
        view = p.verify_head(thread_id, result.generation, result.head)
    raise GenerationMismatchError("the thread kept moving; it was not deleted", thread_id=thread_id)


def prune(
    p: Protocol,
    thread_ids: Sequence[str],
    strategy: str,
    lease: tuple[str, int] | None = None,
) -> Op[None]:
    """``keep_latest``: keep each namespace's head (with its writes and values) and drop the
    rest; ``delete``: :func:`delete_thread`. Raises ContractError for another strategy,
    LeaseLostError when ``lease`` is given and a rewrite finds it is not current."""
    if strategy not in ("keep_latest", "delete"):
        raise ContractError(f"unknown prune strategy {strategy!r}", field="strategy")
    for thread_id in thread_ids:
        if strategy == "delete":
            yield from delete_thread(p, thread_id, lease)
            continue
        for _ in range(MAX_ATTEMPTS):
            view, members = yield from p.members(thread_id, None, None, "", 0)
            keep = {checkpoint_digest(ns, cid) for ns, cid in view.heads.items()}
            drop = [m[2] for m in members or () if m[2] not in keep]
            if not drop:
                break
            result = yield from _rewrite(
                p, thread_id, view, dict(view.heads), "drop", False, drop, (), lease
            )
            if not isinstance(result, GenerationMoved):
                break
        else:
            raise GenerationMismatchError(
                "the thread kept moving; it was not pruned", thread_id=thread_id
            )


def _drop_runs(p: Protocol, thread_id: str, runs: set[str]) -> Op[None]:
    for _ in range(MAX_ATTEMPTS):
        view, members = yield from p.members(thread_id, None, None, "", 0)
        loaded: list[Loaded] = yield from p.load_members(thread_id, members or [])
        doomed = {
            (item.ns, item.checkpoint["id"])
            for item in loaded
            if item.metadata.get("run_id") in runs
        }
        if not doomed:
            return
        remaining = [item for item in loaded if (item.ns, item.checkpoint["id"]) not in doomed]
        heads = dict(view.heads)
        updates: list[str] = []
        for ns, cid in view.heads.items():
            if (ns, cid) not in doomed:
                continue
            # The newest remaining checkpoint of the namespace (by generation) becomes its
            # head, under the next generation; none left: the namespace has no head.
            successor = next((item for item in remaining if item.ns == ns), None)
            if successor is None:
                del heads[ns]
                updates += [namespace_digest(ns), ""]
            else:
                heads[ns] = successor.checkpoint["id"]
                updates += [namespace_digest(ns), checkpoint_digest(ns, heads[ns])]
        drop = [checkpoint_digest(ns, cid) for ns, cid in sorted(doomed)]
        result = yield from _rewrite(p, thread_id, view, heads, "drop", False, drop, updates)
        if not isinstance(result, GenerationMoved):
            return
    raise GenerationMismatchError(
        "the thread kept moving; runs were not deleted", thread_id=thread_id
    )


def delete_for_runs(p: Protocol, run_ids: Sequence[str]) -> Op[None]:
    """Drop the checkpoints (and their writes) whose metadata ``run_id`` is one of
    ``run_ids``, in every thread the run index names; heads move to the newest remaining
    checkpoint. Raises GenerationMismatchError, CheckpointError."""
    runs = {r for r in run_ids if isinstance(r, str) and r}
    threads: set[str] = set()
    for run_id in sorted(runs):
        reply = yield Command(("SMEMBERS", run_index_key(run_id)))
        if not isinstance(reply, set | list):
            raise StoreProtocolError("SMEMBERS did not reply with a set", script="smembers")
        for member in reply:
            threads.add(member.decode("utf-8") if isinstance(member, bytes) else str(member))
    for thread_id in sorted(threads):
        yield from _drop_runs(p, thread_id, runs)
    for run_id in sorted(runs):
        yield Command(("DEL", run_index_key(run_id)))
    p.forget_runs(sorted(runs))


def copy_thread(p: Protocol, source: str, target: str) -> Op[None]:
    """Copy every checkpoint (with values and writes) of ``source`` onto ``target``, oldest
    first, each re-signed for the target and stored through the fenced put: the target is
    claimed for this saver's owner. Raises LeaseHeldElsewhereError when another live worker
    holds the target, CheckpointError for a source record that does not verify."""
    _, members = yield from p.members(source, None, None, "", 0)
    loaded: list[Loaded] = yield from p.load_members(source, members or [])
    for item in reversed(loaded):
        conf: dict[str, object] = {"thread_id": target, "checkpoint_ns": item.ns}
        if item.parent_id is not None:
            conf["checkpoint_id"] = item.parent_id
        checkpoint = item.checkpoint
        versions = {ch: checkpoint["channel_versions"][ch] for ch in checkpoint["channel_values"]}
        yield from p.put({"configurable": conf}, checkpoint, item.metadata, versions)
        if item.slots:
            yield from p.put_slots(
                {
                    "configurable": {
                        "thread_id": target,
                        "checkpoint_ns": item.ns,
                        "checkpoint_id": checkpoint["id"],
                    }
                },
                item.slots,
            )
