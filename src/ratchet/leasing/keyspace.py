"""Every Redis key name ratchet uses, spelled once.

Layout (``<run>`` is the run id; the braces are a Redis Cluster hash tag, so every key of
one run lives in the same slot and one script can touch them all):

==================================  =======  ==============================================
key                                 type     holds
==================================  =======  ==============================================
``ratchet:{<run>}:state``           hash     task_id, env_instance_id, generation (the
                                             high-water mark), state_version,
                                             created_at_ms, updated_at_ms, last_commit_id,
                                             phase and phase_at_ms (the phase the last
                                             commit declared and when the run entered it:
                                             unsigned metadata for listings; absent for a
                                             run created before phase indexes), host
                                             (the host its jobs go to: an unsigned
                                             routing hint, see ``ratchet.leasing.hosts``)
``ratchet:{<run>}:lease``           hash     owner ("" when free), lease_version,
                                             expires_at_ms, acquired_at_ms
``ratchet:{<run>}:ckpt``            string   the signed checkpoint at the high-water mark
``ratchet:{<run>}:scenario``        string   the scenario (task contract) bytes
``ratchet:{<run>}:history``         list     bounded, newest first:
                                             ``generation|state_version|lease_version|
                                             owner|commit_id|digest|at_ms``
``ratchet:{<run>}:commits``         hash     commit id -> ``generation|digest`` for the
                                             commits still in the history
``ratchet:{<run>}:nonces``          set      approval / review nonces consumed by this run
``ratchet:{<run>}:incidents``       list     bounded, newest first: JSON records of
                                             restores that failed closed (for operators)
``ratchet:{<run>}:inbox``           list     bounded: signed approvals and reviewer
                                             decisions waiting for a worker to consume them
``ratchet:{<run>}:archive``         list     the run's archive segments, oldest first
``ratchet:{<run>}:keys``            string   8-byte digests of the keys of the run's
                                             executed writes, in order (appended with the
                                             archive; see ``ratchet.runtime.window``)
``ratchet:{<run>}:ledger``          hash     the declared tools' ledger of a run whose
                                             document keeps it in the store: instance,
                                             version, the highest fence and store epoch,
                                             counters (``ratchet.tools.store_ledger``)
``ratchet:{<run>}:calls``           hash     that ledger's rows: idempotency key -> JSON
                                             (tool, intent, approval, status, attempts,
                                             receipt)
``ratchet:{<run>}:placement``       string   a host-bound run moved to another host: a
                                             signed placement (``ratchet.fleet.placement``)
``ratchet:{<run>}:tombstone``       hash     only once the run was purged (``ratchet
                                             purge``): purged_at_ms, phase, generation,
                                             state_version, task_id, created_at_ms,
                                             checkpoint_digest, export; the id stays taken
``ratchet:index:expiry``            zset     run id scored by lease expiry (ms): reaper index
``ratchet:index:runs``              zset     run id scored by creation time (ms)
``ratchet:index:phase:<phase>``     zset     one per phase (:data:`PHASES`): run id scored
                                             by the time (ms) it entered that phase
                                             (these three: sharded on a Cluster, see below)
``ratchet:nonce:<nonce>``           string   the run id that claimed this nonce, for good
``ratchet:hosts``                   zset     host name scored by the Redis time (ms) a
                                             worker of that host last reported in
==================================  =======  ==============================================

The last four rows are cross-run keys: they live in other slots. On a single Redis the
create, lease and commit scripts take the indexes they update as optional extra ``KEYS``;
in Redis Cluster they are only ever touched by separate calls, never from inside a script.
:class:`IndexLayout` names every index key of a store.

On Redis Cluster every cross-run index is split into :data:`INDEX_SHARDS` keys, the
index's name followed by ``:{xNN}``: ``ratchet:index:runs:{x07}``,
``ratchet:index:phase:running:{x07}``, ``ratchet:index:expiry:{x07}``. A run's entries
live in the shard its id hashes to (:func:`index_shard`), in every index, and all the keys
of one shard share the hash tag ``{xNN}``, so one slot: a run's phase move is one script
call (add to the new phase, remove from every other) and its index writes after a
create or a lease script are one round trip. The shards' slots are spread over the
masters, so a master's outage stops the index writes and the takeovers of a fraction of
the runs, and the index writes of a busy fleet are spread over the masters. Readers (the
reaper, the listings, the counts) read every shard and merge. On a single Redis there is
one shard per index, the name itself, which the scripts update inline.

Ids that become part of key names or of ``|``-separated history entries are checked here:
letters, digits and ``._:@/+-``, starting with a letter or digit, at most 200 characters.
No braces (they would form a different hash tag) and no ``|``.
"""

