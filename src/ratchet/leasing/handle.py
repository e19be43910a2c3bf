"""A lease on one run, bound to the store: the runtime's ``GenerationStore`` on Redis.

:class:`LeasedRun` is what :meth:`RedisStore.acquire` returns. It implements
:class:`ratchet.runtime.ports.GenerationStore`, so the runtime's restore and commits go
through Redis:

* ``high_water(key)`` reads the authoritative generation and checks, in the same read,
  that ``key`` names this run (task, run, environment instance) and that this lease is
  still the live one. Restore compares the checkpoint's generation with it, so a
  correctly signed checkpoint of an older generation is refused.
* ``load(key)`` returns the checkpoint at the high-water mark, read in one step with the
  generation it belongs to.
* ``commit_batch(key, [Advance(g, blob, nonces), ...])`` is the fenced commit of
  generation ``g + 1`` (and the ones after it) under
  ``(owner, lease_version, state_version)``.
* ``commit_batch`` sends each commit's phase (``Advance.phase``) with it, so the store
  lists the run under the phase its checkpoint is in. The handle remembers the phase it
  last committed; a batch that stays in it sends none, so the script has nothing to move
  (only a batch that may change the phase carries the phase indexes).

``advance`` with ``expected_generation == 0`` is refused with
:class:`~ratchet.errors.RunExistsError`: a lease exists only for a run that
:meth:`RedisStore.create_run` created, together with its scenario and first checkpoint.
A submitter that starts runs through the port (``RunEngine.start``) uses
:class:`RunCreator` (``RedisStore.creator(scenario)``), whose ``advance`` with
``expected_generation == 0`` is exactly that create call.

The blob is opaque bytes here: the store never parses the signed envelope; the generation
travels beside it.
"""

from __future__ import annotations

import itertools
import os
import secrets
from collections.abc import Callable, Sequence
from typing import Protocol

from ratchet.errors import (
    CommitOutcomeUnknownError,
    ContractError,
    HighWaterUnavailableError,
    LeaseLostError,
    RunExistsError,
    RunNotFoundError,
    StoreProtocolError,
    StoreUnavailableError,
)
from ratchet.leasing.results import (
    Acquired,
    CommitResult,
    Lease,
    PreparedCommit,
    Released,
    RunCreated,
    RunSnapshot,
)
from ratchet.runtime.ports import Advance, Fence, Release, RunKey, StoredCheckpoint


class LeaseStore(Protocol):
    """What a lease handle asks of the store (:class:`ratchet.leasing.RedisStore` is one):
    the handle depends on these calls, not on the store's class, so the store can build
    handles without the two modules importing each other."""

    def create_run(
        self,
        run_id: str,
        *,
        task_id: str,
        env_instance_id: str,
        scenario: bytes,
        checkpoint: bytes,
        commit_id: str | None = None,
        archive_segment: bytes = b"",
        phase: str = "running",
    ) -> RunCreated: ...

    def read_run(
        self,
        run_id: str,
        *,
        with_checkpoint: bool = False,
        with_scenario: bool = False,
        archive_tail: int = 0,
    ) -> RunSnapshot: ...

    def renew(self, lease: Lease, *, ttl_ms: int) -> Lease: ...

    def release(self, lease: Lease, *, reap: bool = False) -> Released: ...

    def prepare_commit(
        self,
        run_id: str,
        *,
        generation: int,
        checkpoint: bytes,
        commit_id: str | None = None,
        nonces: Sequence[str] = (),
        segment: bytes = b"",
        not_after_ms: int = 0,
        phase: str = "",
        keys: bytes = b"",
    ) -> PreparedCommit: ...

    def commit_many(
        self,
        lease: Lease,
        commits: Sequence[PreparedCommit],
        *,
        expected_state_version: int,
        release: Release | None = None,
        applied: Callable[[CommitResult], None] | None = None,
    ) -> tuple[list[CommitResult], Released | None]: ...


