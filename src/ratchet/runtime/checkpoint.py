"""Sealing signed checkpoints: the payload format and how a run state becomes one.

Build (:func:`seal_checkpoint`, :func:`seal_split`) validates **before** anything
advances: the state is re-validated against its schema, its cross-object invariants are
checked, and it is serialised canonically. Only then is it signed for generation
``current + 1``; the caller commits it to the generation store, which advances the
high-water mark atomically with the content. An invalid state therefore never burns a
generation.

Opening a checkpoint and deciding what a restore accepts is
:mod:`ratchet.runtime.restore`; both sides share :class:`CheckpointPayload`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from pydantic import ValidationError
from pydantic_core import PydanticSerializationError

from ratchet.errors import (
    CheckpointTooLargeError,
    ContractError,
    InvariantViolation,
)
from ratchet.runtime.archive import (
    ArchiveRef,
    ArchiveSegment,
    ArchiveStart,
    chain_link,
    gate_event,
    window_for,
)
from ratchet.runtime.canonical import canonical_json
from ratchet.runtime.ports import RunKey
from ratchet.runtime.scenario import Scenario
from ratchet.runtime.signing import KeyRing, seal_envelope
from ratchet.runtime.state import (
    TERMINAL_PHASES,
    RunState,
    check_invariants,
)
from ratchet.runtime.types import Digest, Frozen, PosInt
from ratchet.runtime.window import ArchiveWindow, Cut, choose_cut, key_digests

__all__ = [
    "CHECKPOINT_SCHEMA_VERSION",
    "DEFAULT_MAX_CHECKPOINT_BYTES",
    "CheckpointPayload",
    "Sealed",
    "run_key",
    "seal_checkpoint",
    "seal_split",
]

CHECKPOINT_SCHEMA_VERSION: Literal[1] = 1
DEFAULT_MAX_CHECKPOINT_BYTES = 1 << 20


class CheckpointPayload(Frozen):
    schema_version: Literal[1]
    generation: PosInt
    scenario_fingerprint: Digest
    state: RunState
    archive: ArchiveRef | None = None


@dataclass(frozen=True, slots=True)
class Sealed:
    """A checkpoint sealed with an archive: the envelope, the segment to append with it
    (b"" when nothing is new), the archive reference the envelope signs, the state it
    signs (the one sealed, its window moved on when that was due), the engine's memory of
    that window, and the key digests to append beside the archive with the commit."""

    blob: bytes
    segment: bytes
    archive: ArchiveRef
    state: RunState | None = None
    window: ArchiveWindow | None = None
    keys: bytes = b""


def run_key(state: RunState) -> RunKey:
    return RunKey(state.task_id, state.run_id, state.environment.instance_id)


def seal_checkpoint(
    state: RunState,
    scenario: Scenario,
    keyring: KeyRing,
    *,
    generation: int,
    max_bytes: int = DEFAULT_MAX_CHECKPOINT_BYTES,
    previous: RunState | None = None,
) -> bytes:
    """Validate ``state`` and sign it as ``generation``.

    Order: cross-object invariants (only the entries that are new since ``previous``, the
    state last committed, are re-fingerprinted), canonical serialisation, then the schema
    of exactly the bytes that will be signed (``model_copy(update=...)`` skips validation,
    so a bad value set by a caller is caught here, not at restore), then HMAC.

    Raises:
        InvariantViolation: the state is not valid; nothing may be committed.
        CheckpointTooLargeError: the envelope would exceed ``max_bytes``.
    """
    with _serialising():
        check_invariants(state, scenario, previous=previous)
        dumped = _dump(state, previous)
        # Every field but the agent's free-form JSON is typed without floats, and the schema
        # check below refuses a float in any of them; only agent_state needs the float walk
        # (the encoder would turn a NaN there into null instead of refusing it).
        canonical_json(dumped.get("agent_state"))
        data = _payload(generation, scenario, dumped)
        body = orjson.dumps(data, option=orjson.OPT_SORT_KEYS)
    with _schema_checked():
        CheckpointPayload.model_validate_json(_schema_probe(data, state, previous, body))
    return _sign(keyring, body, max_bytes)


def _payload(
    generation: int, scenario: Scenario, state: dict[str, Any], archive: ArchiveRef | None = None
) -> dict[str, Any]:
    data = {
        "schema_version": CHECKPOINT_SCHEMA_VERSION,
        "generation": generation,
        "scenario_fingerprint": scenario.fingerprint,
        "state": state,
    }
    if archive is not None:
        ref: dict[str, Any] = {
            "chain": archive.chain,
            "executed": archive.executed,
            "segments": archive.segments,
            "trace": archive.trace,
        }
        start = archive.window
        if start is not None:
            ref["window"] = {
                "chain": start.chain,
                "executed": start.executed,
                "segments": start.segments,
                "trace": start.trace,
            }
        if archive.keys is not None:
            ref["keys"] = archive.keys
        data["archive"] = ref
    return data


_SERIALISATION_ERRORS = (
    TypeError,
    ValueError,
    AttributeError,
    PydanticSerializationError,
    ContractError,
)
_ARCHIVED: set[str] = {"trace", "executed"}  # never mutated


@contextmanager
def _serialising() -> Iterator[None]:
    try:
        yield
    except _SERIALISATION_ERRORS as exc:
        raise InvariantViolation(
            f"run state cannot be serialised: {type(exc).__name__}", field="state"
        ) from None


def _schema_error(exc: ValidationError) -> InvariantViolation:
    first = exc.errors()[0]
    return InvariantViolation(
        f"run state fails its schema at {first['loc']}: {first['msg']}", field=str(first["loc"])
    )


@contextmanager
def _schema_checked() -> Iterator[None]:
    try:
        yield
    except ValidationError as exc:
        raise _schema_error(exc) from None


def _sign(keyring: KeyRing, body: bytes, max_bytes: int) -> bytes:
    blob = seal_envelope(keyring, body)
    if len(blob) > max_bytes:
        raise CheckpointTooLargeError(
            "checkpoint exceeds the size cap",
            size=len(blob),
            max_bytes=max_bytes,
            reason="too_large",
        )
    return blob


def seal_split(
    state: RunState,
    scenario: Scenario,
    keyring: KeyRing,
    *,
    generation: int,
    archived: ArchiveRef,
    max_bytes: int = DEFAULT_MAX_CHECKPOINT_BYTES,
    previous: RunState | None = None,
    window: ArchiveWindow | None = None,
) -> Sealed:
    """Seal ``state`` as a checkpoint whose trace and executed writes live in the archive.

    ``archived`` is what the archive already holds (the reference the last checkpoint
    signed); the entries of ``state`` beyond it become the new segment, and their keys'
    digests the bytes to append beside the archive (``Sealed.keys``; for a reference made
    before windowed state, every digest of the run). The envelope carries everything else
    of the state (phase, budgets, environment, pending write, agent state, reviews) and
    signs the new archive reference, so what a commit sends and what sealing costs no
    longer grow with the run. The same checks as :func:`seal_checkpoint` run first
    (invariants on the whole state, then the schema of exactly the bytes that are signed
    or appended).

    ``window`` is the engine's memory of the state's window (:func:`window_for` when
    None). Once the window spans more than twice ``WINDOW_SEGMENTS`` segments, it moves
    on (:func:`~ratchet.runtime.window.choose_cut`): ``Sealed.state`` is then ``state``
    without the entries before the new start, and that is the state signed. A terminal
    state's window never moves (the completed run's verifier event stays in it).

    Raises:
        InvariantViolation: the state is not valid, or it does not extend ``archived``.
        CheckpointTooLargeError: the envelope would exceed ``max_bytes``.
    """
    trace_base, executed_base = state.trace_base, state.executed_base
    if not (
        trace_base <= archived.trace <= trace_base + len(state.trace)
        and executed_base <= archived.executed <= executed_base + len(state.executed)
    ):
        raise InvariantViolation("the state does not extend its archive", field="archive")
    if window is None:
        window = window_for(state, archived)
    new_trace = state.trace[archived.trace - trace_base :]
    new_executed = state.executed[archived.executed - executed_base :]
    # The same guards as _serialising() and _schema_checked(), inline: this runs twice per
    # write, and the context managers cost more than the dumps they guard.
    try:
        check_invariants(state, scenario, previous=previous)
        head = state.model_dump(mode="json", warnings=False, exclude=_ARCHIVED)
        head["trace"], head["executed"] = [], []
        canonical_json(head.get("agent_state"))  # refuse floats / NaN in the free-form part
        segment, digests = b"", b""
        ref, hasher, cuts = archived, window.hasher, window.cuts
        start = archived.window or ArchiveStart.model_construct(
            segments=cuts[0].segments,
            trace=cuts[0].trace,
            executed=cuts[0].executed,
            chain=cuts[0].chain,
        )
        if new_trace or new_executed:
            segment = orjson.dumps(
                {
                    "executed": [e.model_dump(mode="json", warnings=False) for e in new_executed],
                    "trace": [e.model_dump(mode="json", warnings=False) for e in new_trace],
                },
                option=orjson.OPT_SORT_KEYS,
            )
            digests = key_digests(new_executed)
            hasher = hasher.copy()
            hasher.update(digests)
            chain = chain_link(archived.chain, segment)
            trace_end = archived.trace + len(new_trace)
            executed_end = archived.executed + len(new_executed)
            cuts = (*cuts, Cut(archived.segments + 1, trace_end, executed_end, chain))
            # Not validated here: the body's schema check below covers every field of it.
            ref = ArchiveRef.model_construct(
                trace=trace_end,
                executed=executed_end,
                segments=archived.segments + 1,
                chain=chain,
                window=start,
                keys=hasher.hexdigest(),
            )
        elif archived.keys is None:
            ref = archived.model_copy(update={"window": start, "keys": hasher.hexdigest()})
        if archived.keys is None:
            # The first commit of a run restored from a checkpoint made before windowed
            # state: the store gets every digest of the run so far.
            digests = window.keys.blob + digests
        moved = ArchiveWindow(window.keys, hasher, cuts)
        cut = (
            None
            if state.phase in TERMINAL_PHASES
            else choose_cut(moved, ref.segments, ref.trace, keep_trace=gate_event(state))
        )
        if cut is not None:
            state = state.model_copy(
                update={
                    "trace": state.trace[cut.trace - trace_base :],
                    "executed": state.executed[cut.executed - executed_base :],
                    "trace_base": cut.trace,
                    "executed_base": cut.executed,
                }
            ).with_keys(window.keys)
            head["trace_base"], head["executed_base"] = cut.trace, cut.executed
            start = ArchiveStart.model_construct(
                segments=cut.segments, trace=cut.trace, executed=cut.executed, chain=cut.chain
            )
            ref = ref.model_copy(update={"window": start})
            moved = ArchiveWindow(window.keys, hasher, cuts[cuts.index(cut) :])
        body = orjson.dumps(_payload(generation, scenario, head, ref), option=orjson.OPT_SORT_KEYS)
    except _SERIALISATION_ERRORS as exc:
        raise InvariantViolation(
            f"run state cannot be serialised: {type(exc).__name__}", field="state"
        ) from None
    try:
        CheckpointPayload.model_validate_json(body)
        if segment:
            ArchiveSegment.model_validate_json(segment)
    except ValidationError as exc:
        raise _schema_error(exc) from None
    return Sealed(_sign(keyring, body, max_bytes), segment, ref, state, moved, digests)


# The JSON dumps of the trace and executed entries of recently sealed states, by the
# state's id (the state itself is kept, so the id cannot be reused while it is here).
# Entries are frozen models: an entry that is the very same object as in ``previous`` dumps
# to the same JSON, so only new entries are dumped. Bounded; a miss only costs time.
# Every operation on it is a single dict call (atomic under the GIL); eviction that races
# with another thread just skips a turn.
_DUMPS: dict[int, tuple[RunState, list[Any], list[Any]]] = {}
_DUMPS_KEPT = 8


def _dump(state: RunState, previous: RunState | None) -> dict[str, Any]:
    """``state.model_dump(mode="json")``, re-dumping only entries new since ``previous``."""
    cached = _DUMPS.get(id(previous)) if previous is not None else None
    if previous is None or cached is None or cached[0] is not previous:
        dumped = state.model_dump(mode="json", warnings=False)
        trace, executed = dumped["trace"], dumped["executed"]
    else:
        dumped = state.model_dump(mode="json", warnings=False, exclude={"trace", "executed"})
        _, old_trace, old_executed = cached
        keep = _shared_prefix(previous.trace, state.trace)
        trace = old_trace[:keep] + [
            e.model_dump(mode="json", warnings=False) for e in state.trace[keep:]
        ]
        keep = _shared_prefix(previous.executed, state.executed)
        executed = old_executed[:keep] + [
            e.model_dump(mode="json", warnings=False) for e in state.executed[keep:]
        ]
        dumped["trace"], dumped["executed"] = trace, executed
    _DUMPS[id(state)] = (state, trace, executed)
    try:
        while len(_DUMPS) > _DUMPS_KEPT:
            _DUMPS.pop(next(iter(_DUMPS)), None)
    except (RuntimeError, StopIteration):  # another thread changed it meanwhile
        pass
    return dumped


def _shared_prefix(old: tuple[object, ...], new: tuple[object, ...]) -> int:
    """``len(old)`` when ``new`` starts with ``old``'s entries, else 0.

    Tuple comparison runs in C and takes an entry that is the very same object as equal
    without calling its ``__eq__`` (the common case: states grow by appending); an entry
    that is only equal in value is a frozen, validated model with the same fields, so it
    dumps to the same JSON and needs no second schema check either.
    """
    count = len(old)
    return count if count <= len(new) and new[:count] == old else 0


def _schema_probe(
    data: dict[str, Any], state: RunState, previous: RunState | None, body: bytes
) -> bytes:
    """The bytes whose schema must be checked before signing ``body``.

    Trace events and executed writes that are the very same (frozen, already validated)
    objects as in the state last committed are left out, so the check costs what changed,
    not the whole history. Everything else, every scalar included, is checked.
    """
    if previous is None:
        return body
    trace = _shared_prefix(previous.trace, state.trace)
    executed = _shared_prefix(previous.executed, state.executed)
    if not trace and not executed:
        return body
    reduced = dict(data["state"])
    reduced["trace"] = reduced["trace"][trace:]
    reduced["executed"] = reduced["executed"][executed:]
    return orjson.dumps({**data, "state": reduced})
