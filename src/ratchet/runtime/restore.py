"""Restoring signed checkpoints: opening one and deciding what a restore accepts.

Restore (:func:`restore_checkpoint`) checks, in this order, failing closed at the first
problem with a :class:`CheckpointError` whose ``reason`` names the check:

1. strict parse of the envelope (``malformed``, ``envelope_version``);
2. plain checksum (``checksum``): random corruption;
3. HMAC in constant time (``unknown_kid``, ``retired_kid``, ``bad_mac``): authenticity;
4. payload schema version (``schema_version``) and strict, canonical payload (``schema``);
   then, for a checkpoint that names an archive, the archive (``archive``): exactly the
   named number of segments, each strict canonical JSON, whose hash chain ends in the
   signed chain value and whose entries add up to the signed counts;
5. scenario fingerprint against the externally supplied scenario (``scenario``);
6. run state invariants (``invariant``);
7. generation equal to the external high-water mark (``high_water_missing``,
   ``stale_generation``): freshness;
8. environment (``environment``): same instance id, and exactly the checkpoint's state,
   the one-commit state of the single pending write, or the state an open review case
   recorded;
9. trust roots for every approval and review decision inside (``trust``).

Sealing, and the payload format both sides share, is :mod:`ratchet.runtime.checkpoint`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pydantic import ValidationError

from ratchet.errors import (
    CheckpointError,
    EvidenceError,
    HighWaterUnavailableError,
    InvariantViolation,
)
from ratchet.runtime.archive import ArchiveRef, refuse, unarchive
from ratchet.runtime.canonical import is_canonical
from ratchet.runtime.checkpoint import CHECKPOINT_SCHEMA_VERSION, CheckpointPayload, run_key
from ratchet.runtime.evidence import TrustRoots
from ratchet.runtime.ports import Observation, RunKey
from ratchet.runtime.scenario import Scenario
from ratchet.runtime.signing import KeyRing, open_envelope
from ratchet.runtime.state import RunState, check_invariants
from ratchet.runtime.window import KeySet, key_digests

__all__ = [
    "Restored",
    "as_window",
    "check_environment",
    "check_fresh",
    "finish_restore",
    "high_water_missing",
    "open_checkpoint",
    "open_for_restore",
    "restore_checkpoint",
]


@dataclass(frozen=True, slots=True)
class Restored:
    state: RunState
    generation: int
    blob: bytes
    archive: ArchiveRef | None = None
    # The environment observed during the restore, and (``tolerate_environment`` only)
    # why it was not one the checkpoint accepts (None: it was).
    observed: Observation | None = None
    environment_refused: CheckpointError | None = None


_fail = refuse


def check_environment(state: RunState, observed: Observation) -> None:
    """Accept only the checkpoint's exact state, its pending write's one-commit state, or,
    while a review case is open, the state the case recorded when it opened (what the
    reviewer sees and signs; the foreign write that opened the case usually moved it).

    Raises:
        CheckpointError: reason ``environment``.
    """
    recorded = state.environment
    if observed.instance_id != recorded.instance_id:
        raise _fail(
            "environment",
            "environment instance differs from the checkpoint's",
            expected=recorded.instance_id,
            observed=observed.instance_id,
        )
    if observed.same_state(recorded):
        return
    pending = state.pending
    if (
        pending is not None
        and pending.env_after is not None
        and observed.same_state(pending.env_after)
    ):
        return
    if state.review is not None and observed.same_state(state.review.environment):
        return
    if observed.version < recorded.version:
        # The environment's own record is behind what the run saw of it: restored from
        # an older copy (a backup, a snapshot). Receipts it recorded since are gone from
        # it, so "no receipt" for a key would prove nothing: never run on it, never
        # accept it as a new baseline.
        raise _fail(
            "environment",
            f"environment is behind the checkpoint's record of it (version "
            f"{observed.version} < {recorded.version}): restored from an older copy? What "
            "it recorded since is gone from it, so it is not run on",
            expected_version=recorded.version,
            observed_version=observed.version,
            behind=True,
        )
    raise _fail(
        "environment",
        "environment is neither the checkpoint's state nor the "
        "one-commit state of its pending write",
        expected_version=recorded.version,
        observed_version=observed.version,
    )


def _check_trust(
    state: RunState, approvers: TrustRoots | None, reviewers: TrustRoots | None
) -> None:
    """Every approval and decision inside must verify under the supplied trust roots.

    A signer revoked since is accepted here: the evidence was verified when it was used
    and is sealed under the checkpoint's HMAC, and refusing the whole checkpoint would
    strand the run and hide that evidence. The one approval that may still authorise an
    effect, the pending write's, is checked for revocation again right before it would
    execute (``machine.check_executable``), never trusted from here.
    """
    approvals = [e.sealed_approval for e in state.trace if e.sealed_approval is not None]
    cases = [*state.closed_reviews, *([state.review] if state.review else [])]
    approvals += [c.pending.approval for c in cases if c.pending.approval is not None]
    if state.pending is not None and state.pending.approval is not None:
        approvals.append(state.pending.approval)
    decisions = [c.decision for c in cases if c.decision is not None]
    if approvals and approvers is None:
        raise _fail("trust", "checkpoint holds approvals but no approver trust root was given")
    if (decisions or state.rebaselines) and reviewers is None:
        raise _fail(
            "trust", "checkpoint holds review decisions but no reviewer trust root was given"
        )
    try:
        if approvers is not None:
            for approval in approvals:
                approvers.verify_approval(approval, allow_revoked=True)
        if reviewers is not None:
            for decision in decisions:
                reviewers.verify_review(decision, allow_revoked=True)
            for rebaseline in state.rebaselines:
                reviewers.verify_rebaseline(rebaseline, allow_revoked=True)
    except EvidenceError as exc:
        raise _fail(
            "trust",
            f"evidence inside the checkpoint does not verify: {exc.message}",
            evidence_reason=exc.reason or "",
        ) from None


def open_checkpoint(
    blob: bytes,
    *,
    keyring: KeyRing,
    archive: Sequence[bytes] = (),
    windowed: bool = False,
    archive_from: int = 0,
    keys: bytes | None = None,
) -> CheckpointPayload:
    """Checks 1-4 of the module docstring: the authentic, strict, canonical payload, with
    the trace and executed writes of its archive put back into its state.

    By default the state is the whole history (``trace_base`` 0), checked against the
    whole archive: what ``ratchet show``, exports and every other reader of a run's
    history use. ``windowed`` (a worker's restore) gives the state as signed: only the
    window's entries, and the run's key set (``keys``: the digests the store keeps,
    checked against the signed SHA-256). Then ``archive`` may be the archive's last
    segments only, ``archive_from`` being the index of the first one given; only the
    segments after the window's start are read. Without ``keys`` the whole archive is
    read and the digests are made from it.

    Raises:
        CheckpointError: ``reason`` names the failed check; ``archive_short`` when the
            segments given do not reach back to the window's start (read them all).
    """
    body = open_envelope(keyring, blob)
    # pydantic's JSON parser keeps the last of duplicate keys and accepts any key order or
    # spacing; requiring the exact canonical bytes rules all of that out.
    if not is_canonical(body):
        raise _fail("schema", "checkpoint payload is not canonical JSON")
    try:
        payload = CheckpointPayload.model_validate_json(body)
    except ValidationError as exc:
        schema = _peek_schema_version(body)
        if schema is not None and schema != CHECKPOINT_SCHEMA_VERSION:
            raise _fail(
                "schema_version", "unsupported checkpoint schema version", schema_version=schema
            ) from None
        first = exc.errors()[0]
        raise _fail(
            "schema", f"checkpoint payload fails its schema at {first['loc']}: {first['msg']}"
        ) from None
    ref = payload.archive
    if ref is None:
        if archive:
            raise _fail(
                "archive",
                "the store holds an archive this checkpoint does not name",
                segments=len(archive),
            )
        if payload.state.trace_base or payload.state.executed_base:
            raise _fail("archive", "a checkpoint without an archive has a windowed state")
        return payload
    state = unarchive(
        payload.state, ref, archive, windowed=windowed, archive_from=archive_from, keys=keys
    )
    return payload.model_copy(update={"state": state})


def as_window(payload: CheckpointPayload) -> CheckpointPayload:
    """``payload`` with its state cut to the window its archive reference signs (a no-op
    for a payload opened ``windowed``): for a caller that opened the whole history first.

    Raises:
        CheckpointError: ``archive``: the state is windowed elsewhere than signed.
    """
    ref, state = payload.archive, payload.state
    start = ref.window if ref is not None else None
    if start is None or (state.trace_base, state.executed_base) == (start.trace, start.executed):
        return payload
    if state.trace_base or state.executed_base:
        raise _fail("archive", "the state's window does not start where its archive says")
    window = state.model_copy(
        update={
            "trace": state.trace[start.trace :],
            "executed": state.executed[start.executed :],
            "trace_base": start.trace,
            "executed_base": start.executed,
        }
    )
    keys = KeySet(key_digests(state.executed))
    return payload.model_copy(update={"state": window.with_keys(keys)})


def open_for_restore(
    blob: bytes,
    *,
    scenario: Scenario,
    keyring: KeyRing,
    archive: Sequence[bytes] = (),
    opened: CheckpointPayload | None = None,
    windowed: bool = False,
    archive_from: int = 0,
    keys: bytes | None = None,
) -> CheckpointPayload:
    """Checks 1-6 of a restore: open ``blob`` (unless ``opened`` is what
    :func:`open_checkpoint` returned for it already), then the scenario fingerprint and
    the run state's invariants. Pure: nothing is read or observed. ``windowed``,
    ``archive_from`` and ``keys`` are :func:`open_checkpoint`'s.

    Raises:
        CheckpointError: ``reason`` names the failed check.
    """
    payload = (
        opened
        if opened is not None
        else open_checkpoint(
            blob,
            keyring=keyring,
            archive=archive,
            windowed=windowed,
            archive_from=archive_from,
            keys=keys,
        )
    )
    if windowed:
        payload = as_window(payload)
    if payload.scenario_fingerprint != scenario.fingerprint:
        raise _fail(
            "scenario",
            "checkpoint was made under another scenario (task, policy, "
            "permissions, allowlists, initial state or verifier expectations changed)",
        )
    try:
        check_invariants(payload.state, scenario)
    except InvariantViolation as exc:
        raise _fail("invariant", exc.message) from None
    return payload


def high_water_missing(exc: HighWaterUnavailableError) -> CheckpointError:
    """Check 7's refusal when the high-water mark cannot be read: fail closed."""
    return _fail("high_water_missing", f"high-water mark unavailable: {exc.message}")


def check_fresh(payload: CheckpointPayload, high_water: int) -> None:
    """Check 7: the checkpoint's generation is the store's high-water mark.

    Raises:
        CheckpointError: ``stale_generation``, with both generations.
    """
    if payload.generation != high_water:
        raise _fail(
            "stale_generation",
            "checkpoint generation is not the high-water mark",
            generation=payload.generation,
            high_water=high_water,
        )


def finish_restore(
    payload: CheckpointPayload,
    blob: bytes,
    observed: Observation,
    *,
    approvers: TrustRoots | None = None,
    reviewers: TrustRoots | None = None,
    accept_environment: Observation | None = None,
    tolerate_environment: bool = False,
) -> Restored:
    """Checks 8 and 9 of a restore, on a checkpoint that passed 1-7: the environment as
    ``observed`` now (behind the new owner's fence), then the trust roots.

    Two callers relax the environment check, never the others: ``accept_environment`` is
    the new baseline a *verified* rebaseline decision names (the caller checked it); an
    observation that equals it exactly is accepted. ``tolerate_environment`` (an operator's
    cancel, which writes nothing) returns the refusal in ``Restored.environment_refused``
    instead of raising it.

    Raises:
        CheckpointError: ``environment`` or ``trust``.
    """
    state = payload.state
    refused: CheckpointError | None = None
    if accept_environment is None or not observed.same_state(accept_environment):
        try:
            check_environment(state, observed)
        except CheckpointError as exc:
            if not tolerate_environment:
                raise
            refused = exc
    _check_trust(state, approvers, reviewers)
    return Restored(
        state=state,
        generation=payload.generation,
        blob=blob,
        archive=payload.archive,
        observed=observed,
        environment_refused=refused,
    )


def restore_checkpoint(
    blob: bytes,
    *,
    scenario: Scenario,
    keyring: KeyRing,
    high_water: Callable[[RunKey], int] | None,
    observe: Callable[[RunState, int], Observation],
    approvers: TrustRoots | None = None,
    reviewers: TrustRoots | None = None,
    archive: Sequence[bytes] = (),
    opened: CheckpointPayload | None = None,
    accept_environment: Observation | None = None,
    tolerate_environment: bool = False,
) -> Restored:
    """Verify a checkpoint and return its state: every check, in the module docstring's
    order. The engine's restore (:meth:`RunEngine.resume`) runs the same checks with the
    high-water read and the observation as effects; this form takes them as callables.

    ``archive`` is the run's archive segments as the store returned them with ``blob``
    (oldest first); a checkpoint that names an archive restores only with exactly it.
    ``high_water(key)`` reads the store's high-water mark (None: there is no store, and
    the restore fails closed). ``observe(state, generation)`` is called once the
    checkpoint is proven authentic and fresh, and returns the environment as it is now.

    Expired approvals load (they are evidence an operator must see); whether they may
    still execute is decided later by the state machine, never here. See
    :func:`finish_restore` for ``accept_environment`` and ``tolerate_environment``.

    Raises:
        CheckpointError: ``reason`` names the failed check.
    """
    payload = open_for_restore(
        blob, scenario=scenario, keyring=keyring, archive=archive, opened=opened
    )
    if high_water is None:
        raise _fail("high_water_missing", "no generation store: restore fails closed")
    try:
        mark = high_water(run_key(payload.state))
    except HighWaterUnavailableError as exc:
        raise high_water_missing(exc) from None
    check_fresh(payload, mark)
    return finish_restore(
        payload,
        blob,
        observe(payload.state, payload.generation),
        approvers=approvers,
        reviewers=reviewers,
        accept_environment=accept_environment,
        tolerate_environment=tolerate_environment,
    )


def _peek_schema_version(body: bytes) -> object:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    return data.get("schema_version") if isinstance(data, dict) else None