class _CommitIds:
    """Commit ids: a random 96-bit prefix per process and a counter, so an id costs no
    system call (a fresh random draw per commit did) and stays unique: a forked child
    draws a new prefix."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.prefix = "c-" + secrets.token_hex(12) + "-"
        self.counter = itertools.count(1)

    def next(self) -> str:
        return f"{self.prefix}{next(self.counter):x}"


_IDS = _CommitIds()
os.register_at_fork(after_in_child=_IDS.reset)


def new_commit_id() -> str:
    """A fresh commit id, unique across processes and restarts (a random 96-bit
    per-process prefix and a counter)."""
    return _IDS.next()


__all__ = ["LeaseStore", "LeasedRun", "RunCreator", "new_commit_id"]


def _matching(snap: RunSnapshot, key: RunKey) -> RunSnapshot:
    """``snap`` if it is the run ``key`` names. Raises HighWaterUnavailableError."""
    if (key.task_id, key.env_instance_id) != (snap.task_id, snap.env_instance_id):
        raise HighWaterUnavailableError(
            "the key's task or environment instance is not this run's",
            run_id=key.run_id,
            reason="key_mismatch",
        )
    return snap


def _read_for(store: LeaseStore, key: RunKey, *, with_checkpoint: bool) -> RunSnapshot:
    """Read the run ``key`` names, for the generation-store port.

    Raises HighWaterUnavailableError (unreachable, unknown run, key mismatch),
    StoreProtocolError.
    """
    try:
        snap = store.read_run(key.run_id, with_checkpoint=with_checkpoint)
    except (RunNotFoundError, StoreUnavailableError) as exc:
        raise HighWaterUnavailableError(
            "no high-water mark could be read", run_id=key.run_id, cause=type(exc).__name__
        ) from exc
    return _matching(snap, key)


class LeasedRun:
    """The caller's lease on one run plus the versions it last saw.

    One thread commits; a heartbeat thread may call :meth:`renew` meanwhile (a renewal only
    swaps in a lease with the same owner and version and a later expiry).
    """

    def __init__(self, store: LeaseStore, acquired: Acquired, *, ttl_ms: int) -> None:
        self._store = store
        self._lease = acquired.lease
        self._ttl_ms = ttl_ms
        self._task_id = acquired.task_id
        self._env_instance_id = acquired.env_instance_id
        self._generation = acquired.generation
        self._state_version = acquired.state_version
        self._took_over = acquired.took_over
        self._previous = (acquired.previous_owner, acquired.previous_lease_version)
        self._primed: RunSnapshot | None = None  # see read()
        self._released: Released | None = None
        self._phase: str | None = None  # the phase last committed here (None: unknown)

    def __repr__(self) -> str:
        return (
            f"LeasedRun(run_id={self.run_id!r}, owner={self.owner!r}, "
            f"lease_version={self.lease_version}, generation={self._generation}, "
            f"state_version={self._state_version})"
        )

    @property
    def lease(self) -> Lease:
        return self._lease

    @property
    def run_id(self) -> str:
        return self._lease.run_id

    @property
    def owner(self) -> str:
        return self._lease.owner

    @property
    def lease_version(self) -> int:
        return self._lease.lease_version

    @property
    def generation(self) -> int:
        """The high-water generation as last seen through this handle."""
        return self._generation

    @property
    def state_version(self) -> int:
        """The state version as last seen through this handle."""
        return self._state_version

    @property
    def ttl_ms(self) -> int:
        return self._ttl_ms

    @property
    def took_over(self) -> bool:
        """Whether the acquire took the lease over from an owner whose lease had expired."""
        return self._took_over

    @property
    def previous(self) -> tuple[str, int]:
        """The lease this one replaced: ``(owner, lease_version)``; the owner is ``""``
        when the lease was free and the version 0 when the run had never been leased."""
        return self._previous

    @property
    def fence(self) -> Fence:
        """The fence for adapter writes: ``(run_id, lease_version, generation)``, built
        from the same counter as the engine's (see docs/architecture.md)."""
        return self._lease.fence(self._generation)

    # -- GenerationStore ---------------------------------------------------------------

    def read(
        self, *, with_checkpoint: bool = True, with_scenario: bool = False, archive_tail: int = 0
    ) -> RunSnapshot:
        """Read the run under this lease (one step): its checkpoint, archive (or with
        ``archive_tail`` its last segments and key digests: see ``RedisStore.read_run``)
        and, when asked, its scenario, with the high-water mark they belong to.

        The snapshot also answers this handle's next ``high_water`` or ``load`` (once, and
        only while nothing was committed through the handle since), so restoring the
        checkpoint just read costs no second read: both come from the same atomic read,
        taken while this lease was live.

        Raises RunNotFoundError, StoreUnavailableError, StoreProtocolError, LeaseLostError
        (the lease is no longer this handle's).
        """
        snap = self._store.read_run(
            self.run_id,
            with_checkpoint=with_checkpoint,
            with_scenario=with_scenario,
            archive_tail=archive_tail,
        )
        self._check_live(snap)
        self._generation, self._state_version = snap.generation, snap.state_version
        self._primed = snap
        return snap

    def _snapshot(self, key: RunKey, *, with_checkpoint: bool) -> RunSnapshot:
        if key.run_id != self.run_id:
            raise HighWaterUnavailableError(
                "the key names another run", run_id=self.run_id, requested_run_id=key.run_id
            )
        primed, self._primed = self._primed, None
        if (
            primed is not None
            and primed.generation == self._generation
            and (
                not with_checkpoint
                # a load hands out the whole archive
                or (primed.checkpoint is not None and primed.archive_from == 0)
            )
        ):
            snap = _matching(primed, key)
        else:
            snap = _read_for(self._store, key, with_checkpoint=with_checkpoint)
        self._check_live(snap)
        self._generation = snap.generation
        self._state_version = snap.state_version
        return snap

    def _check_live(self, snap: RunSnapshot) -> None:
        if not snap.is_held_by(self.owner, self.lease_version):
            raise LeaseLostError(
                "the lease is no longer held",
                run_id=self.run_id,
                owner=self.owner,
                lease_version=self.lease_version,
                current_owner=snap.owner,
                current_lease_version=snap.lease_version,
                expires_at_ms=snap.expires_at_ms,
                now_ms=snap.now_ms,
                reason="not_live",
            )

    def high_water(self, key: RunKey) -> int:
        """The authoritative high-water generation.

        Raises HighWaterUnavailableError (unreachable, unknown run, key mismatch),
        LeaseLostError, StoreProtocolError.
        """
        return self._snapshot(key, with_checkpoint=False).generation

    def load(self, key: RunKey) -> StoredCheckpoint:
        """The checkpoint at the high-water mark with its generation, read in one step.

        Raises HighWaterUnavailableError, LeaseLostError, StoreProtocolError.
        """
        snap = self._snapshot(key, with_checkpoint=True)
        if snap.checkpoint is None:
            raise StoreProtocolError("the run has no checkpoint", run_id=self.run_id)
        return StoredCheckpoint(
            generation=snap.generation, blob=snap.checkpoint, archive=snap.archive
        )

    def commit_batch(
        self, key: RunKey, batch: Sequence[Advance], *, release: Release | None = None
    ) -> None:
        """Commit a batch of consecutive generations in one round trip, each fenced by
        this lease (see :meth:`RedisStore.commit_many`); ``segment``, when not empty, is
        appended to the run's archive with its commit. With ``release``, the lease is
        given up in the same script call once every commit applied; :meth:`release` then
        returns that outcome without a call of its own.

        Raises RunExistsError (``expected_generation == 0``), GenerationMismatchError,
        StaleStateError, LeaseLostError, NonceReplayError, CheckpointTooLargeError,
        CommitOutcomeUnknownError (re-read before acting), ContractError (the key names
        another run, task or environment instance), StoreProtocolError; the commits
        before a refused one are applied.
        """
        commits = batch
        if not commits:
            return
        self._check_key(key)
        if commits[0].expected_generation == 0:
            raise RunExistsError(
                "the run exists; create runs with RedisStore.create_run", run_id=self.run_id
            )
        # Phases go out only when one may differ from the phase last committed here.
        moves = any(c.phase and c.phase != self._phase for c in commits)
        prepared = [
            self._store.prepare_commit(
                self.run_id,
                generation=c.expected_generation + 1,
                checkpoint=c.blob,
                nonces=c.nonces,
                segment=c.segment,
                not_after_ms=c.not_after_ms,
                phase=c.phase if moves else "",
                keys=c.keys,
            )
            for c in commits
        ]
        stated = [c.phase for c in commits if c.phase]
        self._phase, known = None, self._phase  # unknown until the batch applied
        _, released = self._store.commit_many(
            self._lease,
            prepared,
            expected_state_version=self._state_version,
            release=release,
            applied=self._apply,
        )
        if released is not None:
            self._released = released
        self._phase = stated[-1] if stated else known

    def _check_key(self, key: RunKey) -> None:
        if (key.run_id, key.task_id, key.env_instance_id) != (
            self.run_id,
            self._task_id,
            self._env_instance_id,
        ):
            raise ContractError("the key does not name this run", field="key", run_id=self.run_id)

    def _apply(self, result: CommitResult) -> None:
        if result.current_generation == result.generation:
            self._generation = result.generation
            self._state_version = result.state_version

    # -- beyond the port -------------------------------------------------------------------

    def commit(
        self,
        blob: bytes,
        *,
        generation: int | None = None,
        commit_id: str | None = None,
        nonces: Sequence[str] = (),
        segment: bytes = b"",
        phase: str = "",
    ) -> CommitResult:
        """One fenced commit of ``blob`` as ``generation`` (default: last seen + 1), in
        ``phase`` when given (``""``: the run's phase stays as it is), with its commit id
        when given, and its result: a convenience over the store's one commit operation
        (:meth:`RedisStore.commit_many`, a batch of one) for callers that want the result.

        Raises what :meth:`RedisStore.commit_many` raises.
        """
        prepared = self._store.prepare_commit(
            self.run_id,
            generation=self._generation + 1 if generation is None else generation,
            checkpoint=blob,
            commit_id=commit_id,
            nonces=nonces,
            segment=segment,
            phase=phase,
        )
        known, self._phase = self._phase, None
        results, _ = self._store.commit_many(
            self._lease,
            [prepared],
            expected_state_version=self._state_version,
            applied=self._apply,
        )
        self._phase = phase or known
        return results[0]

    def renew(self, ttl_ms: int | None = None) -> Lease:
        """Extend the lease. Raises LeaseLostError, StoreUnavailableError (not renewed)."""
        self._lease = self._store.renew(self._lease, ttl_ms=ttl_ms or self._ttl_ms)
        return self._lease

    def release(self, *, reap: bool = False) -> Released:
        """Give the lease up (see :meth:`RedisStore.release`), unless the last commit
        already did (``commit_batch(..., release=...)``). Raises LeaseLostError."""
        released, self._released = self._released, None
        if released is not None:
            return released
        return self._store.release(self._lease, reap=reap)


