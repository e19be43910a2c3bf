"""Every script reply is decoded here, and only here, into a typed result or a typed error.

Scripts reply ``{status, ...}``. The status decides the shape; anything else (a reply that
is not a list, an unknown status, a wrong length, a wrong type, text that is not UTF-8)
raises :class:`~ratchet.errors.StoreProtocolError`. Nothing is guessed.

Integers must arrive as Redis integers; bytes and text as bulk strings. Clients must use
``decode_responses=False`` (checkpoints are bytes), and a text field that arrives as
``str`` is accepted only because fakeredis and some proxies return it that way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from ratchet.errors import (
    ApprovalWindowClosedError,
    ContractError,
    GenerationMismatchError,
    LeaseLostError,
    NonceReplayError,
    RunExistsError,
    RunNotFoundError,
    StaleStateError,
    StoreProtocolError,
)
from ratchet.leasing.results import (
    Acquired,
    CommitResult,
    Lease,
    LeaseHolder,
    PhaseMove,
    ReapClaim,
    Released,
    RunCreated,
    RunSnapshot,
)

__all__ = [
    "batch_entries",
    "check_arity",
    "decode_acquire",
    "decode_claim_reap",
    "decode_commit",
    "decode_counted",
    "decode_create",
    "decode_drop_expiry",
    "decode_phase_move",
    "decode_read",
    "decode_release",
    "decode_release_of",
    "decode_renew",
    "decode_renewal",
    "int_field",
    "lease_refused",
    "protocol_error",
    "split_reply",
    "text_field",
]


def _fail(message: str, script: str, **context: Any) -> NoReturn:
    raise StoreProtocolError(message, script=script, **context)


def _split(reply: object, script: str) -> tuple[str, list[object]]:
    if not isinstance(reply, list) or not reply:
        _fail("reply is not a non-empty list", script)
    head = reply[0]
    if isinstance(head, bytes):
        try:
            status = head.decode("ascii")
        except UnicodeDecodeError:
            _fail("reply status is not ASCII", script)
    elif isinstance(head, str):
        status = head
    else:
        _fail("reply status is not a string", script)
    return status, list(reply[1:])


def _arity(fields: list[object], n: int, script: str, status: str) -> None:
    if len(fields) != n:
        _fail(f"reply '{status}' has {len(fields)} fields, expected {n}", script, status=status)


def _int(value: object, script: str, name: str) -> int:
    # bool is an int subclass; a Redis reply never legitimately carries one.
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(f"field {name} is not an integer", script, field=name)
    if value < 0:
        _fail(f"field {name} is negative", script, field=name)
    return value


def _text(value: object, script: str, name: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            _fail(f"field {name} is not UTF-8", script, field=name)
    _fail(f"field {name} is not a string", script, field=name)


# Shared with every other module that decodes script replies (the LangGraph saver's).
protocol_error = _fail
split_reply = _split
check_arity = _arity
int_field = _int
text_field = _text


def _blob(value: object, script: str, name: str) -> bytes:
    if not isinstance(value, bytes):
        _fail(f"field {name} is not bytes (is the client decoding responses?)", script, field=name)
    return value


def _unknown(status: str, script: str) -> NoReturn:
    _fail(f"unknown reply status '{status}'", script, status=status)


def decode_create(reply: object, run_id: str) -> RunCreated:
    """Decode create_run. Raises RunExistsError, StoreProtocolError."""
    script = "create_run"
    status, f = _split(reply, script)
    if status == "created":
        _arity(f, 3, script, status)
        return RunCreated(
            run_id,
            _int(f[0], script, "generation"),
            _int(f[1], script, "state_version"),
            created_at_ms=_int(f[2], script, "now_ms"),
            already_applied=False,
        )
    if status == "already_applied":
        _arity(f, 5, script, status)
        return RunCreated(
            run_id,
            _int(f[0], script, "generation"),
            _int(f[1], script, "state_version"),
            created_at_ms=_int(f[2], script, "created_at_ms"),
            already_applied=True,
            phase=_text(f[3], script, "phase"),
            phase_at_ms=_int(f[4], script, "phase_at_ms"),
        )
    if status == "exists":
        _arity(f, 2, script, status)
        raise RunExistsError(
            "a run with this id already exists",
            run_id=run_id,
            generation=_int(f[0], script, "generation"),
            state_version=_int(f[1], script, "state_version"),
        )
    if status == "purged":
        raise RunExistsError(
            "a run with this id was purged; run ids are never reused", run_id=run_id, purged=True
        )
    _unknown(status, script)


def decode_acquire(reply: object, run_id: str, owner: str) -> Acquired | LeaseHolder:
    """Decode acquire_lease into the granted lease or the current holder.

    Raises RunNotFoundError, StoreProtocolError.
    """
    script = "acquire_lease"
    status, f = _split(reply, script)
    if status == "acquired":
        _arity(f, 12, script, status)
        took_over = _int(f[7], script, "took_over")
        if took_over not in (0, 1):
            _fail("took_over is not 0 or 1", script, run_id=run_id)
        lease = Lease(
            run_id=run_id,
            owner=owner,
            lease_version=_int(f[0], script, "lease_version"),
            expires_at_ms=_int(f[1], script, "expires_at_ms"),
            now_ms=_int(f[2], script, "now_ms"),
        )
        return Acquired(
            lease=lease,
            generation=_int(f[3], script, "generation"),
            state_version=_int(f[4], script, "state_version"),
            task_id=_text(f[5], script, "task_id"),
            env_instance_id=_text(f[6], script, "env_instance_id"),
            took_over=took_over == 1,
            previous_owner=_text(f[8], script, "previous_owner"),
            previous_lease_version=_int(f[9], script, "previous_lease_version"),
            phase=_text(f[10], script, "phase"),
            phase_at_ms=_int(f[11], script, "phase_at_ms"),
        )
    if status == "held":
        _arity(f, 4, script, status)
        return LeaseHolder(
            run_id=run_id,
            owner=_text(f[0], script, "owner"),
            lease_version=_int(f[1], script, "lease_version"),
            expires_at_ms=_int(f[2], script, "expires_at_ms"),
            now_ms=_int(f[3], script, "now_ms"),
        )
    if status == "no_run":
        _arity(f, 0, script, status)
        raise RunNotFoundError("no run with this id", run_id=run_id)
    _unknown(status, script)


def lease_refused(
    status: str,
    f: list[object],
    script: str,
    *,
    owner: str,
    lease_version: int,
    subject: Mapping[str, str],
) -> NoReturn:
    """Raise LeaseLostError for a ``lease_lost`` / ``lease_expired`` reply (``owner,
    lease_version, expires_at_ms, now_ms`` of the lease as it is now), naming the caller's
    lease and ``subject`` (``{"run_id": ...}`` or ``{"thread_id": ...}``). A current
    version below the caller's means the store went backwards (a restored snapshot, a
    failover that lost writes): the reason is then ``store_rolled_back``.

    One decoder for every lease ratchet keeps (runs and LangGraph threads).
    """
    _arity(f, 4, script, status)
    current_owner = _text(f[0], script, "owner")
    current_version = _int(f[1], script, "lease_version")
    reason = status
    if status == "lease_lost" and current_version < lease_version:
        reason = "store_rolled_back"
    raise LeaseLostError(
        f"the lease is no longer held ({reason})",
        **subject,
        owner=owner,
        lease_version=lease_version,
        reason=reason,
        current_owner=current_owner or None,
        current_lease_version=current_version,
        expires_at_ms=_int(f[2], script, "expires_at_ms"),
        now_ms=_int(f[3], script, "now_ms"),
    )


def _lease_lost(f: list[object], script: str, lease: Lease, why: str) -> NoReturn:
    lease_refused(
        why,
        f,
        script,
        owner=lease.owner,
        lease_version=lease.lease_version,
        subject={"run_id": lease.run_id},
    )


def decode_renewal(
    reply: object,
    *,
    owner: str,
    lease_version: int,
    subject: Mapping[str, str],
    missing: Callable[[], NoReturn],
) -> tuple[int, int]:
    """Decode renew_lease for any lease: ``(expires_at_ms, now_ms)`` of the renewed lease.

    Raises LeaseLostError, what ``missing()`` raises for ``no_run`` (no such lease record),
    StoreProtocolError.
    """
    script = "renew_lease"
    status, f = _split(reply, script)
    if status == "renewed":
        _arity(f, 3, script, status)
        if _int(f[0], script, "lease_version") != lease_version:
            _fail("renewed a different lease version", script, status=status)
        return _int(f[1], script, "expires_at_ms"), _int(f[2], script, "now_ms")
    if status in ("lease_lost", "lease_expired"):
        lease_refused(status, f, script, owner=owner, lease_version=lease_version, subject=subject)
    if status == "no_run":
        _arity(f, 0, script, status)
        missing()
    _unknown(status, script)


def decode_release_of(
    reply: object,
    *,
    owner: str,
    lease_version: int,
    subject: Mapping[str, str],
    missing: Callable[[], NoReturn],
    script: str = "release_lease",
) -> tuple[int, int]:
    """Decode release_lease (or a commit's trailing release) for any lease:
    ``(lease_version, now_ms)``.

    Raises LeaseLostError, what ``missing()`` raises for ``no_run``, StoreProtocolError.
    """
    status, f = _split(reply, script)
    if status == "released":
        _arity(f, 2, script, status)
        return _int(f[0], script, "lease_version"), _int(f[1], script, "now_ms")
    if status == "lease_lost":
        lease_refused(status, f, script, owner=owner, lease_version=lease_version, subject=subject)
    if status == "no_run":
        _arity(f, 0, script, status)
        missing()
    _unknown(status, script)


def _no_run(run_id: str) -> Callable[[], NoReturn]:
    def missing() -> NoReturn:
        raise RunNotFoundError("no run with this id", run_id=run_id)

    return missing


def decode_renew(reply: object, lease: Lease) -> Lease:
    """Decode renew_lease. Raises LeaseLostError, RunNotFoundError, StoreProtocolError."""
    expires, now = decode_renewal(
        reply,
        owner=lease.owner,
        lease_version=lease.lease_version,
        subject={"run_id": lease.run_id},
        missing=_no_run(lease.run_id),
    )
    return Lease(
        run_id=lease.run_id,
        owner=lease.owner,
        lease_version=lease.lease_version,
        expires_at_ms=expires,
        now_ms=now,
    )


def decode_release(reply: object, lease: Lease) -> Released:
    """Decode release_lease. Raises LeaseLostError, RunNotFoundError, StoreProtocolError."""
    version, now = decode_release_of(
        reply,
        owner=lease.owner,
        lease_version=lease.lease_version,
        subject={"run_id": lease.run_id},
        missing=_no_run(lease.run_id),
    )
    return Released(lease.run_id, version, now)


def batch_entries(reply: object, sent: int) -> list[object]:
    """The commit script's reply for a batch of ``sent`` commits: one entry per commit
    examined, at least one and at most ``sent`` (each is decoded by :func:`decode_commit`).

    Raises StoreProtocolError for any other shape.
    """
    if not isinstance(reply, list) or not reply or len(reply) > sent:
        _fail("reply is not a list of one entry per commit", "commit", sent=sent)
    return list(reply)


def decode_phase_move(entries: list[object], run_id: str) -> PhaseMove | None:
    """Take the commit script's trailing ``{"phase", old, new, now_ms}`` entry off
    ``entries`` (a list from :func:`batch_entries`) and decode it; None when the batch did
    not change the run's phase. Raises StoreProtocolError for a malformed one."""
    last = entries[-1] if entries else None
    if not isinstance(last, list) or not last or last[0] not in (b"phase", "phase"):
        return None
    entries.pop()
    script = "commit"
    _status, f = _split(last, script)
    _arity(f, 3, script, "phase")
    return PhaseMove(
        run_id,
        _text(f[0], script, "old_phase"),
        _text(f[1], script, "phase"),
        _int(f[2], script, "now_ms"),
    )


def decode_commit(
    reply: object, lease: Lease, *, commit_id: str, generation: int, expected_state_version: int
) -> CommitResult:
    """Decode commit.

    Raises LeaseLostError, GenerationMismatchError, StaleStateError, NonceReplayError,
    ApprovalWindowClosedError, RunNotFoundError, StoreProtocolError, and ContractError for a
    commit id reused with another checkpoint.
    """
    script = "commit"
    status, f = _split(reply, script)
    ids = {"run_id": lease.run_id, "commit_id": commit_id}
    if status == "committed":
        _arity(f, 4, script, status)
        new_generation = _int(f[0], script, "generation")
        if new_generation != generation:
            _fail("committed a generation other than the one sent", script, **ids)
        return CommitResult(
            lease.run_id,
            commit_id,
            new_generation,
            _int(f[1], script, "state_version"),
            current_generation=new_generation,
            already_applied=False,
        )
    if status == "already_applied":
        _arity(f, 3, script, status)
        return CommitResult(
            lease.run_id,
            commit_id,
            _int(f[0], script, "generation"),
            _int(f[2], script, "state_version"),
            current_generation=_int(f[1], script, "current_generation"),
            already_applied=True,
        )
    if status in ("lease_lost", "lease_expired"):
        _lease_lost(f, script, lease, status)
    if status == "generation_mismatch":
        _arity(f, 2, script, status)
        high_water = _int(f[0], script, "generation")
        raise GenerationMismatchError(
            "the checkpoint's generation is not high-water + 1",
            **ids,
            generation=generation,
            expected_generation=generation - 1,
            high_water=high_water,
            state_version=_int(f[1], script, "state_version"),
        )
    if status == "stale_state":
        _arity(f, 2, script, status)
        raise StaleStateError(
            "the expected state version is not current",
            **ids,
            expected_state_version=expected_state_version,
            high_water=_int(f[0], script, "generation"),
            state_version=_int(f[1], script, "state_version"),
        )
    if status == "nonce_replayed":
        _arity(f, 1, script, status)
        raise NonceReplayError(
            "a nonce was already consumed by this run", **ids, nonce=_text(f[0], script, "nonce")
        )
    if status == "approval_expired":
        _arity(f, 3, script, status)
        raise ApprovalWindowClosedError(
            "the approval of the commit's pending write expired by Redis' clock",
            **ids,
            generation=_int(f[0], script, "generation"),
            not_after_ms=_int(f[1], script, "not_after_ms"),
            now_ms=_int(f[2], script, "now_ms"),
        )
    if status == "commit_id_conflict":
        _arity(f, 1, script, status)
        raise ContractError(
            "commit id was used before for a different checkpoint",
            field="commit_id",
            **ids,
            generation=_int(f[0], script, "generation"),
        )
    if status == "no_run":
        _arity(f, 0, script, status)
        raise RunNotFoundError("no run with this id", run_id=lease.run_id)
    if status == "bad_batch":
        _fail("the commit script refused the batch's layout", script, **ids)
    _unknown(status, script)


def decode_read(
    reply: object, run_id: str, *, with_checkpoint: bool, with_scenario: bool, tail: int = 0
) -> RunSnapshot:
    """Decode read_run. Raises RunNotFoundError, StoreProtocolError."""
    script = "read_run"
    status, f = _split(reply, script)
    if status == "no_run":
        _arity(f, 0, script, status)
        raise RunNotFoundError("no run with this id", run_id=run_id)
    if status != "run":
        _unknown(status, script)
    _arity(f, 14, script, status)
    checkpoint = _blob(f[9], script, "checkpoint") if with_checkpoint else None
    scenario = _blob(f[10], script, "scenario") if with_scenario else None
    archive: tuple[bytes, ...] = ()
    if with_checkpoint:
        if not isinstance(f[11], list):
            _fail("archive is not a list", script, run_id=run_id)
        archive = tuple(_blob(segment, script, "archive") for segment in f[11])
    elif f[11] != 0:
        _fail("unrequested archive in reply", script, run_id=run_id)
    archive_from = _int(f[12], script, "archive_from")
    keys: bytes | None = None
    if with_checkpoint and tail > 0:
        keys = f[13] if f[13] == b"" else _blob(f[13], script, "keys")
        if len(archive) > tail:
            _fail("more archive segments than asked for", script, run_id=run_id)
    elif f[13] != 0 or archive_from != 0:
        _fail("unrequested key digests in reply", script, run_id=run_id)
    if not with_checkpoint and f[9] != 0:
        _fail("unrequested checkpoint in reply", script, run_id=run_id)
    if not with_scenario and f[10] != 0:
        _fail("unrequested scenario in reply", script, run_id=run_id)
    owner = _text(f[5], script, "owner")
    return RunSnapshot(
        run_id=run_id,
        task_id=_text(f[0], script, "task_id"),
        env_instance_id=_text(f[1], script, "env_instance_id"),
        generation=_int(f[2], script, "generation"),
        state_version=_int(f[3], script, "state_version"),
        created_at_ms=_int(f[4], script, "created_at_ms"),
        owner=owner or None,
        lease_version=_int(f[6], script, "lease_version"),
        expires_at_ms=_int(f[7], script, "expires_at_ms"),
        now_ms=_int(f[8], script, "now_ms"),
        checkpoint=checkpoint,
        scenario=scenario,
        archive=archive,
        archive_from=archive_from,
        keys=keys,
    )


def decode_claim_reap(reply: object, run_id: str) -> ReapClaim:
    """Decode claim_reap. Raises StoreProtocolError for anything unexpected."""
    script = "claim_reap"
    status, f = _split(reply, script)
    if status == "claimed":
        _arity(f, 2, script, status)
        return ReapClaim(
            run_id, True, status, _int(f[0], script, "lease_version"), _int(f[1], script, "now_ms")
        )
    if status == "live":
        _arity(f, 4, script, status)
        return ReapClaim(
            run_id, False, status, _int(f[1], script, "lease_version"), _int(f[3], script, "now_ms")
        )
    if status == "already":
        _arity(f, 3, script, status)
        return ReapClaim(
            run_id, False, status, _int(f[0], script, "lease_version"), _int(f[2], script, "now_ms")
        )
    if status == "no_run":
        _arity(f, 0, script, status)
        return ReapClaim(run_id, False, status, 0, 0)
    _unknown(status, script)


def decode_drop_expiry(reply: object) -> bool:
    """Decode drop_expiry_entry: True when the entry was removed."""
    script = "drop_expiry_entry"
    status, f = _split(reply, script)
    if status == "dropped":
        _arity(f, 0, script, status)
        return True
    if status == "kept":
        _arity(f, 1, script, status)
        return False
    if status == "absent":
        _arity(f, 0, script, status)
        return False
    _unknown(status, script)


def decode_replaced(reply: object, run_id: str) -> bool:
    """Decode replace_document's reply: True when replaced, False when the stored bytes
    changed meanwhile.

    Raises RunNotFoundError (``{"no_run"}``), StoreProtocolError.
    """
    script = "replace_document"
    status, f = _split(reply, script)
    _arity(f, 0, script, status)
    if status == "no_run":
        raise RunNotFoundError("no run with this id", run_id=run_id)
    if status in ("replaced", "changed"):
        return status == "replaced"
    _unknown(status, script)
    return False  # not reached: _unknown raises


def decode_counted(reply: object, run_id: str, *, script: str, ok: str) -> int:
    """Decode a ``{ok, n}`` reply (record_incident, post_evidence): the integer ``n``.

    Raises RunNotFoundError (``{"no_run"}``), StoreProtocolError.
    """
    status, f = _split(reply, script)
    if status == "no_run":
        _arity(f, 0, script, status)
        raise RunNotFoundError("no run with this id", run_id=run_id)
    if status != ok:
        _unknown(status, script)
    _arity(f, 1, script, status)
    return _int(f[0], script, "count")
