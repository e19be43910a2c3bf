"""Where the console's data comes from: read-only calls, handed in by the caller.

The console never reads Redis on its own terms: the command line hands it the functions
behind ``ratchet runs --json`` and ``ratchet show --json``, so the browser shows exactly
what an operator sees from the terminal. A run's own page is verified the same way (HMAC,
generation against the high-water mark) before anything is displayed; the runs list shows
what the store's indexes say (``ratchet.leasing.listing``), a page at a time, with exact
counts per phase, and verifies nothing.

A caller that hands in only ``list_runs`` (a fixed list of rows) still gets every page:
:func:`list_page` then filters, sorts and pages that list itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ratchet.errors import ContractError, RatchetError
from ratchet.runtime import Phase

__all__ = [
    "DEFAULT_PAGE",
    "ConsoleData",
    "RunListing",
    "RunQuery",
    "RunRow",
    "list_page",
    "run_counts",
    "waiting_runs",
]

RunRow = dict[str, Any]
DEFAULT_PAGE = 50  # rows per page of the runs list
_PHASES = tuple(p.value for p in Phase)


@dataclass(frozen=True, slots=True)
class RunQuery:
    """One page of the runs list: in ``phase`` (None: every run), whose run id, task id or
    lease owner starts with ``search``, newest first unless ``oldest_first``, after the
    cursor ``after``."""

    phase: str | None = None
    search: str | None = None
    after: str | None = None
    oldest_first: bool = False
    limit: int = DEFAULT_PAGE


@dataclass(frozen=True, slots=True)
class RunListing:
    """A page of the runs list with the exact counts beside it. ``scanned`` is how many
    runs a search examined; ``unindexed`` how many runs no phase index lists."""

    rows: list[RunRow]
    next_cursor: str | None
    counts: dict[str, int]
    total: int
    scanned: int
    queue_depth: int | None = None

    @property
    def unindexed(self) -> int:
        return max(0, self.total - sum(self.counts.values()))


@dataclass(frozen=True)
class ConsoleData:
    """The console's read-only view of a fleet.

    ``list_runs(limit)`` returns one summary row per run (``run_id``, ``phase``,
    ``owner``, ``lease``, ``generation``, ``note``); ``run_detail(run_id, now)`` returns a
    run's verified JSON view, raising RatchetError (RunNotFoundError for an unknown id,
    CheckpointError or IntegrityError for one that does not verify). ``list_workers()``
    returns the queue and its workers as ``ratchet.ops.queueview.list_workers`` reads
    them (None: the console has no view of the workers), raising StoreError.
    """

    list_runs: Callable[[int], list[RunRow]]
    run_detail: Callable[[str, int], dict[str, Any]]
    limit: int = 500
    clock: Callable[[], float] = field(default=time.time)
    list_workers: Callable[[], dict[str, Any]] | None = None
    #: The store's paged listing: ``page_runs(query) -> (rows, next cursor, scanned)``,
    #: raising ContractError for a bad cursor and StoreError (None: page ``list_runs``).
    page_runs: Callable[[RunQuery], tuple[list[RunRow], str | None, int]] | None = None
    #: Exact counts: ``count_runs() -> (runs per phase, all runs)`` (None: count rows).
    count_runs: Callable[[], tuple[dict[str, int], int]] | None = None
    #: Jobs waiting in the fleet's queue (None: not known here).
    queue_depth: Callable[[], int] | None = None
    #: Whether a run with this id exists (a search for a run id goes straight to it).
    run_exists: Callable[[str], bool] | None = None

    def now(self) -> int:
        return int(self.clock())


def _matches(row: RunRow, search: str) -> bool:
    return any(
        isinstance(row.get(name), str) and str(row[name]).startswith(search)
        for name in ("run_id", "task_id", "owner")
    )


def _page_of_list(data: ConsoleData, query: RunQuery) -> tuple[list[RunRow], str | None, int]:
    """Page a fixed list of rows (a caller without the store's listing): the cursor is
    the offset of the next row."""
    rows = list(data.list_runs(data.limit))
    if query.phase is not None:
        rows = [r for r in rows if r.get("phase") == query.phase]
    if query.search:
        rows = [r for r in rows if _matches(r, query.search)]
    if query.oldest_first:
        rows.reverse()
    start = 0
    if query.after:
        if not query.after.isdigit() or int(query.after) > len(rows):
            raise ContractError("the cursor is not one this listing gave out", field="after")
        start = int(query.after)
    end = start + query.limit
    return rows[start:end], (str(end) if end < len(rows) else None), len(rows[start:end])


def run_counts(data: ConsoleData) -> tuple[dict[str, int], int]:
    """Runs per phase and all runs: exact from the store's indexes (``count_runs``), or
    counted from ``list_runs`` (rows with no phase count only in the total). Raises
    StoreError."""
    if data.count_runs is not None:
        return data.count_runs()
    rows = data.list_runs(data.limit)
    counts = dict.fromkeys(_PHASES, 0)
    for row in rows:
        phase = row.get("phase")
        if phase in counts:
            counts[phase] += 1
    return counts, len(rows)


def list_page(data: ConsoleData, query: RunQuery) -> RunListing:
    """One page of the runs list with the counts. Raises ContractError (a cursor this
    listing did not give out), StoreError."""
    page = data.page_runs or (lambda q: _page_of_list(data, q))
    rows, cursor, scanned = page(query)
    counts, total = run_counts(data)
    depth = None
    if data.queue_depth is not None:
        try:
            depth = data.queue_depth()
        except RatchetError:
            depth = None  # the queue's Redis may be another: the list still shows
    return RunListing(rows, cursor, counts, total, scanned, depth)


def waiting_runs(
    data: ConsoleData,
    *,
    limit: int = 50,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[RunRow]]:
    """Runs waiting for a human, newest first, at most ``limit`` of each (the phase
    indexes list them; :func:`run_counts` says how many wait): (needs review details,
    awaiting approval details, rows that could not be read or verified). Each listed run
    is verified (``run_detail``) before it is shown. Raises StoreError when the list
    cannot be read."""
    now = data.now()
    reviews: list[dict[str, Any]] = []
    approvals: list[dict[str, Any]] = []
    broken: list[RunRow] = []
    for phase, into in (
        (Phase.NEEDS_REVIEW.value, reviews),
        (Phase.AWAITING_APPROVAL.value, approvals),
    ):
        rows, _cursor, _scanned = (data.page_runs or (lambda q: _page_of_list(data, q)))(
            RunQuery(phase=phase, limit=limit)
        )
        for row in rows:
            if row.get("note") and str(row["note"]).startswith("unreadable"):
                broken.append(row)
                continue
            try:
                detail = data.run_detail(str(row["run_id"]), now)
            except RatchetError as exc:
                broken.append({**row, "note": f"unverifiable: {exc.message}"})
                continue
            if detail.get("phase") != phase:
                continue  # moved on since the index was read: its own page says where
            into.append(detail)
    if data.page_runs is None:  # a fixed list: its unreadable rows are shown here too
        broken += [r for r in data.list_runs(data.limit) if r.get("phase") is None]
    return reviews, approvals, broken
