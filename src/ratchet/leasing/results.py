"""Typed results of the store's calls. Every ``*_ms`` value is Redis server time."""

from __future__ import annotations

from dataclasses import dataclass, field

from ratchet.runtime.ports import Fence

__all__ = [
    "Acquired",
    "CommitResult",
    "Lease",
    "LeaseHolder",
    "PhaseMove",
    "PreparedCommit",
    "ReapClaim",
    "Released",
    "RunCreated",
    "RunSnapshot",
]


@dataclass(frozen=True, slots=True)
class Lease:
    """A lease as granted or last renewed: who, which version, until when."""

    run_id: str
    owner: str
    lease_version: int
    expires_at_ms: int
    now_ms: int

    def fence(self, generation: int) -> Fence:
        """The fencing token for adapter writes made under this lease, standing at the
        checkpoint ``generation``."""
        return Fence(run_id=self.run_id, lease_version=self.lease_version, state_version=generation)


@dataclass(frozen=True, slots=True)
class Acquired:
    """A lease just granted, with the run's identity and versions read in the same step."""

    lease: Lease
    generation: int
    state_version: int
    task_id: str
    env_instance_id: str
    took_over: bool = False  # the lease had an owner whose lease had expired
    previous_owner: str = ""  # the lease this one replaced: its owner ("" when free) ...
    previous_lease_version: int = 0  # ... and version (0: the run was never leased)
    phase: str = ""  # the phase the state hash records ("": none, or a thread)
    phase_at_ms: int = 0  # when the run entered it (Redis ms; 0: none recorded)


@dataclass(frozen=True, slots=True)
class LeaseHolder:
    """Who holds a lease that the caller could not take, and until when."""

    run_id: str
    owner: str
    lease_version: int
    expires_at_ms: int
    now_ms: int


@dataclass(frozen=True, slots=True)
class RunCreated:
    """A run that exists now; ``already_applied`` when an earlier call with the same commit
    id created it (a retry after a lost reply)."""

    run_id: str
    generation: int
    state_version: int
    created_at_ms: int
    already_applied: bool
    # The run's phase and when it entered it, as the state hash says now ("" and 0: none).
    phase: str = ""
    phase_at_ms: int = 0


@dataclass(frozen=True, slots=True)
class PreparedCommit:
    """One commit checked and ready to send (``RedisStore.prepare_commit``)."""

    generation: int
    checkpoint: bytes = field(repr=False)  # the signed envelope
    commit_id: str
    digest: str  # SHA-256 of the envelope
    nonces: tuple[str, ...] = ()
    stored: bytes = field(default=b"", repr=False)  # what Redis keeps (see encoding)
    segment: bytes = field(default=b"", repr=False)  # appended to the run's archive
    not_after_ms: int = 0  # Redis time after which the script refuses it (0: never)
    phase: str = ""  # the phase the checkpoint is in ("": leaves the run's phase as it is)
    keys: bytes = field(default=b"", repr=False)  # executed-key digests appended with it


@dataclass(frozen=True, slots=True)
class PhaseMove:
    """A commit moved its run from ``old`` (``""``: none recorded) to phase ``new`` at
    ``at_ms``; the phase indexes follow it (see ``lua/commit.lua``)."""

    run_id: str
    old: str
    new: str
    at_ms: int


@dataclass(frozen=True, slots=True)
class CommitResult:
    """A fenced commit that is in the store.

    ``already_applied`` is true when this commit id had been applied by an earlier call
    (a retry after a lost reply): ``generation`` is then the generation that commit wrote,
    and ``current_generation`` the high-water mark now (later commits may have followed).
    """

    run_id: str
    commit_id: str
    generation: int
    state_version: int
    current_generation: int
    already_applied: bool


@dataclass(frozen=True, slots=True)
class Released:
    run_id: str
    lease_version: int
    now_ms: int


@dataclass(frozen=True, slots=True)
class ReapClaim:
    """The outcome of a reaper's claim on one expired run.

    ``claimed`` is True only for the one caller that may enqueue it for ``lease_version``.
    """

    run_id: str
    claimed: bool
    status: str  # claimed | live | already | no_run
    lease_version: int
    now_ms: int


@dataclass(frozen=True, slots=True)
class RunSnapshot:
    """The authoritative state of one run, read in one step.

    ``owner`` is None when the lease is free. ``checkpoint`` and ``scenario`` are present
    only when they were asked for.
    """

    run_id: str
    task_id: str
    env_instance_id: str
    generation: int
    state_version: int
    created_at_ms: int
    owner: str | None
    lease_version: int
    expires_at_ms: int
    now_ms: int
    checkpoint: bytes | None = field(default=None, repr=False)
    scenario: bytes | None = field(default=None, repr=False)
    archive: tuple[bytes, ...] = field(default=(), repr=False)  # with the checkpoint
    # The index of ``archive``'s first segment: 0 for the whole archive, more when only
    # the last segments were read (then ``keys`` holds the run's executed-key digests).
    archive_from: int = 0
    keys: bytes | None = field(default=None, repr=False)

    @property
    def lease_live(self) -> bool:
        """True when some owner holds the lease and it has not expired (Redis time)."""
        return self.owner is not None and self.now_ms < self.expires_at_ms

    def is_held_by(self, owner: str, lease_version: int) -> bool:
        """True when ``(owner, lease_version)`` is the live lease."""
        return self.lease_live and self.owner == owner and self.lease_version == lease_version
