"""The rows of a listing: what the index and a run's hashes say of each listed run, read
for a whole page in one pipeline, nothing verified.

A row shows what the state hash records (the phase is the unsigned metadata commits carry,
see ``lua/commit.lua``), the lease's owner while the lease is live by Redis' time, how many
incidents the run has and the kind of the newest one (read only for the runs that have
any: a second pipeline, usually skipped). A row that cannot be read says why in
``problem`` and never takes the page down. Part of
:class:`ratchet.leasing.listing.RunListings`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ratchet.errors import ContractError, RatchetError, StoreProtocolError
from ratchet.leasing.keyspace import PHASES, check_id, run_keys
from ratchet.leasing.plumbing import StorePlumbing
from ratchet.leasing.walk import Entry
from ratchet.runtime.canonical import strict_json_loads

__all__ = ["ListedRows", "ListedRun"]

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


def _int(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bytes) and value.isdigit():
        return int(value)
    raise ValueError("not an integer")


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


class ListedRows(StorePlumbing):
    """Reads the rows of a page (see the module docstring). Part of RedisStore."""

    _inline_indexes: bool  # set by RedisStore: a single Redis (not a Cluster)

    def server_time_ms(self) -> int:  # provided by RedisStore
        raise NotImplementedError

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
