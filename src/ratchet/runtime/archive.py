"""A run's archive: the signed reference to it, its segments and hash chain, and the
window of the run's state over it (``docs/windowed-state.md``).

A checkpoint that names an archive (:class:`ArchiveRef`) keeps its trace events and
executed writes out of the envelope: each commit appends one segment, a hash chain bound
to the run's id folds every segment in, and the envelope signs the chain's end, the
entry counts, where the state's window starts (:class:`ArchiveStart`) and the SHA-256 of
every executed write's key digest. This module checks an archive against that reference
(:func:`unarchive`), gives the engine its memory of the window (:func:`window_for`),
and recalls an executed write older than the window (:func:`recall_executed`). Sealing
and opening the envelope itself is :mod:`ratchet.runtime.restore`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, cast

import orjson
from pydantic import ValidationError

from ratchet.errors import CheckpointError, InvariantViolation
from ratchet.runtime.canonical import Domain, is_canonical
from ratchet.runtime.state import ExecutedWrite, RunState, TraceEvent, TraceOutcome
from ratchet.runtime.types import Digest, Frozen, NonNegInt
from ratchet.runtime.window import DIGEST_BYTES, ArchiveWindow, Cut, KeySet, key_digests

__all__ = [
    "ArchiveRef",
    "ArchiveSegment",
    "ArchiveStart",
    "archive_genesis",
    "chain_link",
    "chain_over",
    "empty_archive",
    "gate_event",
    "recall_executed",
    "refuse",
    "unarchive",
    "window_for",
]


def refuse(reason: str, message: str, **context: Any) -> CheckpointError:
    """A restore's refusal: ``reason`` names the check that failed."""
    return CheckpointError(message, reason=reason, **context)


class ArchiveStart(Frozen):
    """Where the window of a run's state starts in its archive: after ``segments``
    segments, which hold ``trace`` trace events and ``executed`` executed writes and whose
    hash chain ends in ``chain``."""

    segments: NonNegInt
    trace: NonNegInt
    executed: NonNegInt
    chain: Digest


class ArchiveRef(Frozen):
    """What of a run's trace and executed writes lives in its archive, not in the
    checkpoint: how many of each, in how many segments, and the hash chain over them.

    Signed inside the checkpoint, it binds the archive: restore recomputes the chain over
    the segments the store returns and refuses any difference (a segment changed, dropped,
    added, reordered, or taken from another run).

    ``window`` and ``keys`` (both or neither; neither in checkpoints made before windowed
    state): where the state's window starts (``ratchet.runtime.window``), so a restore
    reads and checks only the segments after it; and the SHA-256 over the 8-byte digests
    of every executed write's key, in order, which the store keeps beside the archive.
    """

    trace: NonNegInt
    executed: NonNegInt
    segments: NonNegInt
    chain: Digest
    window: ArchiveStart | None = None
    keys: Digest | None = None


class ArchiveSegment(Frozen):
    """One commit's new trace events and executed writes, appended to the archive."""

    executed: tuple[ExecutedWrite, ...] = ()
    trace: tuple[TraceEvent, ...] = ()


def archive_genesis(run_id: str) -> str:
    """Where run ``run_id``'s archive chain starts: an archive is bound to its run."""
    return hashlib.sha256(Domain.ARCHIVE + b"\x00genesis\x00" + run_id.encode()).hexdigest()


_NO_KEYS = hashlib.sha256(b"").hexdigest()


def empty_archive(run_id: str) -> ArchiveRef:
    """The reference of run ``run_id``'s archive while it holds nothing yet."""
    genesis = archive_genesis(run_id)
    return ArchiveRef(
        trace=0,
        executed=0,
        segments=0,
        chain=genesis,
        window=ArchiveStart(segments=0, trace=0, executed=0, chain=genesis),
        keys=_NO_KEYS,
    )


