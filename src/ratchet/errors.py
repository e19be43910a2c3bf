"""The exception tree of ratchet, drawn once.

Every error ratchet raises derives from :class:`RatchetError`. Their messages never
contain key material.

The fields a caller decides on are typed attributes, declared by the class that has them
(``AdapterError.retryable``, ``reason``, ``field``, ``HighWaterUnavailableError.cause``,
...), so a type checker sees a misspelt or missing one. Everything an error was raised
with, typed or not, is also kept in ``context`` (the ids and versions of the run, the
lease, the fence), which logs and incident records carry whole; ``context`` holds only
what was given, so a record of an error stays the same size it was.

::

    RatchetError
    ├── ConfigurationError                 settings, keys or trust roots are missing or bad
    ├── ContractError                      a caller broke the contract (bad input)
    │   ├── ScenarioError                  a task contract failed strict loading
    │   ├── ActionError                    an action is malformed (kinds, args, keys)
    │   ├── InvalidTransitionError         an event is not legal in the current phase
    │   └── ConformanceError               an adapter broke the adapter contract (a check failed)
    ├── IntegrityError                     stored or supplied evidence cannot be trusted
    │   ├── CheckpointError                a checkpoint failed restore (``reason`` says which check)
    │   │   └── CheckpointTooLargeError    a checkpoint exceeds the configured cap
    │   ├── InvariantViolation             a state breaks a cross-object invariant
    │   ├── EvidenceError                  an approval or review decision does not verify
    │   │   ├── ApprovalError
    │   │   └── ReviewDecisionError
    │   └── EnvironmentMismatchError       the observed environment is not the expected one
    ├── StoreError                         the generation / lease store refused or failed
    │   ├── HighWaterUnavailableError      no external high-water mark: fail closed
    │   ├── GenerationMismatchError        expected generation is not the high-water mark
    │   ├── CommitOutcomeUnknownError      a commit's reply was lost; re-read before acting
    │   │   └── ReplicationUnconfirmedError  applied on the primary, too few replicas confirmed it
    │   ├── LeaseHeldElsewhereError        another live worker holds the lease
    │   ├── LeaseLostError                 the caller's lease expired or was taken over
    │   ├── StaleStateError                expected state version is not current
    │   ├── NonceReplayError               an approval or review nonce was already consumed
    │   ├── ApprovalWindowClosedError      the commit's approval expired by the store's clock
    │   ├── RunExistsError / RunNotFoundError
    │   ├── StoreProtocolError             a reply was malformed or had an unknown status
    │   ├── StoreFullError                 Redis refuses writes: out of memory, or its AOF fails
    │   ├── StoreEpochError                the store lost or changed its epoch: not the same store
    │   └── StoreUnavailableError          the store could not be reached; outcome unknown
    └── AdapterError                       an adapter refused or failed (``retryable``)
        ├── FenceRejectedError             the adapter has seen a newer fence
        ├── IdempotencyConflictError       same key, different intent (carries the receipt)
        ├── UntrustedGroundError           a workspace path is not a regular file, or too big
        └── PeerAnswerTooLargeError        a peer's answer went past the byte cap; reading stopped
    OutcomeUnknownError (under RatchetError) a cut-off tool call may or may not have happened
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ActionError",
    "AdapterError",
    "ApprovalError",
    "ApprovalWindowClosedError",
    "CheckpointError",
    "CheckpointTooLargeError",
    "CommitOutcomeUnknownError",
    "ConfigurationError",
    "ConformanceError",
    "ContractError",
    "EnvironmentMismatchError",
    "EvidenceError",
    "FenceRejectedError",
    "GenerationMismatchError",
    "HighWaterUnavailableError",
    "IdempotencyConflictError",
    "IntegrityError",
    "InvalidTransitionError",
    "InvariantViolation",
    "LeaseHeldElsewhereError",
    "LeaseLostError",
    "NonceReplayError",
    "OutcomeUnknownError",
    "PeerAnswerTooLargeError",
    "RatchetError",
    "ReplicationUnconfirmedError",
    "ReviewDecisionError",
    "RunExistsError",
    "RunNotFoundError",
    "ScenarioError",
    "StaleStateError",
    "StoreEpochError",
    "StoreError",
    "StoreFullError",
    "StoreProtocolError",
    "StoreUnavailableError",
    "UntrustedGroundError",
]


def _given(context: dict[str, Any], **typed: Any) -> dict[str, Any]:
    """``context`` with the typed fields that were given (not None) added: what an error's
    ``context`` holds is what its raiser said, no more."""
    return {**context, **{name: value for name, value in typed.items() if value is not None}}


class RatchetError(Exception):
    """Root of every error ratchet raises.

    Keyword arguments are kept in ``context`` and become attributes of their names
    (``err.run_id``, ``err.lease_version``) so callers act on data, not on message text;
    the subclasses declare, with their types, the ones callers decide on.
    """

    def __init__(self, message: str, **context: Any) -> None:
        super().__init__(message)
        self.message = message
        self.context = dict(context)
        for name, value in context.items():
            setattr(self, name, value)

    def __repr__(self) -> str:
        fields = "".join(f", {k}={v!r}" for k, v in self.context.items())
        return f"{type(self).__name__}({self.message!r}{fields})"


class ConfigurationError(RatchetError):
    """Settings, keys or trust roots are missing or malformed. ``field`` names the setting
    or the file's field when known (the command line shows it beside the message)."""

    field: str | None

    def __init__(self, message: str, *, field: str | None = None, **context: Any) -> None:
        super().__init__(message, **_given(context, field=field))
        self.field = field


