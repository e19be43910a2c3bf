"""The ports through which the runtime reaches the outside, and the facts they return.

The runtime core performs no I/O. Everything it learns about the world arrives through
three interfaces passed in by the caller:

* :class:`Adapter`: the environment where side effects happen. It is authoritative for
  what it did: its receipts are the evidence, the runtime's cache is only a copy.
* :class:`GenerationStore`: the external, monotonic high-water mark of checkpoint
  generations, persisted atomically with the checkpoint itself.
* :class:`Clock`: wall-clock seconds, used only for budgets and approval expiry.

The in-memory implementations in :mod:`ratchet.testing.memory` are trusted stand-ins for
unit tests; the Redis store and the real adapters live in other layers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Annotated, Any, Protocol, runtime_checkable

from pydantic import Field, Strict

from ratchet.runtime.actions import Action
from ratchet.runtime.canonical import Domain, model_digest
from ratchet.runtime.types import Digest, Frozen, Identifier, NonNegInt, StrictBool, Text

__all__ = [
    "Adapter",
    "Advance",
    "Clock",
    "Fence",
    "GenerationStore",
    "Observation",
    "ReadResult",
    "Receipt",
    "Release",
    "RunKey",
    "StoredCheckpoint",
    "VerifierReport",
]

_ResultValue = Annotated[str, Strict(), Field(max_length=1 << 16)] | Annotated[int, Strict()]


class Observation(Frozen):
    """What an adapter reports about its environment right now.

    ``instance_id`` names this environment for good (a different instance with the same
    content is a different environment); ``version`` is the adapter's own revision or
    etag counter; ``fingerprint`` digests the state that matters (allowed files, HEAD,
    account identity); ``details`` are further facts that must be re-checked after
    recovery (base commit, dirty flag), already included in the fingerprint.
    """

    instance_id: Identifier
    version: NonNegInt
    fingerprint: Digest
    details: dict[Annotated[str, Strict()], Annotated[str, Strict()]] = Field(default_factory=dict)

    def same_state(self, other: Observation) -> bool:
        return (
            self.instance_id == other.instance_id
            and self.version == other.version
            and self.fingerprint == other.fingerprint
        )


class Fence(Frozen):
    """The fencing token sent with every adapter write: who writes, under which lease.

    Adapters that support fencing refuse a fence whose ``(lease_version, state_version)``
    is lower than the highest they have seen for the run. ``state_version`` is the
    checkpoint generation the holder stands at: every fence is built from the generation
    (it moves in lockstep with the store's state version; docs/architecture.md says why
    both exist).
    """

    run_id: Identifier
    lease_version: NonNegInt
    state_version: NonNegInt
    # The epoch of the store the lease is in (None: the caller has none). An adapter that
    # checks fences binds itself to the first epoch it sees and refuses any other: a run
    # recreated on a wiped or re-initialised store cannot write to an environment the old
    # store's runs used, and a store that came back as another one is a witness, too.
    store_epoch: Identifier | None = None

    def key(self) -> tuple[int, int]:
        return (self.lease_version, self.state_version)


class Receipt(Frozen):
    """The adapter's authoritative record of one executed write.

    ``approval_digest`` is present where the adapter checked an approval; ``committed_at``
    is the adapter's own commit time in wall-clock seconds; ``env_version_after`` is the
    environment version the write produced.
    """

    namespace: Identifier
    receipt_version: NonNegInt
    receipt_id: Identifier
    idempotency_key: Identifier
    intent_digest: Digest
    result: dict[Annotated[str, Strict()], _ResultValue]
    committed_at: NonNegInt
    env_version_after: NonNegInt
    approval_digest: Digest | None = None

    @cached_property
    def fingerprint(self) -> str:
        """Digest over every field: two receipts with equal fingerprints are the same.
        Computed once per (frozen) receipt; a copy computes its own (see model_copy)."""
        return model_digest(Domain.RECEIPT, self)

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Receipt:
        """pydantic copies the instance dict, cached fingerprint included; a changed copy
        must not inherit it, so every copy computes its own."""
        copied = super().model_copy(update=update, deep=deep)
        copied.__dict__.pop("fingerprint", None)
        return copied


class ReadResult(Frozen):
    """What a read-only action returned."""

    content: Text
    env_version: NonNegInt


class VerifierReport(Frozen):
    """A verifier run, bound to the environment it ran against."""

    target: Identifier
    passed: StrictBool
    env_instance_id: Identifier
    env_version: NonNegInt
    env_fingerprint: Digest
    output_digest: Digest


@runtime_checkable
class Adapter(Protocol):
    """An environment whose writes are fenced and receipted. See :mod:`ratchet.adapters`."""

    @property
    def namespace(self) -> str: ...

    def observe(self) -> Observation:
        """Return the current observation. Raises AdapterError."""

    def project(self, action: Action, before: Observation) -> Observation | None:
        """Predict the one-commit state ``action`` would produce from ``before``, if known."""

    def raise_fence(self, fence: Fence) -> None:
        """Record a new owner's fence without writing. Raises FenceRejectedError."""

    def execute(
        self, action: Action, intent_digest: str, fence: Fence, approval_digest: str | None
    ) -> Receipt:
        """Perform one write under ``action.idempotency_key`` or refuse.

        Same key and same intent returns the existing receipt without a second effect;
        same key and different intent raises IdempotencyConflictError carrying it.
        Raises FenceRejectedError, AdapterError.
        """

    def lookup(self, idempotency_key: str) -> Receipt | None:
        """Return the authoritative receipt for a key, or None."""

    def read(self, action: Action) -> ReadResult:
        """Perform a read-only action."""

    def verify(self, target: str) -> VerifierReport:
        """Run the allow-listed verifier ``target`` against the current state."""