def window_for(state: RunState, archived: ArchiveRef) -> ArchiveWindow:
    """The engine's memory of ``state``'s window over ``archived`` (see
    :class:`~ratchet.runtime.window.ArchiveWindow`): its key set (the state's, or for a
    state that holds its whole history, made from its executed writes), and the points
    the window may start at: where it starts and where the archive ends.

    Raises:
        InvariantViolation: the state's window or key set does not meet ``archived``.
    """
    start = archived.window
    if start is None:
        start = ArchiveStart(segments=0, trace=0, executed=0, chain=archive_genesis(state.run_id))
    if (state.trace_base, state.executed_base) != (start.trace, start.executed):
        raise InvariantViolation("the state's window does not start where its archive says")
    keys = state.keys
    if keys is None:
        if state.executed_base:
            raise InvariantViolation("a windowed state carries no executed-key set")
        keys = KeySet(key_digests(state.executed[: archived.executed]))
    if keys.count != archived.executed or (
        archived.keys is not None and keys.hexdigest() != archived.keys
    ):
        raise InvariantViolation("the executed-key set is not the archive's", field="archive")
    cuts = [Cut(start.segments, start.trace, start.executed, start.chain)]
    if archived.segments != start.segments:
        cuts.append(Cut(archived.segments, archived.trace, archived.executed, archived.chain))
    return ArchiveWindow(keys, keys.hasher(), tuple(cuts))


def chain_link(previous: str, segment: bytes) -> str:
    return hashlib.sha256(
        Domain.ARCHIVE + b"\x00" + bytes.fromhex(previous) + hashlib.sha256(segment).digest()
    ).hexdigest()


def chain_over(start: str, segments: Sequence[bytes]) -> str:
    """:func:`_chain` folded over ``segments`` from ``start``, in raw bytes until the end."""
    prefix = Domain.ARCHIVE + b"\x00"
    sha256 = hashlib.sha256
    link = bytes.fromhex(start)
    for segment in segments:
        link = sha256(prefix + link + sha256(segment).digest()).digest()
    return link.hex()


def gate_event(state: RunState) -> int | None:
    """The trace index of the verifier event that can still let the run finish (its
    report passed at the environment as it is now), which the window must keep: the
    finish gate and a completed state's invariant look for it. None when there is none."""
    report, env = state.verification, state.environment
    if report is None or not report.passed:
        return None
    if (report.env_instance_id, report.env_version, report.env_fingerprint) != (
        env.instance_id,
        env.version,
        env.fingerprint,
    ):
        return None
    trace = state.trace
    for offset in range(len(trace) - 1, -1, -1):
        event = trace[offset]
        if event.outcome is TraceOutcome.VERIFIED and event.verifier == report:
            return state.trace_base + offset
    return None


def _segments(archive: Sequence[bytes], first: int) -> tuple[list[TraceEvent], list[ExecutedWrite]]:
    """Every entry of ``archive`` (segment ``first`` first), each segment checked."""
    trace: list[TraceEvent] = []
    executed: list[ExecutedWrite] = []
    validate = ArchiveSegment.model_validate_json
    for index, segment in enumerate(archive, first):
        if not isinstance(segment, bytes) or not is_canonical(segment):
            raise refuse("archive", "an archive segment is not canonical JSON", segment=index)
        try:
            parsed = validate(segment)
        except ValidationError:
            raise refuse("archive", "an archive segment fails its schema", segment=index) from None
        if not parsed.trace and not parsed.executed:
            raise refuse("archive", "an archive segment is empty", segment=index)
        trace.extend(parsed.trace)
        executed.extend(parsed.executed)
    return trace, executed