class ContractError(RatchetError):
    """The caller broke the contract. ``field`` names the offending field when known."""

    field: str | None

    def __init__(self, message: str, *, field: str | None = None, **context: Any) -> None:
        super().__init__(message, **_given(context, field=field))
        self.field = field


class ScenarioError(ContractError):
    """A task contract (scenario) failed strict loading or validation."""


class ActionError(ContractError):
    """An action is malformed: unknown kind, wrong argument set, key rules broken."""


class InvalidTransitionError(ContractError):
    """An event is not legal in the run's current phase (see the transition table)."""


class IntegrityError(RatchetError):
    """Stored or supplied evidence cannot be trusted. Always fail closed on it.

    ``reason`` names the check that failed (a short code: ``bad_mac``, ``unknown_signer``,
    ``document``, ...) and ``field`` the field it failed on, when known.
    """

    reason: str | None
    field: str | None

    def __init__(
        self,
        message: str,
        *,
        reason: str | None = None,
        field: str | None = None,
        **context: Any,
    ) -> None:
        super().__init__(message, **_given(context, reason=reason, field=field))
        self.reason = reason
        self.field = field


class CheckpointError(IntegrityError):
    """A checkpoint failed to restore. ``reason`` names the check that failed."""


class CheckpointTooLargeError(CheckpointError):
    """A checkpoint exceeds the configured size cap and was not sent to the store."""


class InvariantViolation(IntegrityError):  # noqa: N818 - the name reads as what it is
    """A run state breaks a cross-object invariant; nothing was committed."""


class EvidenceError(IntegrityError):
    """An approval or review decision failed verification. ``reason`` says why."""


class ApprovalError(EvidenceError):
    """An approval is unknown, forged, mis-bound, replayed or expired."""


class ReviewDecisionError(EvidenceError):
    """A reviewer decision was refused; the review case stays frozen."""


class EnvironmentMismatchError(IntegrityError):
    """The observed environment is neither the recorded state nor its one-commit successor."""


class StoreError(RatchetError):
    """The generation or lease store refused a request or failed. ``reason`` is a short
    code for why, when the refusal has several (``oom``, ``key_mismatch``, ...)."""

    reason: str | None

    def __init__(self, message: str, *, reason: str | None = None, **context: Any) -> None:
        super().__init__(message, **_given(context, reason=reason))
        self.reason = reason


class HighWaterUnavailableError(StoreError):
    """No external high-water mark could be read: restore fails closed.

    ``cause`` is the class name of the failure it stands for (``StoreUnavailableError``:
    the store could not be reached; ``RunNotFoundError``), for logs and records; that
    failure itself is the exception's ``__cause__``, which decisions test with
    ``isinstance``.
    """

    cause: str | None

    def __init__(self, message: str, *, cause: str | None = None, **context: Any) -> None:
        super().__init__(message, **_given(context, cause=cause))
        self.cause = cause


class GenerationMismatchError(StoreError):
    """A commit or restore named a generation other than the high-water mark."""


class CommitOutcomeUnknownError(StoreError):
    """A commit was sent but its reply was lost: the store must be re-read."""


class ReplicationUnconfirmedError(CommitOutcomeUnknownError):
    """The primary applied the write, but fewer replicas than ``RATCHET_MIN_REPLICAS_ACK``
    confirmed it in time (``replicas_acked``, ``replicas_required``): it is not
    acknowledged. Re-reading the primary cannot settle that, so nothing may act on the
    strength of it; a failover may still lose it."""


class LeaseHeldElsewhereError(StoreError):
    """Another live worker holds the run's lease (``owner``, ``expires_at_ms``)."""


class LeaseLostError(StoreError):
    """The caller's lease expired or was taken over; stop before any further effect."""

    # LangGraph's write-ownership convention recognises a refused stale writer by this
    # class attribute (duck-typed, so no LangGraph import is needed here).
    is_stale_write_owner_error = True


class StaleStateError(StoreError):
    """The expected state version is no longer current."""


