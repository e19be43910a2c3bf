"""In-memory stand-ins for the ports: a workspace adapter, a generation store, a clock.

These are trusted, same-process doubles for unit tests and examples, and they say so:
the store is not durable and the workspace is a dict. They keep the same contracts as the
real implementations (fences, authoritative receipts, idempotency, compare-and-set), and
expose a few knobs that tests use to play the outside world going wrong (a deleted or
drifted receipt, an edit that bypasses the runtime, a lost commit reply).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ratchet.errors import (
    AdapterError,
    CommitOutcomeUnknownError,
    ContractError,
    FenceRejectedError,
    GenerationMismatchError,
    HighWaterUnavailableError,
    IdempotencyConflictError,
    LeaseLostError,
    NonceReplayError,
)
from ratchet.runtime.actions import Action, ActionKind
from ratchet.runtime.canonical import Domain, digest
from ratchet.runtime.effects import Effect, Execute, Hooks, Observe
from ratchet.runtime.ports import (
    Advance,
    Fence,
    Observation,
    ReadResult,
    Receipt,
    Release,
    RunKey,
    StoredCheckpoint,
    VerifierReport,
)

__all__ = [
    "LeasedMemoryStore",
    "ManualClock",
    "MemoryGenerationStore",
    "MemoryWorkspace",
    "ObserveFailsAfterWrite",
    "files_fingerprint",
]


@dataclass
class ManualClock:
    """A clock tests move by hand."""

    current: int = 1_700_000_000

    def now(self) -> int:
        return self.current

    def advance(self, seconds: int) -> None:
        self.current += seconds


def files_fingerprint(files: Mapping[str, str]) -> str:
    return digest(Domain.ENVIRONMENT, {"files": dict(files)})


def _apply(files: Mapping[str, str], action: Action) -> dict[str, str] | None:
    """The files after ``action``, or None if it does not change files."""
    out = dict(files)
    if action.kind is ActionKind.WRITE_FILE:
        out[action.text("path")] = action.text("content")
    elif action.kind is ActionKind.DELETE_FILE:
        if action.text("path") not in out:
            return None
        del out[action.text("path")]
    else:
        return None
    return out


class MemoryWorkspace:
    """A workspace of text files with versions, fences and authoritative receipts."""

    def __init__(
        self,
        instance_id: str,
        files: Mapping[str, str],
        *,
        clock: ManualClock,
        expectations: Mapping[str, Mapping[str, str]] | None = None,
        namespace: str = "memory-workspace",
    ) -> None:
        self.instance_id = instance_id
        self.files: dict[str, str] = dict(files)
        self.version = 1
        self._namespace = namespace
        self._clock = clock
        self._expectations = {k: dict(v) for k, v in (expectations or {}).items()}
        self.receipts: dict[str, Receipt] = {}
        self.fences: dict[str, tuple[int, int]] = {}
        self.effects: list[tuple[str, str]] = []  # (idempotency key, intent digest)
        self.external_calls: list[dict[str, str]] = []
        self.refused_stale: int = 0
        self.store_epoch: str | None = None  # bound by the first fence that carries one

    @property
    def namespace(self) -> str:
        return self._namespace

    @property
    def write_count(self) -> int:
        return len(self.effects)

    def observe(self) -> Observation:
        return Observation(
            instance_id=self.instance_id,
            version=self.version,
            fingerprint=files_fingerprint(self.files),
        )

    def project(self, action: Action, before: Observation) -> Observation | None:
        if not before.same_state(self.observe()):
            return None
        if action.kind is ActionKind.EXTERNAL_CALL:
            after: dict[str, str] | None = self.files  # an effect outside the files
        else:
            after = _apply(self.files, action)
        if after is None:
            return None
        return Observation(
            instance_id=self.instance_id,
            version=self.version + 1,
            fingerprint=files_fingerprint(after),
        )

    def _check_fence(self, fence: Fence) -> None:
        if fence.store_epoch is not None:
            if self.store_epoch is None:
                self.store_epoch = fence.store_epoch
            elif self.store_epoch != fence.store_epoch:
                raise FenceRejectedError(
                    "this environment serves another store",
                    run_id=fence.run_id,
                    reason="store_epoch",
                    bound_epoch=self.store_epoch,
                    fence_epoch=fence.store_epoch,
                )
        seen = self.fences.get(fence.run_id)
        if seen is not None and fence.key() < seen:
            self.refused_stale += 1
            raise FenceRejectedError(
                "fence is older than one already seen",
                run_id=fence.run_id,
                fence=fence.key(),
                seen=seen,
            )
        self.fences[fence.run_id] = fence.key()

    def raise_fence(self, fence: Fence) -> None:
        self._check_fence(fence)

    def execute(
        self, action: Action, intent_digest: str, fence: Fence, approval_digest: str | None
    ) -> Receipt:
        self._check_fence(fence)
        key = action.idempotency_key
        if key is None:
            raise AdapterError("writes need an idempotency key")
        existing = self.receipts.get(key)
        if existing is not None:
            if existing.intent_digest != intent_digest:
                raise IdempotencyConflictError(
                    "key was used for another intent", idempotency_key=key, receipt=existing
                )
            return existing
        if action.expected_env_version != self.version:
            raise AdapterError(
                "environment precondition failed",
                retryable=False,
                expected=action.expected_env_version,
                actual=self.version,
            )
        result: dict[str, Any]
        if action.kind is ActionKind.EXTERNAL_CALL:
            self.external_calls.append({k: str(v) for k, v in action.args.items()})
            result = {"operation": action.text("operation"), "status": "ok"}
        else:
            after = _apply(self.files, action)
            if after is None:
                raise AdapterError(
                    "nothing to delete", retryable=False, path=action.args.get("path", "")
                )
            self.files = after
            result = {"path": action.text("path")}
        self.version += 1
        receipt = Receipt(
            namespace=self._namespace,
            receipt_version=1,
            receipt_id=f"rcpt-{len(self.receipts) + 1}",
            idempotency_key=key,
            intent_digest=intent_digest,
            result=result,
            committed_at=self._clock.now(),
            env_version_after=self.version,
            approval_digest=approval_digest,
        )
        self.receipts[key] = receipt
        self.effects.append((key, intent_digest))
        return receipt

    def lookup(self, idempotency_key: str) -> Receipt | None:
        return self.receipts.get(idempotency_key)

    def read(self, action: Action) -> ReadResult:
        path = action.text("path")
        if path not in self.files:
            raise AdapterError(f"no such file {path!r}", retryable=False, path=path)
        return ReadResult(content=self.files[path], env_version=self.version)

    def verify(self, target: str) -> VerifierReport:
        expected = self._expectations.get(target)
        if expected is None:
            raise AdapterError(f"unknown verifier target {target!r}", target=target)
        passed = all(self.files.get(p) == c for p, c in expected.items())
        obs = self.observe()
        return VerifierReport(
            target=target,
            passed=passed,
            env_instance_id=obs.instance_id,
            env_version=obs.version,
            env_fingerprint=obs.fingerprint,
            output_digest=digest(Domain.ENVIRONMENT, {"target": target, "passed": passed}),
        )

    # -- the outside world going wrong (tests) --------------------------------------------

    def external_edit(self, path: str, content: str) -> None:
        """Someone edits a file bypassing the runtime: a new version, no receipt."""
        self.files[path] = content
        self.version += 1

    def delete_receipt(self, key: str) -> None:
        del self.receipts[key]

    def replace_receipt(self, key: str, **changes: Any) -> Receipt:
        """Change fields of a stored receipt (drift)."""
        receipt = self.receipts[key].model_copy(update=changes)
        self.receipts[key] = receipt
        return receipt

    def plant_receipt(self, receipt: Receipt) -> None:
        """Another caller already used a key (for conflicts)."""
        self.receipts[receipt.idempotency_key] = receipt


@dataclass
class MemoryGenerationStore:
    """High-water marks and checkpoints in a dict, with compare-and-set semantics."""

    checkpoints: dict[RunKey, StoredCheckpoint] = field(default_factory=dict)
    nonces: dict[str, str] = field(default_factory=dict)  # nonce -> run id
    leases: dict[str, int] = field(default_factory=dict)  # run id -> newest lease version
    available: bool = True
    lose_next_reply: bool = False
    commits: int = 0

    def high_water(self, key: RunKey) -> int:
        return self.load(key).generation

    def load(self, key: RunKey) -> StoredCheckpoint:
        if not self.available:
            raise HighWaterUnavailableError("generation store unavailable", run_id=key.run_id)
        stored = self.checkpoints.get(key)
        if stored is None:
            raise HighWaterUnavailableError("no high-water mark for this run", run_id=key.run_id)
        return stored

    def commit_batch(
        self, key: RunKey, batch: Sequence[Advance], *, release: Release | None = None
    ) -> None:
        if release is not None:
            raise ContractError("this store holds no lease to release", field="release")
        for commit in batch:
            self._commit(
                key,
                commit.expected_generation,
                commit.blob,
                commit.nonces,
                commit.segment,
                commit.keys,
            )

    def _commit(
        self,
        key: RunKey,
        expected_generation: int,
        blob: bytes,
        nonces: Sequence[str],
        segment: bytes,
        keys: bytes = b"",
    ) -> None:
        if not self.available:
            raise HighWaterUnavailableError("generation store unavailable", run_id=key.run_id)
        current = self.checkpoints.get(key)
        high = current.generation if current is not None else 0
        if expected_generation != high:
            raise GenerationMismatchError(
                "expected generation is not the high-water mark",
                run_id=key.run_id,
                expected=expected_generation,
                high_water=high,
            )
        for nonce in nonces:
            if nonce in self.nonces:
                raise NonceReplayError(
                    "nonce already consumed", nonce=nonce, run_id=self.nonces[nonce]
                )
        for nonce in nonces:
            self.nonces[nonce] = key.run_id
        archive = current.archive if current is not None else ()
        if segment:
            archive = (*archive, bytes(segment))
        digests = (current.keys or b"") if current is not None else b""
        self.checkpoints[key] = StoredCheckpoint(
            high + 1, bytes(blob), archive, digests + bytes(keys)
        )
        self.commits += 1
        if self.lose_next_reply:
            self.lose_next_reply = False
            raise CommitOutcomeUnknownError(
                "reply lost after the commit was applied", run_id=key.run_id
            )

    def roll_back_to(self, key: RunKey, stored: StoredCheckpoint) -> None:
        """Simulate a restored backup (tests): the high-water mark moves back."""
        self.checkpoints[key] = stored

    def leased(self, lease_version: int) -> LeasedMemoryStore:
        """A view that commits under ``lease_version``, as a lease-holding worker does."""
        return LeasedMemoryStore(self, lease_version)


@dataclass
class LeasedMemoryStore:
    """A worker's view of a :class:`MemoryGenerationStore` under one lease version.

    Taking a newer lease (any commit under it) makes every older lease's commit fail with
    LeaseLostError, as the Redis store's fenced commit does.
    """

    store: MemoryGenerationStore
    lease_version: int

    def high_water(self, key: RunKey) -> int:
        return self.store.high_water(key)

    def load(self, key: RunKey) -> StoredCheckpoint:
        return self.store.load(key)

    def claim(self, run_id: str) -> None:
        """Take the run's lease: older lease versions can no longer commit."""
        newest = self.store.leases.get(run_id, 0)
        if self.lease_version < newest:
            raise LeaseLostError(
                "a newer lease exists",
                run_id=run_id,
                lease_version=self.lease_version,
                newest=newest,
            )
        self.store.leases[run_id] = self.lease_version

    def commit_batch(
        self, key: RunKey, batch: Sequence[Advance], *, release: Release | None = None
    ) -> None:
        """``release`` changes nothing here: a newer lease version fences this one
        whether or not it was given up."""
        self.claim(key.run_id)
        self.store.commit_batch(key, batch)


class ObserveFailsAfterWrite(Hooks):
    """Executor hooks under which the first observation after a write fails (tests).

    Plays an environment that becomes unobservable right after the adapter committed a
    write (the adapter's host went away): the engine then commits the receipt alone and
    the state advances on recovery (``CrashWindow.AFTER_RECEIPT_BEFORE_STATE``). Other
    effects go to ``inner`` (or are performed) as they are.
    """

    def __init__(self, inner: Hooks | None = None) -> None:
        self._inner = inner
        self._armed = False

    def around(self, effect: Effect, proceed: Callable[[], Any]) -> Any:
        if isinstance(effect, Observe) and self._armed:
            self._armed = False
            raise AdapterError("environment unreachable right after the write", retryable=True)
        result = proceed() if self._inner is None else self._inner.around(effect, proceed)
        if isinstance(effect, Execute):
            self._armed = True
        return result