@dataclass(frozen=True, slots=True)
class RunKey:
    """What a high-water mark is kept for: (task, run, environment instance)."""

    task_id: str
    run_id: str
    env_instance_id: str


@dataclass(frozen=True, slots=True)
class StoredCheckpoint:
    """The checkpoint at the high-water mark, and the run's archive segments (oldest
    first; empty for a checkpoint that carries its whole trace)."""

    generation: int
    blob: bytes
    archive: tuple[bytes, ...] = ()
    # The run's executed-key digests (ratchet.runtime.window), None from a store that
    # does not keep them (a restore then makes them from the whole archive).
    keys: bytes | None = None


@dataclass(frozen=True, slots=True)
class Advance:
    """One commit of a batch: ``blob`` as generation ``expected_generation + 1``."""

    expected_generation: int
    blob: bytes
    nonces: tuple[str, ...] = ()
    segment: bytes = b""  # appended to the run's archive with the commit (b"": nothing)
    # Store time (ms) after which the store must refuse this commit (0: never): the
    # expiry of the approval its pending write carries. Stores with a clock of their own
    # (Redis) check it; see RunEngine._commit.
    not_after_ms: int = 0
    # The phase the checkpoint is in ("": not stated). Unsigned metadata a store may keep
    # beside the checkpoint to list runs by phase; the signed state stays authoritative.
    phase: str = ""
    # The 8-byte digests of the keys of the executed writes the commit adds, appended
    # beside the archive with it (see ratchet.runtime.window); b"": none.
    keys: bytes = b""


@dataclass(frozen=True, slots=True)
class Release:
    """A lease given up with a commit: in the same store call, once every commit of the
    batch applied (a refused commit releases nothing). ``reap``: the run is handed on at
    once (work remains) rather than taken off the reaper's index."""

    reap: bool = False


@runtime_checkable
class GenerationStore(Protocol):
    """An external, durable, compare-and-set store of checkpoints and high-water marks.

    Persisting the checkpoint and advancing the high-water mark are one atomic step.
    """

    def high_water(self, key: RunKey) -> int:
        """The current high-water generation. Raises HighWaterUnavailableError."""

    def load(self, key: RunKey) -> StoredCheckpoint:
        """The checkpoint at the high-water mark. Raises HighWaterUnavailableError."""

    def commit_batch(
        self, key: RunKey, batch: Sequence[Advance], *, release: Release | None = None
    ) -> None:
        """Apply ``batch`` in order, each commit its own fenced, atomic step: store the
        blob as generation ``expected_generation + 1``, consume its nonces and append its
        segment (when not empty) to the run's archive. As few round trips as the store
        allows (one for Redis: one AOF fsync covers the batch).

        Each commit's expected generation is the one before it plus one;
        ``expected_generation == 0`` creates the run. The first commit refused stops the
        batch and its error is raised; a later commit never applies without every earlier
        one (its expected generation would not be the high-water mark). An empty batch is
        a no-op.

        ``release`` (stores that fence by lease): give the caller's lease up in the same
        step, once every commit applied; a store without leases refuses it
        (ContractError).

        Raises GenerationMismatchError, NonceReplayError, CommitOutcomeUnknownError
        (re-read before acting), and lease errors for stores that fence by lease.
        """


class Clock(Protocol):
    def now(self) -> int:
        """Wall-clock seconds since the epoch."""
