"""The Redis store: leases, fenced checkpoint commits, high-water marks and nonces.

Protocol (each step is one script call on the run's own slot; see ``lua/`` and
``docs/redis.md``):

1. ``create_run`` writes the scenario and the first signed checkpoint (generation 1, state
   version 1) together and refuses an existing run id.
2. ``acquire`` takes a free or expired lease: ``max(lease_version + 1, now_ms)`` (the
   store's time as a floor, so a lease granted after a rewound store still outranks every
   lease granted before it), expiry from Redis ``TIME`` plus the ttl. Losing the race
   returns ``None``.
3. ``commit_many`` checks, for each commit of its batch, owner, lease version, expiry,
   generation == high-water + 1 and the expected state version, then stores the
   checkpoint and advances generation and state version in the same step. Its commit id
   makes a retry after a lost reply report "already applied" instead of failing or
   applying twice.
4. ``renew`` and ``release`` work only for the current owner and lease version; renew only
   before expiry.
5. ``read_run`` returns the authoritative lease and high-water state (and optionally the
   checkpoint with its archive, and the scenario) for restore.

Nonces (approvals, reviewer decisions) are consumed in two places. First a global record
``ratchet:nonce:<nonce>`` is claimed with ``SET NX`` naming the run; if another run holds
it, the commit is refused with :class:`~ratchet.errors.NonceReplayError` before it is
sent. Then the commit script adds the nonce to the run's own set atomically with the
checkpoint, refusing it if this run consumed it before. The global record is a separate
call because in Redis Cluster it lives in another slot; a claim whose commit then fails
stays with the same run, so that run may still use the nonce once, and no other run ever
can.

Cross-run indexes: the expiry index (acquire and renew add the run scored by its lease
expiry; release removes it, or scores it "now" with ``reap=True``; a commit with
``finished=True`` removes it), the runs index (create) and one index per phase (create
adds the run to its first phase's; a commit that changes the run's phase moves it). On a
single Redis the lease, create and commit scripts update them in the same call; in Redis
Cluster they live in other slots and are separate calls after the script. The expiry
index is a hint for the reaper, which re-reads each run's lease before acting; the runs
and phase indexes are what listings read (:mod:`ratchet.leasing.listing`).

A commit has one door on the store: ``commit_many``, a batch of consecutive generations
(each checked and digested by ``prepare_commit``, no I/O) in one call of the commit
script, with an optional ``Release`` that gives the lease up in the same call; a
checkpoint that names an archive appends its segment in the same script (see
``docs/redis.md``). :class:`~ratchet.leasing.handle.LeasedRun` is how the runtime reaches
it (``commit_batch``, the ``GenerationStore`` port, and ``commit``, one checkpoint).
Incidents and the evidence inbox live in :mod:`ratchet.leasing.records`, the client and
error translation in :mod:`ratchet.leasing.plumbing`.

Clients must not decode responses (checkpoints are bytes). redis-py's own retry may re-send
an ``EVALSHA`` after a dropped connection; the commit id makes that safe.

Drill hook: ``RedisStore.reply_hook`` (None by default, then it costs one ``is None``
test per commit) is called as ``hook(run_id, commit_id)`` after the commit script replied
and before the reply is decoded. Returning True throws the reply away, exactly as if the
connection had dropped after the script ran (the retry answers ``already_applied``, or,
if that reply is dropped too, :class:`CommitOutcomeUnknownError`); the hook may also kill
the process there. Worker failpoints install it (``after_commit_before_reply``).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.exceptions import RedisError, ResponseError

from ratchet.errors import (
    CommitOutcomeUnknownError,
    ConfigurationError,
    ContractError,
    LeaseHeldElsewhereError,
    NonceReplayError,
    StoreProtocolError,
)
from ratchet.leasing.acks import ReplicaAcks
from ratchet.leasing.encoding import ZSTD_MAGIC, decode_checkpoint, encode_checkpoint
from ratchet.leasing.epoch import StoreIdentity
from ratchet.leasing.expiry import ExpiryIndex
from ratchet.leasing.handle import LeasedRun, RunCreator, new_commit_id
from ratchet.leasing.hosts import HostRecords
from ratchet.leasing.keyspace import (
    EXPIRY_INDEX,
    INDEX_SHARDS,
    PHASE_INDEXES,
    RUNS_INDEX,
    IndexLayout,
    check_id,
    check_phase,
    nonce_key,
    phase_index,
    run_keys,
)
from ratchet.leasing.ledger import LedgerRecords
from ratchet.leasing.listing import RunListings
from ratchet.leasing.plumbing import store_full
from ratchet.leasing.records import RunRecords
from ratchet.leasing.replies import (
    batch_entries,
    decode_acquire,
    decode_claim_reap,
    decode_commit,
    decode_create,
    decode_phase_move,
    decode_read,
    decode_release,
    decode_renew,
)
from ratchet.leasing.results import (
    CommitResult,
    Lease,
    LeaseHolder,
    PreparedCommit,
    ReapClaim,
    Released,
    RunCreated,
    RunSnapshot,
)
from ratchet.leasing.retention import RunRetention
from ratchet.leasing.scripts import ScriptName
from ratchet.runtime.ports import Release
from ratchet.runtime.signing import KeyRing
from ratchet.runtime.window import DIGEST_BYTES

__all__ = ["DEFAULT_MAX_CHECKPOINT_BYTES", "RedisStore"]

DEFAULT_MAX_CHECKPOINT_BYTES = 1 << 20


class RedisStore(
    RunListings,
    RunRetention,
):
    """Leases and fenced commits for many runs on one Redis (or Redis Cluster) client.

    ``client`` is a ``redis.Redis``, ``redis.cluster.RedisCluster`` or
    ``fakeredis.FakeRedis`` created with ``decode_responses=False``. Checkpoints over
    ``max_checkpoint_bytes`` (default 1 MiB) are refused before they reach Redis.
    ``commit_retries`` is how often a commit whose reply was lost is re-sent with the same
    commit id before :class:`CommitOutcomeUnknownError` is raised. ``nonce_ttl_s`` bounds
    how long the global nonce records live (None: for good; set it above the longest
    approval lifetime if set at all). ``compress_checkpoints`` stores checkpoints as zstd
    frames (:mod:`ratchet.leasing.encoding`); either way, reads accept both.
    ``record_keyring`` seals every incident as it is written (None: written unsigned).
    """

    def __init__(
        self,
        client: Any,
        *,
        max_checkpoint_bytes: int = DEFAULT_MAX_CHECKPOINT_BYTES,
        max_scenario_bytes: int = DEFAULT_MAX_CHECKPOINT_BYTES,
        history_limit: int = 64,
        commit_retries: int = 1,
        nonce_ttl_s: int | None = None,
        compress_checkpoints: bool = True,
        min_replicas_ack: int = 0,
        replicas_ack_timeout_ms: int = 1000,
        record_keyring: KeyRing | None = None,
    ) -> None:
        for name, value, low in (
            ("max_checkpoint_bytes", max_checkpoint_bytes, 1),
            ("max_scenario_bytes", max_scenario_bytes, 1),
            ("history_limit", history_limit, 1),
            ("commit_retries", commit_retries, 0),
            ("min_replicas_ack", min_replicas_ack, 0),
            ("replicas_ack_timeout_ms", replicas_ack_timeout_ms, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigurationError(f"{name} must be an integer >= {low}", field=name)
        if nonce_ttl_s is not None and (not isinstance(nonce_ttl_s, int) or nonce_ttl_s < 1):
            raise ConfigurationError("nonce_ttl_s must be a positive integer or None")
        if min_replicas_ack and isinstance(client, RedisCluster):
            raise ConfigurationError(
                "min_replicas_ack is not supported on Redis Cluster (see docs/scale.md)",
                field="min_replicas_ack",
            )
        super().__init__(client)
        # On a single Redis the lease and create scripts update the cross-run indexes
        # themselves (one round trip, one fsync); in Redis Cluster those live in other
        # slots, split into shards, and written after the script (leasing/sharded.py).
        self._inline_indexes = not isinstance(client, RedisCluster)
        self._indexes = IndexLayout(1 if self._inline_indexes else INDEX_SHARDS)
        #: The expiry index, the reaper's (:mod:`ratchet.leasing.expiry`).
        self.expiry = ExpiryIndex(self._client, self._runner, self._indexes, self.server_time_ms)
        self.index_moves_deferred = 0
        self._deferred_moves = OrderedDict()
        self.max_checkpoint_bytes = max_checkpoint_bytes
        self.max_scenario_bytes = max_scenario_bytes
        self.history_limit = history_limit
        self.commit_retries = commit_retries
        self.nonce_ttl_s = nonce_ttl_s
        self.compress_checkpoints = bool(compress_checkpoints)
        #: Incidents and the evidence inbox of each run (:mod:`ratchet.leasing.records`),
        #: every incident sealed as it is written when there is a key ring.
        self.records = RunRecords(
            self._client,
            self._runner,
            max_document_bytes=max_scenario_bytes,
            keyring=record_keyring,
        )
        #: The acknowledgement rule: replicas that must confirm a create, acquire, commit
        #: or ledger write before it counts (``WAIT``; 0: the primary's reply, AOF, does).
        self._acks = ReplicaAcks(
            self._runner, min_replicas_ack=min_replicas_ack, timeout_ms=replicas_ack_timeout_ms
        )
        #: The runs' tool ledgers (:mod:`ratchet.leasing.ledger`), acknowledged like commits.
        self.ledger = LedgerRecords(self._client, self._runner, self._acks)
        #: Where runs live and when each host was last seen (:mod:`ratchet.leasing.hosts`).
        self.hosts = HostRecords(self._client, self.server_time_ms)
        #: The store's epoch record and eviction policy (:mod:`ratchet.leasing.epoch`).
        self.identity = StoreIdentity(self._client)
        #: Drill hook ``(run_id, commit_id) -> drop the reply?`` (see the module docstring).
        self.reply_hook: Callable[[str, str], bool] | None = None

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> RedisStore:
        """A store on a new ``redis.Redis`` client for ``url`` (``redis://host:port/db``)."""
        return cls(redis.Redis.from_url(url, decode_responses=False), **kwargs)

    # -- runs -------------------------------------------------------------------------

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
    ) -> RunCreated:
        """Create a run with its scenario and signed first checkpoint (generation 1), and
        the first segment of its archive when the checkpoint names one.

        ``phase`` is the phase the first checkpoint is in (a new run's is ``running``):
        the run is listed under it from now on. Retrying with the same ``commit_id`` after
        a lost reply reports ``already_applied``. Raises RunExistsError,
        CheckpointTooLargeError, ContractError, StoreUnavailableError, StoreProtocolError,
        ReplicationUnconfirmedError (``min_replicas_ack``: created on the primary only).
        """
        keys = run_keys(run_id)
        check_phase(phase)
        check_id(task_id, "task_id")
        check_id(env_instance_id, "env_instance_id")
        commit_id = check_id(commit_id or new_commit_id(), "commit_id")
        self._check_blob(scenario, run_id, "scenario", self.max_scenario_bytes)
        self._check_blob(checkpoint, run_id, "checkpoint", self.max_checkpoint_bytes)
        if archive_segment:
            self._check_blob(archive_segment, run_id, "archive_segment", self.max_checkpoint_bytes)
        digest = hashlib.sha256(checkpoint).hexdigest()
        inline = self._inline_indexes
        create_keys = [
            keys.state,
            keys.scenario,
            keys.ckpt,
            keys.history,
            keys.commits,
            keys.lease,
            keys.archive,
            keys.tombstone,
            *([RUNS_INDEX, phase_index(phase)] if inline else []),
        ]
        create_args: list[str | bytes | int] = [
            task_id,
            env_instance_id,
            scenario,
            encode_checkpoint(checkpoint, compress=self.compress_checkpoints),
            commit_id,
            digest,
            archive_segment,
            run_id,
            phase,
        ]
        reply, counted = self._call(
            ScriptName.CREATE_RUN.value,
            run_id,
            lambda: self._acks.run(ScriptName.CREATE_RUN, create_keys, create_args, hot=False),
        )
        created = decode_create(reply, run_id)
        if not inline or created.already_applied:
            # A retry that finds the run created must still see it indexed, under the
            # phase it is in now.
            now_phase, at_ms = (
                (created.phase, created.phase_at_ms)
                if created.already_applied
                else (phase, created.created_at_ms)
            )
            self._index_created(run_id, created.created_at_ms, now_phase, at_ms)
        self._acks.check(run_id, counted, wrote=not created.already_applied, commit_id=commit_id)
        return created

    def read_run(
        self,
        run_id: str,
        *,
        with_checkpoint: bool = False,
        with_scenario: bool = False,
        archive_tail: int = 0,
    ) -> RunSnapshot:
        """The authoritative state of one run, in one step. With the checkpoint comes the
        whole archive, or with ``archive_tail`` > 0 its last ``archive_tail`` segments and
        the run's executed-key digests (what a worker's windowed restore reads).

        Raises RunNotFoundError, StoreUnavailableError, StoreProtocolError, ContractError.
        """
        if isinstance(archive_tail, bool) or not isinstance(archive_tail, int) or archive_tail < 0:
            raise ContractError(
                "archive_tail must be a non-negative integer", field="archive_tail", run_id=run_id
            )
        keys = run_keys(run_id)
        reply = self._run(
            ScriptName.READ_RUN,
            run_id,
            [keys.state, keys.lease, keys.ckpt, keys.scenario, keys.archive, keys.keys],
            ["1" if with_checkpoint else "0", "1" if with_scenario else "0", str(archive_tail)],
        )
        snap = decode_read(
            reply,
            run_id,
            with_checkpoint=with_checkpoint,
            with_scenario=with_scenario,
            tail=archive_tail,
        )
        if snap.checkpoint is not None and snap.checkpoint.startswith(ZSTD_MAGIC):
            snap = replace(
                snap,
                checkpoint=decode_checkpoint(snap.checkpoint, max_bytes=self.max_checkpoint_bytes),
            )
        return snap

    def creator(self, scenario: bytes) -> RunCreator:
        """A ``GenerationStore`` whose ``advance(expected_generation=0)`` creates a run with
        ``scenario`` (for ``RunEngine.start`` on the submitting side)."""
        return RunCreator(self, scenario)

    # -- leases -----------------------------------------------------------------------

    def try_acquire(self, run_id: str, *, owner: str, ttl_ms: int) -> LeasedRun | LeaseHolder:
        """Acquire the lease, or return who holds it and until when.

        With ``min_replicas_ack``, an acquired lease counts only once ``WAIT`` confirmed
        it: the replication stream is one ordered log, so that also confirms every commit
        before it, the checkpoint this lease is about to restore included (a previous
        owner's commit that stayed unconfirmed is never acted on until it is confirmed).

        Raises RunNotFoundError, ContractError, StoreUnavailableError, StoreProtocolError,
        ReplicationUnconfirmedError (the lease is taken on the primary only: do not use
        it; it expires).
        """
        keys = run_keys(run_id)
        check_id(owner, "owner")
        if isinstance(ttl_ms, bool) or not isinstance(ttl_ms, int) or ttl_ms < 1:
            raise ContractError("ttl_ms must be a positive integer", field="ttl_ms")
        inline = self._inline_indexes
        acquire_keys = [keys.lease, keys.state, *([EXPIRY_INDEX] if inline else [])]
        acquire_args: list[str | bytes | int] = [owner, ttl_ms, *([run_id] if inline else [])]
        reply, counted = self._call(
            ScriptName.ACQUIRE_LEASE.value,
            run_id,
            lambda: self._acks.run(ScriptName.ACQUIRE_LEASE, acquire_keys, acquire_args, hot=False),
        )
        outcome = decode_acquire(reply, run_id, owner)
        if isinstance(outcome, LeaseHolder):
            return outcome  # nothing was written
        lease = outcome.lease
        self._acks.check(run_id, counted, wrote=True, lease_version=lease.lease_version)
        if not inline:
            self._index_acquired(run_id, lease.expires_at_ms, outcome.phase, outcome.phase_at_ms)
        return LeasedRun(self, outcome, ttl_ms=ttl_ms)

    def acquire(self, run_id: str, *, owner: str, ttl_ms: int) -> LeasedRun | None:
        """Acquire the lease; ``None`` if another live worker holds it.

        Raises RunNotFoundError, ContractError, StoreUnavailableError, StoreProtocolError.
        """
        outcome = self.try_acquire(run_id, owner=owner, ttl_ms=ttl_ms)
        return None if isinstance(outcome, LeaseHolder) else outcome

    def acquire_or_raise(self, run_id: str, *, owner: str, ttl_ms: int) -> LeasedRun:
        """Acquire the lease or raise LeaseHeldElsewhereError (``owner``, ``expires_at_ms``)."""
        outcome = self.try_acquire(run_id, owner=owner, ttl_ms=ttl_ms)
        if isinstance(outcome, LeaseHolder):
            raise LeaseHeldElsewhereError(
                "another live worker holds the lease",
                run_id=run_id,
                owner=outcome.owner,
                lease_version=outcome.lease_version,
                expires_at_ms=outcome.expires_at_ms,
                now_ms=outcome.now_ms,
            )
        return outcome

    def renew(self, lease: Lease, *, ttl_ms: int) -> Lease:
        """Extend ``lease`` by ``ttl_ms`` from Redis' now.

        Raises LeaseLostError (taken over, released or already expired), RunNotFoundError,
        StoreUnavailableError (treat as not renewed), StoreProtocolError.
        """
        keys = run_keys(lease.run_id)
        if isinstance(ttl_ms, bool) or not isinstance(ttl_ms, int) or ttl_ms < 1:
            raise ContractError("ttl_ms must be a positive integer", field="ttl_ms")
        inline = self._inline_indexes
        reply = self._run(
            ScriptName.RENEW_LEASE,
            lease.run_id,
            [keys.lease, *([EXPIRY_INDEX] if inline else [])],
            [lease.owner, lease.lease_version, ttl_ms, *([lease.run_id] if inline else [])],
        )
        renewed = decode_renew(reply, lease)
        if not inline:
            self.expiry.score(lease.run_id, renewed.expires_at_ms)
        return renewed

    def release(self, lease: Lease, *, reap: bool = False) -> Released:
        """Give the lease up.

        With ``reap=False`` (waiting for an approval or review, or finished) the run leaves
        the expiry index; with ``reap=True`` it stays there scored "now", so the reaper
        hands it to another worker. Raises LeaseLostError, RunNotFoundError,
        StoreUnavailableError, StoreProtocolError.
        """
        keys = run_keys(lease.run_id)
        inline = self._inline_indexes
        reply = self._run(
            ScriptName.RELEASE_LEASE,
            lease.run_id,
            [keys.lease, *([EXPIRY_INDEX] if inline else [])],
            [
                lease.owner,
                lease.lease_version,
                *([lease.run_id, "reap" if reap else "drop"] if inline else []),
            ],
        )
        released = decode_release(reply, lease)
        if not inline:
            self._index_released(lease.run_id, released, reap=reap)
        return released

    def _index_released(self, run_id: str, released: Released, *, reap: bool) -> None:
        """The expiry index after a release, where scripts cannot reach it (Cluster)."""
        if reap:
            self.expiry.score(run_id, released.now_ms)
        else:
            self.expiry.remove(run_id)

    # -- nonces -----------------------------------------------------------------------

    def claim_nonces(self, run_id: str, nonces: Sequence[str]) -> None:
        """Record, for good, that ``run_id`` claims each nonce (``SET NX`` per nonce).

        A nonce claimed by this run before passes (whether the run consumed it is the
        commit script's check). Raises NonceReplayError (``nonce``, ``claimed_by``) if
        another run claimed it, ContractError, StoreUnavailableError.
        """
        check_id(run_id, "run_id")
        for nonce in nonces:
            key = nonce_key(nonce)
            with self._reachable("nonce claim", run_id):
                if self._client.set(key, run_id.encode(), nx=True, ex=self.nonce_ttl_s):
                    continue
                holder = self._client.get(key)
            if holder == run_id.encode():
                continue
            raise NonceReplayError(
                "the nonce was consumed by another run",
                run_id=run_id,
                nonce=nonce,
                claimed_by=holder.decode("utf-8", "replace") if isinstance(holder, bytes) else None,
            )

    def nonce_claimed_by(self, nonce: str) -> str | None:
        """Which run claimed ``nonce``, if any. Raises StoreUnavailableError."""
        key = nonce_key(nonce)
        holder = self._call("nonce read", None, lambda: self._client.get(key))
        if holder is None:
            return None
        if not isinstance(holder, bytes):
            raise StoreProtocolError("nonce record is not bytes", nonce=nonce)
        return holder.decode("utf-8", "replace")

    # -- commits ----------------------------------------------------------------------

    def _commit_call(
        self,
        lease: Lease,
        commits: Sequence[PreparedCommit],
        expected_state_version: int,
        release: str,
    ) -> tuple[list[str], list[str | bytes | int]]:
        keys = run_keys(lease.run_id)
        index: list[str] = []
        if self._inline_indexes:
            # The phase indexes come only with a batch that names a phase (one that may
            # move the run); the expiry index before them, used only when releasing.
            if any(commit.phase for commit in commits):
                index = [EXPIRY_INDEX, *PHASE_INDEXES]
            elif release:
                index = [EXPIRY_INDEX]
        # Numbers travel as text: the commit connection packs str and bytes as they are.
        args: list[str | bytes | int] = [
            lease.owner,
            str(lease.lease_version),
            str(expected_state_version),
            str(self.history_limit),
            str(len(commits)),
            release,
            lease.run_id,
        ]
        for commit in commits:
            args += [
                str(commit.generation),
                commit.stored or commit.checkpoint,
                commit.commit_id,
                commit.digest,
                commit.segment,
                commit.keys,
                str(commit.not_after_ms),
                commit.phase,
                str(len(commit.nonces)),
                *commit.nonces,
            ]
        return (
            [
                keys.lease,
                keys.state,
                keys.ckpt,
                keys.history,
                keys.commits,
                keys.nonces,
                keys.archive,
                keys.keys,
                *index,
            ],
            args,
        )

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
    ) -> PreparedCommit:
        """Check one commit's arguments and compute its digest (no I/O). ``keys`` are the
        executed-key digests appended with ``segment`` (whole 8-byte digests). ``not_after_ms``
        (Redis time; 0: none) makes the script refuse the commit once TIME passed it.
        ``phase`` (``""``: unchanged) is the phase the checkpoint is in: unsigned metadata
        that moves the run between the phase indexes when it changes.

        Raises ContractError, CheckpointTooLargeError.
        """
        if phase:
            check_phase(phase)
        if (
            isinstance(not_after_ms, bool)
            or not isinstance(not_after_ms, int)
            or (not_after_ms < 0)
        ):
            raise ContractError(
                "not_after_ms must be a non-negative integer", field="not_after_ms", run_id=run_id
            )
        commit_id = new_commit_id() if commit_id is None else check_id(commit_id, "commit_id")
        if isinstance(generation, bool) or not isinstance(generation, int) or generation < 2:
            raise ContractError(
                "a commit's generation must be an integer >= 2", field="generation", run_id=run_id
            )
        nonces = list(nonces)
        for nonce in nonces:
            check_id(nonce, "nonce")
        if len(set(nonces)) != len(nonces):
            raise ContractError("nonces repeat within one commit", field="nonces", run_id=run_id)
        self._check_blob(checkpoint, run_id, "checkpoint", self.max_checkpoint_bytes)
        if segment:
            self._check_blob(segment, run_id, "archive_segment", self.max_checkpoint_bytes)
        if not isinstance(keys, bytes) or len(keys) % DIGEST_BYTES:
            raise ContractError(
                "key digests must be whole 8-byte digests", field="keys", run_id=run_id
            )
        return PreparedCommit(
            generation,
            checkpoint,
            commit_id,
            hashlib.sha256(checkpoint).hexdigest(),
            tuple(nonces),
            encode_checkpoint(checkpoint, compress=self.compress_checkpoints),
            bytes(segment),
            not_after_ms,
            phase,
            keys,
        )

    def commit_many(
        self,
        lease: Lease,
        commits: Sequence[PreparedCommit],
        *,
        expected_state_version: int,
        release: Release | None = None,
        applied: Callable[[CommitResult], None] | None = None,
    ) -> tuple[list[CommitResult], Released | None]:
        """The store's one commit operation: fenced commits of consecutive generations
        (each made by :meth:`prepare_commit`) in one call of the commit script, one round
        trip and one AOF fsync, on a single Redis and on a Cluster alike; with
        ``release``, the lease given up in the same call once every commit applied (as
        :meth:`release` with ``release.reap`` would), so a job's last commit and its
        release cost one round trip too. Returns the commits' results and the release's
        outcome (None without ``release``).

        Commit ``i`` of the batch expects state version ``expected_state_version + i`` and
        generation high-water + 1, so it can only apply after every commit before it. The
        script stops at the first refusal; its replies are decoded in order and that
        refusal is raised (the commits before it are applied, and were each passed to
        ``applied`` as they were decoded; a refused batch releases nothing). Nonces of
        every commit are claimed globally first. A lost reply re-sends the whole batch,
        release included, with the same commit ids: applied ones answer
        ``already_applied``, and a lease that moved on since answers LeaseLostError.
        With ``min_replicas_ack``, a batch applied on the primary that too few replicas
        confirmed raises ReplicationUnconfirmedError (see docs/scale.md).

        Raises LeaseLostError, GenerationMismatchError, StaleStateError, NonceReplayError,
        CheckpointTooLargeError, ContractError, RunNotFoundError, StoreProtocolError, and
        CommitOutcomeUnknownError when no reply arrived (re-read the run before acting).
        """
        run_id = lease.run_id
        if not commits:
            if release is not None:
                raise ContractError(
                    "a commit with a release needs at least one commit",
                    field="commits",
                    run_id=run_id,
                )
            return [], None
        for index, commit in enumerate(commits[1:], start=1):
            if commit.generation != commits[0].generation + index:
                raise ContractError(
                    "a batch's generations must be consecutive", field="generation", run_id=run_id
                )
        nonces = [nonce for commit in commits for nonce in commit.nonces]
        if nonces:
            self.claim_nonces(run_id, nonces)
        mode = "" if release is None else "reap" if release.reap else "drop"
        keys, args = self._commit_call(lease, commits, expected_state_version, mode)
        expected_entries = len(commits) + (0 if release is None else 1)
        last: Exception | None = None
        for _attempt in range(1 + self.commit_retries):
            # Timeline of a lost reply: the script ran (or not), the connection dropped
            # before the reply arrived. Re-sending the same commit ids either applies
            # them now or answers already_applied; nothing applies twice.
            try:
                reply, counted = self._acks.run(ScriptName.COMMIT, keys, args)
            except ResponseError as exc:
                full = store_full(exc, "the commit", run_id)
                if full is not None:
                    raise full from exc
                raise StoreProtocolError(
                    "Redis refused the commit", run_id=run_id, commit_id=commits[0].commit_id
                ) from exc
            except RedisError as exc:
                last = exc
                continue
            hook = self.reply_hook
            if hook is not None and any([hook(run_id, c.commit_id) for c in commits]):
                last = RedisError("commit reply dropped by a drill hook")
                continue
            entries = batch_entries(reply, expected_entries + 1)
            move = decode_phase_move(entries, run_id)
            if move is not None and not self._inline_indexes:
                self._index_moved(move)
            results = []
            for index, (commit, entry) in enumerate(zip(commits, entries, strict=False)):
                result = decode_commit(
                    entry,
                    lease,
                    commit_id=commit.commit_id,
                    generation=commit.generation,
                    expected_state_version=expected_state_version + index,
                )
                if applied is not None:
                    applied(result)
                results.append(result)
            if len(entries) != expected_entries:  # a shorter reply must end in a refusal
                raise StoreProtocolError(
                    "the commit script stopped without a refusal", run_id=run_id, script="commit"
                )
            released = None
            if release is not None:
                released = decode_release(entries[-1], lease)
                if not self._inline_indexes:  # Cluster: the expiry index after the release
                    self._index_released(run_id, released, reap=release.reap)
            self._acks.check(
                run_id,
                counted,
                wrote=any(not r.already_applied for r in results),
                commit_id=commits[-1].commit_id,
                generation=commits[-1].generation,
                lease_version=lease.lease_version,
            )
            return results, released
        raise CommitOutcomeUnknownError(
            "no reply to the commit; re-read the run before acting",
            run_id=run_id,
            commit_id=commits[-1].commit_id,
            generation=commits[-1].generation,
            lease_version=lease.lease_version,
            cause=type(last).__name__,
        )

    # -- cross-run indexes --------------------------------------------------------------

    def server_time_ms(self) -> int:
        """Redis server time in milliseconds. Raises StoreUnavailableError."""
        reply = self._call("TIME", None, self._client.time)
        if (
            not isinstance(reply, tuple | list)
            or len(reply) != 2
            or not all(isinstance(x, int) for x in reply)
        ):
            raise StoreProtocolError("TIME reply is malformed")
        return int(reply[0]) * 1000 + int(reply[1]) // 1000

    def claim_reap(self, run_id: str, *, reclaim_after_ms: int = 30_000) -> ReapClaim:
        """Claim the right to re-enqueue ``run_id`` for its current (expired) lease version.

        Exactly one caller gets ``claimed=True`` per lease version (unless a claim is older
        than ``reclaim_after_ms``: its reaper died before enqueuing). Raises
        StoreUnavailableError, StoreProtocolError.
        """
        check_id(run_id, "run_id")
        reply = self._run(
            ScriptName.CLAIM_REAP, run_id, [run_keys(run_id).lease], [reclaim_after_ms]
        )
        return decode_claim_reap(reply, run_id)