from __future__ import annotations

import functools
import re
import zlib
from dataclasses import dataclass

from ratchet.errors import ContractError
from ratchet.runtime.state import Phase

__all__ = [
    "EPOCH_KEY",
    "EXPIRY_INDEX",
    "HOSTS_KEY",
    "INDEX_KEYS",
    "INDEX_SHARDS",
    "PHASES",
    "PHASE_INDEXES",
    "PREFIX",
    "RUNS_INDEX",
    "IndexLayout",
    "RunKeys",
    "check_id",
    "check_phase",
    "expiry_keys",
    "expiry_shard",
    "index_keys_of",
    "index_shard",
    "nonce_key",
    "phase_index",
    "run_keys",
]

PREFIX = "ratchet"
EXPIRY_INDEX = f"{PREFIX}:index:expiry"
RUNS_INDEX = f"{PREFIX}:index:runs"
HOSTS_KEY = f"{PREFIX}:hosts"
#: Every phase a run can be listed under, in the runtime's order.
PHASES: tuple[str, ...] = tuple(phase.value for phase in Phase)
#: One index per phase: run id scored by the time (Redis ms) it entered that phase.
PHASE_INDEXES: tuple[str, ...] = tuple(f"{PREFIX}:index:phase:{p}" for p in PHASES)
_PHASE_INDEX = dict(zip(PHASES, PHASE_INDEXES, strict=True))
#: Every cross-run index a run may be a member of (runs, expiry, each phase): removing a
#: run for good must ``ZREM`` it from each of these.
INDEX_KEYS: tuple[str, ...] = (RUNS_INDEX, EXPIRY_INDEX, *PHASE_INDEXES)
#: How many shards each cross-run index has on Redis Cluster (one on a single Redis).
#: Fixed: every client of a store must put a run's entries where every reader looks.
INDEX_SHARDS = 16


def index_shard(run_id: str, shards: int) -> int:
    """The shard (``0 <= n < shards``) that holds ``run_id``'s entries in every index."""
    return 0 if shards <= 1 else zlib.crc32(run_id.encode()) % shards


def _shard_key(index: str, shard: int, shards: int) -> str:
    return index if shards <= 1 else f"{index}:{{x{shard:02d}}}"


@dataclass(frozen=True, slots=True)
class IndexLayout:
    """The keys of a store's cross-run indexes: one key per index on a single Redis
    (``shards=1``), :data:`INDEX_SHARDS` per index on a Cluster (module docstring)."""

    shards: int = 1

    def runs(self) -> tuple[str, ...]:
        """Every shard of the runs index, in shard order."""
        return self._all(RUNS_INDEX)

    def phase(self, phase: str) -> tuple[str, ...]:
        """Every shard of ``phase``'s index. Raises ContractError for an unknown phase."""
        return self._all(phase_index(phase))

    def expiry(self) -> tuple[str, ...]:
        """Every shard of the expiry index."""
        return self._all(EXPIRY_INDEX)

    def runs_of(self, run_id: str) -> str:
        """The runs index shard that holds ``run_id``."""
        return _shard_key(RUNS_INDEX, index_shard(run_id, self.shards), self.shards)

    def phase_of(self, phase: str, run_id: str) -> str:
        """The shard of ``phase``'s index that holds ``run_id``. Raises ContractError."""
        return _shard_key(phase_index(phase), index_shard(run_id, self.shards), self.shards)

    def phases_of(self, run_id: str) -> tuple[str, ...]:
        """Each phase's shard that holds ``run_id``, in :data:`PHASES` order (one slot)."""
        shard = index_shard(run_id, self.shards)
        return tuple(_shard_key(index, shard, self.shards) for index in PHASE_INDEXES)

    def expiry_of(self, run_id: str) -> str:
        """The expiry index shard that holds ``run_id``."""
        return _shard_key(EXPIRY_INDEX, index_shard(run_id, self.shards), self.shards)

    def keys_of(self, run_id: str | None = None) -> tuple[str, ...]:
        """Every index key ``run_id`` may be in (runs, expiry, each phase: what removing
        it for good must clear), or with no run every index key of every shard."""
        if run_id is None:
            return tuple(k for index in INDEX_KEYS for k in self._all(index))
        shard = index_shard(run_id, self.shards)
        return tuple(_shard_key(index, shard, self.shards) for index in INDEX_KEYS)

    def _all(self, index: str) -> tuple[str, ...]:
        return tuple(_shard_key(index, n, self.shards) for n in range(max(self.shards, 1)))