class RunCreator:
    """The ``GenerationStore`` a submitter uses to create a run (``RedisStore.creator``).

    ``commit_batch(key, [Advance(0, blob)])`` creates the run named by ``key`` with
    the bound scenario and ``blob`` as generation 1 (one script call; a retry with the same
    creator after a lost reply reports it applied). Any later generation needs a lease:
    acquire one with :meth:`RedisStore.acquire` and commit through the :class:`LeasedRun`.
    ``high_water`` and ``load`` read the store without a lease.
    """

    def __init__(self, store: LeaseStore, scenario: bytes) -> None:
        self._store = store
        self._scenario = scenario
        self._commit_id = new_commit_id()

    def __repr__(self) -> str:
        return "RunCreator()"

    def _read(self, key: RunKey, *, with_checkpoint: bool) -> RunSnapshot:
        return _read_for(self._store, key, with_checkpoint=with_checkpoint)

    def high_water(self, key: RunKey) -> int:
        """Raises HighWaterUnavailableError, StoreProtocolError."""
        return self._read(key, with_checkpoint=False).generation

    def load(self, key: RunKey) -> StoredCheckpoint:
        """Raises HighWaterUnavailableError, StoreProtocolError."""
        snap = self._read(key, with_checkpoint=True)
        if snap.checkpoint is None:
            raise StoreProtocolError("the run has no checkpoint", run_id=key.run_id)
        return StoredCheckpoint(
            generation=snap.generation, blob=snap.checkpoint, archive=snap.archive
        )

    def commit_batch(
        self, key: RunKey, batch: Sequence[Advance], *, release: Release | None = None
    ) -> None:
        """Create the run: a batch of exactly one commit at ``expected_generation == 0``,
        with the first archive segment when the checkpoint names an archive.

        Raises RunExistsError, LeaseLostError (a later generation, or a longer batch,
        without a lease), ContractError (nonces at creation; a release: a creator holds
        no lease), CheckpointTooLargeError, CommitOutcomeUnknownError (no reply: re-read
        before acting), StoreProtocolError.
        """
        if release is not None:
            raise ContractError(
                "a run's creation holds no lease to release", field="release", run_id=key.run_id
            )
        if len(batch) > 1 or any(c.expected_generation != 0 for c in batch):
            raise LeaseLostError(
                "commits after creation need a lease", run_id=key.run_id, reason="no_lease"
            )
        for commit in batch:
            if commit.nonces:
                raise ContractError(
                    "a new run consumes no nonces", field="nonces", run_id=key.run_id
                )
            try:
                self._store.create_run(
                    key.run_id,
                    task_id=key.task_id,
                    env_instance_id=key.env_instance_id,
                    scenario=self._scenario,
                    checkpoint=commit.blob,
                    commit_id=self._commit_id,
                    archive_segment=commit.segment,
                )
            except StoreUnavailableError as exc:
                raise CommitOutcomeUnknownError(
                    "no reply to create_run; re-read before acting",
                    run_id=key.run_id,
                    commit_id=self._commit_id,
                ) from exc
