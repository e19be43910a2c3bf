"""Listings that stay true at any size: runs a page at a time from the runs index or one
phase's index, newest (or oldest) first, with exact counts.

A page costs one ``ZRANGE`` of the index (``BYSCORE ... LIMIT``, so its cost does not
grow with the index) and one pipeline that reads the listed runs' state and lease hashes
and their newest incident. No checkpoint is read and nothing is verified: a row shows
what the index and the state hash say (the phase is the unsigned metadata commits carry,
see ``lua/commit.lua``); a run's own view (``ratchet show``, the console's run page)
verifies its checkpoint. A row that cannot be read says why in ``problem`` and never
takes the page down.

On Redis Cluster each index is split into shards (:class:`~ratchet.leasing.keyspace.IndexLayout`):
a page reads the same range of every shard in one pipeline and merges them in walk order
(score, then member, as Redis orders one key), so a page costs one round trip and at most
``limit + 1`` entries per shard. A single Redis is the one-shard case of the same walk.

Cursors are opaque text naming the last entry a page showed: its score, its member and,
per shard, how many entries with that score the walk had passed, so runs with equal
scores (created in the same millisecond) are each listed exactly once. If the entries with
that score changed in between in a shard (a run left the index), the next page re-reads
that score there and resumes after the member by its name (:mod:`ratchet.leasing.walk`).
A cursor is refused by a store with another number of shards. An entry that moves within
the index while it is walked (a run that entered a phase again) shows at its new place,
which an ongoing walk may already have passed.

Counts are ``ZCARD`` of each index (summed over its shards): exact, at any size. Runs
created before phase indexes existed have no phase in their state hash and are in no phase index:
:meth:`RunListings.runs_missing_phase` finds them and :meth:`RunListings.record_phase`
indexes one (``ratchet store init`` does both, reading each phase from the run's verified
checkpoint).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import WatchError

from ratchet.errors import ContractError, RatchetError, StoreProtocolError
from ratchet.leasing.keyspace import PHASES, IndexLayout, check_id, run_keys
from ratchet.leasing.plumbing import StorePlumbing
from ratchet.leasing.sharded import ShardedIndexes
from ratchet.leasing.walk import (
    Entry,
    Position,
    continued,
    decode_cursor,
    merged,
    position_after,
    score_bound,
)
from ratchet.runtime.canonical import strict_json_loads

__all__ = ["MAX_PAGE", "ListedRun", "RunListings", "RunPage"]

MAX_PAGE = 1000
_SEARCH_CHUNK = 200
_STATE_FIELDS = (
    "task_id",
    "generation",
    "phase",
    "phase_at_ms",
    "created_at_ms",
    "updated_at_ms",
    "host",
)
_LEASE_FIELDS = ("owner", "lease_version", "expires_at_ms")


@dataclass(frozen=True, slots=True)
class ListedRun:
    """One row of a listing, as the index and the run's hashes say (nothing verified).

    ``listed_at_ms`` is the index score: the creation time in the runs index, the time the
    run entered the phase in a phase index. ``phase`` is the state hash's (None: none
    recorded). ``owner`` is set only while the lease is live (Redis time). ``problem``
    says why the row could not be read; the other fields are then None.
    """

    run_id: str
    listed_at_ms: int
    phase: str | None = None
    task_id: str | None = None
    generation: int | None = None
    created_at_ms: int | None = None
    updated_at_ms: int | None = None
    owner: str | None = None
    lease_version: int | None = None
    expires_at_ms: int | None = None
    incidents: int = 0
    last_incident: str | None = None  # the kind of the newest incident
    problem: str | None = None
    host: str | None = None  # the host its jobs go to (a routing hint; None: any host)


@dataclass(frozen=True, slots=True)
class RunPage:
    """A page of a listing. ``next_cursor`` is None on the last page; ``scanned`` is how
    many index entries were examined (a search examines more than it returns)."""

    rows: tuple[ListedRun, ...]
    next_cursor: str | None
    phase: str | None  # the index listed (None: every run, by creation time)
    oldest_first: bool
    scanned: int
    now_ms: int


def _int(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bytes) and value.isdigit():
        return int(value)
    raise ValueError("not an integer")


def _ms(value: object) -> int:
    """A stored millisecond time, 0 when absent or not a number."""
    try:
        return _int(value) or 0
    except ValueError:
        return 0


def _text(value: object) -> str | None:
    return None if value is None else StorePlumbing._member(value)


def _incident_kind(raw: object) -> str | None:
    items = raw if isinstance(raw, list) else []
    if not items or not isinstance(items[0], bytes):
        return None
    body = items[0].decode("utf-8", "replace").partition("|")[2]
    try:  # by shape, as RunRecords.incidents reads them
        record = strict_json_loads(body, max_depth=2)
    except ContractError:
        return "unreadable"
    kind = record.get("kind") if isinstance(record, dict) else None
    return kind if isinstance(kind, str) else "unreadable"


def _check_limit(limit: int) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE:
        raise ContractError(f"limit must be an integer from 1 to {MAX_PAGE}", field="limit")
    return limit


class RunListings(ShardedIndexes):
    """Paged, counted listings of runs (see the module docstring). Part of RedisStore."""

    _inline_indexes: bool  # set by RedisStore: a single Redis (not a Cluster)
    _indexes: IndexLayout  # set by RedisStore

    def server_time_ms(self) -> int:  # provided by RedisStore
        raise NotImplementedError

    def index_keys(self, run_id: str | None = None) -> tuple[str, ...]:
        """Every cross-run index key a run may be in (runs, expiry, each phase: removing
        a run must remove it from each), or with no run every index key. On a Cluster each
        index is sharded: the run's own shard of each, or every shard."""
        return self._indexes.keys_of(run_id)

    # -- counts -------------------------------------------------------------------------

    def phase_counts(self) -> dict[str, int]:
        """How many runs each phase index holds (``ZCARD`` of each shard, one pipeline):
        exact.

        Raises StoreUnavailableError, StoreProtocolError.
        """
        per_phase = [self._indexes.phase(phase) for phase in PHASES]
        counts = iter(self._zcards([key for keys in per_phase for key in keys]))
        return {
            phase: sum(next(counts) for _ in keys)
            for phase, keys in zip(PHASES, per_phase, strict=True)
        }

    def run_count(self) -> int:
        """How many runs the runs index holds. Raises StoreUnavailableError."""
        return sum(self._zcards(self._indexes.runs()))

    def _zcards(self, keys: Sequence[str]) -> list[int]:
        def read() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.zcard(key)
            return list(pipe.execute())

        counts = self._call("index counts", None, read)
        if len(counts) != len(keys) or not all(
            isinstance(n, int) and not isinstance(n, bool) for n in counts
        ):
            raise StoreProtocolError("an index count is not an integer")
        return [int(n) for n in counts]

    # -- pages --------------------------------------------------------------------------

    def list_runs(
        self,
        phase: str | None = None,
        *,
        limit: int = 50,
        after: str | None = None,
        oldest_first: bool = False,
    ) -> RunPage:
        """A page of runs: those in ``phase`` (by the time they entered it) or every run
        (by creation time), newest first unless ``oldest_first``, continuing after the
        cursor ``after`` (a page's ``next_cursor``).

        Raises ContractError (unknown phase, a limit outside 1..1000, a cursor this
        listing did not give out or one of the other order), StoreUnavailableError.
        """
        keys, start = self._start(phase, limit, after, oldest_first)
        chunk, base, base_score = self._entries(keys, start, limit + 1, oldest_first)
        more = len(chunk) > limit
        chunk = chunk[:limit]
        rows, now_ms = self._rows(chunk)
        cursor = (
            position_after(chunk, len(chunk) - 1, base, base_score, oldest_first).encode()
            if more and chunk
            else None
        )
        return RunPage(tuple(rows), cursor, phase, oldest_first, len(chunk), now_ms)

    def search_runs(
        self,
        prefix: str,
        phase: str | None = None,
        *,
        limit: int = 50,
        after: str | None = None,
        oldest_first: bool = False,
        budget: int = 5000,
    ) -> RunPage:
        """Like :meth:`list_runs`, keeping only the runs whose id, task id or live lease
        owner starts with ``prefix`` (exact, case-sensitive). At most ``budget`` index
        entries are examined per call; ``next_cursor`` then continues the search where it
        stopped, so a search never claims more than it looked at (``scanned``).

        Raises what :meth:`list_runs` raises, and ContractError for an empty prefix.
        """
        if not isinstance(prefix, str) or not prefix or len(prefix) > 200:
            raise ContractError("the search text must be 1 to 200 characters", field="search")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ContractError("budget must be a positive integer", field="budget")
        keys, start = self._start(phase, limit, after, oldest_first)
        found: list[ListedRun] = []
        scanned, now_ms = 0, 0
        position = start
        while scanned < budget:
            want = min(_SEARCH_CHUNK, budget - scanned)
            chunk, base, base_score = self._entries(keys, position, want, oldest_first)
            if not chunk:
                return RunPage(tuple(found), None, phase, oldest_first, scanned, now_ms)
            rows, now_ms = self._rows(chunk)
            for i, row in enumerate(rows):
                scanned += 1
                if any(
                    isinstance(v, str) and v.startswith(prefix)
                    for v in (row.run_id, row.task_id, row.owner)
                ):
                    found.append(row)
                    if len(found) == limit:
                        end = position_after(chunk, i, base, base_score, oldest_first)
                        return RunPage(
                            tuple(found), end.encode(), phase, oldest_first, scanned, now_ms
                        )
            position = position_after(chunk, len(chunk) - 1, base, base_score, oldest_first)
            if len(chunk) < want:
                return RunPage(tuple(found), None, phase, oldest_first, scanned, now_ms)
        return RunPage(
            tuple(found),
            position.encode() if position else None,
            phase,
            oldest_first,
            scanned,
            now_ms or self.server_time_ms(),
        )

    def run_ids(self, *, limit: int = 1000) -> list[str]:
        """Run ids created through this store, oldest first (up to ``limit``), read a
        thousand at a time. Raises ContractError (a limit below 1), StoreUnavailableError."""
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ContractError("limit must be a positive integer", field="limit")
        keys = self._indexes.runs()
        found: list[str] = []
        position: Position | None = None
        while len(found) < limit:
            want = min(MAX_PAGE, limit - len(found))
            chunk, base, base_score = self._entries(keys, position, want, True)
            found += [self._member(member) for member, _, _ in chunk]
            if len(chunk) < want:
                break
            position = position_after(chunk, len(chunk) - 1, base, base_score, True)
        return found

    def entered_before(self, phase: str, before_ms: int, *, limit: int) -> list[str]:
        """Up to ``limit`` runs that entered ``phase`` at or before ``before_ms`` (Redis
        ms), earliest first. Raises ContractError (unknown phase), StoreUnavailableError."""
        keys = self._indexes.phase(phase)
        parts = self._ranges(
            [(key, "-inf", str(before_ms), 0, limit) for key in keys], oldest_first=True
        )
        return [self._member(member) for member, _, _ in merged(parts, True)[:limit]]

    def _start(
        self, phase: str | None, limit: int, after: str | None, oldest_first: bool
    ) -> tuple[tuple[str, ...], Position | None]:
        _check_limit(limit)
        keys = self._indexes.runs() if phase is None else self._indexes.phase(phase)
        if after is None or after == "":
            return keys, None
        position = decode_cursor(after)
        if position.oldest_first != bool(oldest_first):
            raise ContractError("the cursor was given out for the other order", field="after")
        if len(position.seen) != len(keys):
            raise ContractError(
                "the cursor was given out by a store with another number of index shards",
                field="after",
            )
        return keys, position

    def _ranges(
        self, reads: Sequence[tuple[str, str, str, int, int]], *, oldest_first: bool
    ) -> list[list[Entry]]:
        """For each ``(key, begin, end, offset, count)``: its entries from score ``begin``
        to score ``end`` in walk order (``ZRANGE ... BYSCORE [REV] LIMIT offset count``),
        tagged with the read's place in ``reads`` (its shard). One pipeline."""

        def read() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for key, begin, end, offset, count in reads:
                pipe.zrange(
                    key,
                    begin,
                    end,
                    desc=not oldest_first,
                    byscore=True,
                    offset=offset,
                    num=count,
                    withscores=True,
                )
            return list(pipe.execute())

        replies = self._call("listing", None, read)
        if len(replies) != len(reads):
            raise StoreProtocolError("a listing reply is missing")
        parts: list[list[Entry]] = []
        for shard, ((key, *_), raw) in enumerate(zip(reads, replies, strict=True)):
            entries: list[Entry] = []
            for item in raw if isinstance(raw, list) else [None]:
                member, score = (
                    item if isinstance(item, list | tuple) and len(item) == 2 else (None, None)
                )
                if not isinstance(member, bytes) or not isinstance(score, float):
                    raise StoreProtocolError("an index entry is malformed", index=key)
                entries.append((member, score, shard))
            parts.append(entries)
        return parts

    def _entries(
        self,
        keys: Sequence[str],
        position: Position | None,
        count: int,
        oldest_first: bool,
    ) -> tuple[list[Entry], tuple[int, ...], float | None]:
        """Up to ``count`` entries after ``position`` in walk order, merged over the shards
        ``keys``, with how many entries at ``position``'s score the walk had passed in each
        shard before them."""
        near, far = ("-inf", "+inf") if oldest_first else ("+inf", "-inf")
        if position is None:
            parts = self._ranges(
                [(key, near, far, 0, count) for key in keys], oldest_first=oldest_first
            )
            return merged(parts, oldest_first)[:count], (0,) * len(keys), None
        here = score_bound(position.score)
        # One read per shard, all in one pipeline, in the usual case: from the last entry
        # the walk passed at that score (the cursor's own, in its shard), then what follows.
        parts = self._ranges(
            [
                (key, here, far, max(seen - 1, 0), count + (1 if seen else 0))
                for key, seen in zip(keys, position.seen, strict=True)
            ],
            oldest_first=oldest_first,
        )
        base = list(position.seen)
        for shard, key in enumerate(keys):
            rest = continued(parts[shard], position.seen[shard], position)
            if rest is None:
                rest, base[shard] = self._resume(key, shard, position, count)
            parts[shard] = rest
        return merged(parts, oldest_first)[:count], tuple(base), position.score

    def _resume(
        self, key: str, shard: int, position: Position, count: int
    ) -> tuple[list[Entry], int]:
        """Up to ``count`` entries after ``position`` in one shard whose entries at that
        score changed since: resumed after the member by name. Returns them and how many
        entries at that score the walk has passed there."""
        here = score_bound(position.score)
        far = "+inf" if position.oldest_first else "-inf"
        oldest_first = position.oldest_first
        [ties] = self._ranges([(key, here, here, 0, MAX_PAGE * 100)], oldest_first=oldest_first)
        later = [
            (m, s, shard)
            for m, s, _ in ties
            if (m > position.member if oldest_first else m < position.member)
        ]
        rest: list[Entry] = []
        if len(later) < count:
            [rest] = self._ranges(
                [(key, score_bound(position.score, exclusive=True), far, 0, count - len(later))],
                oldest_first=oldest_first,
            )
        return [*later, *((m, s, shard) for m, s, _ in rest)][:count], len(ties) - len(later)

    def _rows(self, entries: Sequence[Entry]) -> tuple[list[ListedRun], int]:
        """Read the listed runs' hashes in one pipeline (and Redis' time with them on a
        single Redis). A row that cannot be read says why; the others are unaffected."""
        members = [member for member, _, _ in entries]
        scores = [score for _, score, _ in entries]
        ids: list[str | None] = []
        for member in members:
            try:
                ids.append(check_id(member.decode("utf-8"), "run_id"))
            except (UnicodeDecodeError, RatchetError):
                ids.append(None)

        def read() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            if self._inline_indexes:
                pipe.time()
            for run_id in ids:
                if run_id is None:
                    continue
                keys = run_keys(run_id)
                pipe.hmget(keys.state, _STATE_FIELDS)
                pipe.hmget(keys.lease, _LEASE_FIELDS)
                pipe.llen(keys.incidents)
            return list(pipe.execute(raise_on_error=False))

        def newest_incidents(with_some: list[str]) -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for run_id in with_some:
                pipe.lrange(run_keys(run_id).incidents, 0, 0)
            return list(pipe.execute(raise_on_error=False))

        replies = self._call("listing", None, read) if members else []
        if self._inline_indexes and replies:
            now = replies.pop(0)
            if (
                not isinstance(now, list | tuple)
                or len(now) != 2
                or not all(isinstance(x, int) for x in now)
            ):
                raise StoreProtocolError("TIME reply is malformed")
            now_ms = int(now[0]) * 1000 + int(now[1]) // 1000
        else:
            now_ms = self.server_time_ms()
        per_run: dict[str, tuple[object, object, object]] = {}
        valid = [run_id for run_id in ids if run_id is not None]
        for index, valid_id in enumerate(valid):
            per_run[valid_id] = (replies[3 * index], replies[3 * index + 1], replies[3 * index + 2])
        # The newest incident's kind, read only for the runs that have any (most have
        # none): a second, usually skipped, pipeline instead of one more command per row.
        with_some = [r for r in valid if isinstance(per_run[r][2], int) and per_run[r][2]]
        newest = (
            dict(
                zip(
                    with_some,
                    self._call("listing", None, functools.partial(newest_incidents, with_some)),
                    strict=True,
                )
            )
            if with_some
            else {}
        )
        rows: list[ListedRun] = []
        for member, score, run_id in zip(members, scores, ids, strict=True):
            listed = int(score) if math.isfinite(score) else 0
            if run_id is None:
                rows.append(
                    ListedRun(
                        self._member(member), listed, problem="unreadable: not a valid run id"
                    )
                )
                continue
            state, lease, count = per_run[run_id]
            rows.append(self._row(run_id, listed, state, lease, count, newest.get(run_id), now_ms))
        return rows, now_ms

    @staticmethod
    def _row(
        run_id: str,
        listed: int,
        state: object,
        lease: object,
        count: object,
        newest: object,
        now_ms: int,
    ) -> ListedRun:
        for reply in (state, lease, count, newest):  # newest: None when not read
            if isinstance(reply, Exception):
                return ListedRun(run_id, listed, problem=f"unreadable: {type(reply).__name__}")
        if not isinstance(state, list) or not isinstance(lease, list) or state[1] is None:
            return ListedRun(
                run_id, listed, problem="unreadable: no such run (an index entry without a run)"
            )
        try:
            task_id, generation, phase, _phase_at, created, updated, host = state
            owner, version, expires = lease
            expires_at = _int(expires)
            owner_text = _text(owner) or None
            live = owner_text is not None and expires_at is not None and now_ms < expires_at
            phase_text = _text(phase)
            return ListedRun(
                run_id,
                listed,
                phase=phase_text if phase_text in PHASES else None,
                task_id=_text(task_id),
                generation=_int(generation),
                created_at_ms=_int(created),
                updated_at_ms=_int(updated),
                owner=owner_text if live else None,
                lease_version=_int(version),
                expires_at_ms=expires_at,
                incidents=count if isinstance(count, int) else 0,
                last_incident=_incident_kind(newest),
                host=_text(host) or None if host is not None else None,
            )
        except (ValueError, RatchetError):
            return ListedRun(run_id, listed, problem="unreadable: malformed state")

    # -- runs created before phase indexes, and stale entries ---------------------------

    def runs_missing_phase(self, *, chunk: int = 500) -> Iterator[tuple[str, str]]:
        """Runs of the runs index not listed under their phase alone, oldest first, as
        ``(run_id, phase)``: ``phase`` is ``""`` when the state hash records none (a run
        created before phase indexes: read it from the verified checkpoint), else the
        recorded phase, whose index lacks the run or (Cluster, where a crash or an outage
        can leave an index move undone) another phase's index lists it too.

        Raises StoreUnavailableError.
        """
        runs = self._indexes.runs()
        position: Position | None = None
        while True:
            entries, base, base_score = self._entries(runs, position, chunk, True)
            if not entries:
                return
            position = position_after(entries, len(entries) - 1, base, base_score, True)
            ids = []
            for member, _, _ in entries:
                try:
                    ids.append(check_id(self._member(member), "run_id"))
                except RatchetError:
                    continue

            def read(batch: list[str]) -> list[Any]:
                pipe = self._client.pipeline(transaction=False)
                for run_id in batch:
                    pipe.hmget(run_keys(run_id).state, ["generation", "phase"])
                return list(pipe.execute(raise_on_error=False))

            states = self._call("listing", None, functools.partial(read, ids))
            recorded: list[tuple[str, str]] = []
            for run_id, state in zip(ids, states, strict=True):
                if not isinstance(state, list) or state[0] is None:
                    continue  # no run (or junk): nothing to index
                phase = _text(state[1]) or ""
                if phase not in PHASES:
                    yield run_id, ""
                else:
                    recorded.append((run_id, phase))

            # A single Redis moves a run's entry inside the commit script: only its own
            # phase's entry can be missing (runs made before phase indexes). On a Cluster
            # every phase's shard is read (one slot per run).
            def scores(batch: list[tuple[str, str]], every: bool) -> list[Any]:
                pipe = self._client.pipeline(transaction=False)
                for run_id, phase in batch:
                    for name, key in zip(PHASES, self._indexes.phases_of(run_id), strict=True):
                        if every or name == phase:
                            pipe.zscore(key, run_id)
                return list(pipe.execute())

            if not recorded:
                continue
            every = not self._inline_indexes
            found = iter(
                self._call("phase index", None, functools.partial(scores, recorded, every))
            )
            for run_id, phase in recorded:
                listed = [(name, next(found)) for name in PHASES if every or name == phase]
                if any(
                    (score is None) if name == phase else (score is not None)
                    for name, score in listed
                ):
                    yield run_id, phase

    def record_phase(self, run_id: str, phase: str) -> bool:
        """Record ``phase`` for a run whose state hash has none, scored by its last commit
        time, and list the run under that phase alone. A run that records another phase
        by now (a commit came first) is left alone.

        Returns True when the run is now listed under ``phase``. The state hash is
        changed only if no commit changed it meanwhile (``WATCH``). Raises ContractError,
        StoreUnavailableError.
        """
        state = run_keys(run_id).state
        self._indexes.phase_of(phase, run_id)  # ContractError for an unknown phase

        def record() -> int | None:
            for _attempt in range(5):
                with self._client.pipeline(transaction=True) as pipe:
                    try:
                        pipe.watch(state)
                        generation, current, at, updated = pipe.hmget(
                            state, ["generation", "phase", "phase_at_ms", "updated_at_ms"]
                        )
                        if generation is None:
                            return None
                        if current is not None:
                            if _text(current) != phase:
                                return None
                            return _ms(at) or _ms(updated)
                        pipe.multi()
                        pipe.hset(state, mapping={"phase": phase, "phase_at_ms": _ms(updated)})
                        pipe.execute()
                        return _ms(updated)
                    except WatchError:
                        continue
            return None

        at_ms = self._call("phase record", run_id, record)
        if at_ms is None:
            return False
        self._index_run("phase index", run_id, phase=phase, at_ms=at_ms, keep=True)
        return True