def unarchive(
    head: RunState,
    ref: ArchiveRef,
    archive: Sequence[bytes],
    *,
    windowed: bool,
    archive_from: int,
    keys: bytes | None,
) -> RunState:
    """``head`` with the entries of ``archive`` put back (all of them, or with
    ``windowed`` those of the window), after checking them against the signed ``ref``."""
    if head.trace or head.executed:
        raise refuse("archive", "a checkpoint with an archive carries trace entries itself")
    start = ref.window
    if (start is None) != (ref.keys is None):
        raise refuse("archive", "the archive reference names a window without a key set")
    if start is None:
        start = ArchiveStart(segments=0, trace=0, executed=0, chain=archive_genesis(head.run_id))
    if (head.trace_base, head.executed_base) != (start.trace, start.executed):
        raise refuse("archive", "the state's window does not start where its archive says")
    if start.segments > ref.segments or (start.trace, start.executed) > (ref.trace, ref.executed):
        raise refuse("archive", "the window starts after the archive ends")
    if archive_from < 0 or archive_from + len(archive) != ref.segments:
        raise refuse(
            "archive",
            "the archive does not have the signed number of segments",
            segments=archive_from + len(archive),
            expected=ref.segments,
        )
    whole = not windowed or keys is None or ref.keys is None
    if archive_from > (0 if whole else start.segments):
        raise refuse(
            "archive_short",
            "the archive segments read do not reach back to the window's start",
            first=archive_from,
            needed=0 if whole else start.segments,
        )
    cut = start.segments - archive_from
    if whole:
        trace, executed = _segments(archive, 0)
        older = chain_over(archive_genesis(head.run_id), archive[:cut])
        if older != start.chain:
            raise refuse("archive", "the archive's hash chain is not the signed one")
        chain = chain_over(older, archive[cut:])
    else:
        trace, executed = _segments(archive[cut:], start.segments)
        chain = chain_over(start.chain, archive[cut:])
    if chain != ref.chain:
        raise refuse("archive", "the archive's hash chain is not the signed one")
    base_trace, base_executed = (0, 0) if whole else (start.trace, start.executed)
    if (base_trace + len(trace), base_executed + len(executed)) != (ref.trace, ref.executed):
        raise refuse(
            "archive",
            "the archive does not hold the signed number of entries",
            trace=base_trace + len(trace),
            executed=base_executed + len(executed),
        )
    if whole:
        if ref.keys is not None and KeySet(key_digests(executed)).hexdigest() != ref.keys:
            raise refuse("archive", "the executed keys are not the signed ones")
        if not windowed:
            return head.model_copy(
                update={
                    "trace": tuple(trace),
                    "executed": tuple(executed),
                    "trace_base": 0,
                    "executed_base": 0,
                }
            )
        window = head.model_copy(
            update={
                "trace": tuple(trace[start.trace :]),
                "executed": tuple(executed[start.executed :]),
            }
        )
        return window if not start.executed else window.with_keys(KeySet(key_digests(executed)))
    return head.model_copy(update={"trace": tuple(trace), "executed": tuple(executed)}).with_keys(
        _key_set(cast(bytes, keys), ref, executed)
    )


def _key_set(keys: bytes, ref: ArchiveRef, window: Sequence[ExecutedWrite]) -> KeySet:
    """The store's key digests as a key set, once they are exactly the signed ones and
    end in the digests of the window's executed writes."""
    if not isinstance(keys, bytes) or len(keys) != ref.executed * DIGEST_BYTES:
        raise refuse("archive", "the store's executed-key digests are not the signed number")
    found = KeySet(keys)
    if found.hexdigest() != ref.keys:
        raise refuse("archive", "the store's executed-key digests are not the signed ones")
    if window and keys[-len(window) * DIGEST_BYTES :] != key_digests(window):
        raise refuse("archive", "the executed-key digests do not match the window's writes")
    return found


def recall_executed(
    archive: Sequence[bytes], ref: ArchiveRef, run_id: str, key: str, ordinal: int
) -> ExecutedWrite:
    """The executed write at ``ordinal`` (before the window ``ref`` signs), read from the
    run's whole ``archive`` as the store returned it, once the segments before the window
    hash to the signed chain value of its start, and only if it carries ``key``.

    Raises:
        CheckpointError: ``archive``: the archive is not the signed one, or the write at
            that ordinal has another key (a digest collision, or a damaged key set).
    """
    start = ref.window
    if start is None or not 0 <= ordinal < start.executed:
        raise refuse("archive", "the write to recall is not before the window", ordinal=ordinal)
    older = archive[: start.segments]
    if len(older) != start.segments:
        raise refuse("archive", "the archive is shorter than the window's start")
    if chain_over(archive_genesis(run_id), older) != start.chain:
        raise refuse("archive", "the archive's hash chain is not the signed one")
    # Authentic bytes now (bound by the signed chain): count entries cheaply, then check
    # and parse the one segment that holds the write.
    count = 0
    for index, segment in enumerate(older):
        try:
            held = len(orjson.loads(segment)["executed"])
        except (orjson.JSONDecodeError, KeyError, TypeError):
            raise refuse("archive", "an archive segment fails its schema", segment=index) from None
        if ordinal < count + held:
            _, executed = _segments([segment], index)
            entry = executed[ordinal - count]
            if entry.idempotency_key != key:
                raise refuse(
                    "archive",
                    "the executed write at the key's ordinal has another key",
                    ordinal=ordinal,
                )
            return entry
        count += held
    raise refuse("archive", "the archive holds fewer executed writes than its window says")