class NonceReplayError(StoreError):
    """An approval or review nonce has already been consumed."""


class ApprovalWindowClosedError(StoreError):
    """The store refused a commit whose pending write's approval had expired by the
    store's own clock (the commit script checks it): nothing was committed or sent."""


class RunExistsError(StoreError):
    """A run with this id already exists."""


class RunNotFoundError(StoreError):
    """No run with this id exists."""


class StoreProtocolError(StoreError):
    """A store reply was malformed or carried an unknown status; nothing is guessed."""


class StoreFullError(StoreError):
    """Redis refused a write: ``maxmemory`` reached under ``noeviction`` (``reason="oom"``)
    or its persistence is failing, e.g. a full disk for the AOF (``reason="misconf"``).
    Nothing new is accepted until an operator frees memory or disk; reads still work."""


class StoreEpochError(StoreError):
    """The store has no epoch record, or another one than this process started with: it
    was wiped, restarted without its AOF, evicted keys, or is another store. Nothing is
    run on it (``ratchet store init`` starts a new store's epoch, deliberately)."""


class StoreUnavailableError(StoreError):
    """The store could not be reached (connection refused, dropped or timed out).

    The call's outcome is unknown: a renewal must be treated as not renewed, a read as not
    read. Commits raise :class:`CommitOutcomeUnknownError` instead.
    """


class AdapterError(RatchetError):
    """An adapter refused or failed a call. ``retryable`` says whether a retry can help;
    ``reason`` is a short code for why, when the adapter gives one (``unresolved``,
    ``git``, ``too_large``, ...)."""

    retryable: bool
    reason: str | None

    def __init__(
        self, message: str, *, retryable: bool = False, reason: str | None = None, **context: Any
    ) -> None:
        super().__init__(message, retryable=retryable, **_given(context, reason=reason))
        self.retryable = retryable
        self.reason = reason


class FenceRejectedError(AdapterError):
    """The adapter has seen a newer fence for this run and refused the call."""


class IdempotencyConflictError(AdapterError):
    """The adapter holds a receipt for this key with a different intent digest.

    ``receipt`` is that receipt (a :class:`ratchet.runtime.Receipt`; typed ``object`` here
    because this module imports nothing of ratchet's), or None when the adapter cannot
    show it: the engine then looks the key up.
    """

    receipt: object | None

    def __init__(self, message: str, *, receipt: object | None = None, **context: Any) -> None:
        super().__init__(message, **_given(context, receipt=receipt))
        self.receipt = receipt


class UntrustedGroundError(AdapterError):
    """A path on untrusted ground (a workspace agent-written code could have touched) is
    not what ratchet reads: not a regular file (``file_type``: ``fifo``, ``socket``,
    ``char_device``, ``block_device``, ``directory``, ``symlink``), reached through a
    symbolic link, or larger than the cap (``reason="too_large"``). Never retryable: the
    path is refused without being opened (a FIFO would block, a device could act), and
    the run stops with the evidence."""

    file_type: str | None

    def __init__(self, message: str, *, file_type: str | None = None, **context: Any) -> None:
        context.pop("retryable", None)
        super().__init__(message, retryable=False, **_given(context, file_type=file_type))
        self.file_type = file_type


class PeerAnswerTooLargeError(AdapterError):
    """A network peer's answer (an MCP server's, a chat model's, an HTTP service's) went
    past the byte cap (``RATCHET_MAX_PEER_BYTES``, :mod:`ratchet.limits`) while it was
    read: reading stopped there and nothing of it was used. ``peer`` names the peer (no
    credential), ``limit_bytes`` is the cap, ``seen_bytes`` what had arrived when reading
    stopped; ``encoding`` is set instead when the answer was refused unread for being
    compressed. Never retryable: the peer would send the same again. A read is refused
    by it without effect; a write it cut off may have happened, so the tools adapter
    turns it into :class:`OutcomeUnknownError` (raised from this one)."""

    peer: str
    limit_bytes: int
    seen_bytes: int
    encoding: str | None

    def __init__(
        self,
        message: str,
        *,
        peer: str,
        limit_bytes: int,
        seen_bytes: int,
        encoding: str | None = None,
        **context: Any,
    ) -> None:
        context.pop("retryable", None)
        super().__init__(
            message,
            retryable=False,
            peer=peer,
            limit_bytes=limit_bytes,
            seen_bytes=seen_bytes,
            encoding=encoding,
            **context,
        )


class ConformanceError(ContractError):
    """An adapter broke the adapter contract: ``check`` names the conformance check."""


class OutcomeUnknownError(RatchetError):
    """An environment cannot say whether an interrupted write happened: a tool with no
    lookup that is not idempotent was cut off mid-call. Never retried on its own: the run
    waits in ``needs_review`` (reason ``outcome_unknown``) for a reviewer."""