def expiry_keys(shards: int) -> tuple[str, ...]:
    """Every key of the expiry index split into ``shards`` (1: :data:`EXPIRY_INDEX`)."""
    return IndexLayout(shards).expiry()


def expiry_shard(run_id: str, shards: int) -> str:
    """The expiry index key that holds ``run_id``'s entry (1 shard: :data:`EXPIRY_INDEX`)."""
    return IndexLayout(shards).expiry_of(run_id)


def index_keys_of(run_id: str | None, shards: int) -> tuple[str, ...]:
    """Every cross-run index key ``run_id`` may be in (its own shard of each), or with no
    run every index key (each shard): what removing a run for good must clear."""
    return IndexLayout(shards).keys_of(run_id)


# The store's epoch record: written once when the store is initialised; a store that
# lost it (wiped, restarted without its AOF, evicted) is not the same store.
EPOCH_KEY = f"{PREFIX}:store:epoch"

_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/+-]{0,199}")


def check_id(value: str, field: str) -> str:
    """Return ``value`` if it is a valid id, else raise ContractError naming ``field``."""
    if not isinstance(value, str) or _ID.fullmatch(value) is None:
        raise ContractError(f"{field} is not a valid id", field=field)
    return value


def check_phase(value: str, field: str = "phase") -> str:
    """Return ``value`` if it names a phase (:data:`PHASES`), else raise ContractError."""
    if not isinstance(value, str) or value not in _PHASE_INDEX:
        raise ContractError(f"{field} is not a phase", field=field)
    return value


def phase_index(phase: str) -> str:
    """The index of runs in ``phase``. Raises ContractError for an unknown phase."""
    return _PHASE_INDEX[check_phase(phase)]


@dataclass(frozen=True, slots=True)
class RunKeys:
    """The keys of one run. All share the hash tag ``{<run_id>}``."""

    run_id: str
    state: str
    lease: str
    ckpt: str
    scenario: str
    history: str
    commits: str
    nonces: str
    incidents: str
    inbox: str
    archive: str
    keys: str
    tombstone: str
    ledger: str
    calls: str
    placement: str


@functools.lru_cache(maxsize=4096)
def run_keys(run_id: str) -> RunKeys:
    """The keys of run ``run_id`` (cached). Raises ContractError for an invalid id."""
    check_id(run_id, "run_id")
    base = f"{PREFIX}:{{{run_id}}}"
    return RunKeys(
        run_id=run_id,
        state=f"{base}:state",
        lease=f"{base}:lease",
        ckpt=f"{base}:ckpt",
        scenario=f"{base}:scenario",
        history=f"{base}:history",
        commits=f"{base}:commits",
        nonces=f"{base}:nonces",
        incidents=f"{base}:incidents",
        inbox=f"{base}:inbox",
        archive=f"{base}:archive",
        keys=f"{base}:keys",
        tombstone=f"{base}:tombstone",
        ledger=f"{base}:ledger",
        calls=f"{base}:calls",
        placement=f"{base}:placement",
    )


def nonce_key(nonce: str) -> str:
    """The global record of which run claimed ``nonce``. Raises ContractError."""
    check_id(nonce, "nonce")
    return f"{PREFIX}:nonce:{nonce}"
