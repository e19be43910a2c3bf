"""Where the console's data comes from: read-only calls, handed in by the caller.

The console never reads Redis on its own terms: the command line hands it two functions
(the same ones ``ratchet runs --json`` and ``ratchet show --json`` print), so the browser
shows exactly what an operator would sign from the terminal, verified the same way
(HMAC, generation against the high-water mark) before anything is displayed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ratchet.errors import RatchetError
from ratchet.runtime import Phase

__all__ = ["ConsoleData", "RunRow", "waiting_runs"]

RunRow = dict[str, Any]


@dataclass(frozen=True)
class ConsoleData:
    """The console's read-only view of a fleet.

    ``list_runs(limit)`` returns one summary row per run (``run_id``, ``phase``,
    ``owner``, ``lease``, ``generation``, ``note``); ``run_detail(run_id, now)`` returns a
    run's verified JSON view, raising RatchetError (RunNotFoundError for an unknown id,
    CheckpointError or IntegrityError for one that does not verify).
    """

    list_runs: Callable[[int], list[RunRow]]
    run_detail: Callable[[str, int], dict[str, Any]]
    limit: int = 500
    clock: Callable[[], float] = field(default=time.time)

    def now(self) -> int:
        return int(self.clock())


def waiting_runs(data: ConsoleData) -> tuple[list[dict[str, Any]], list[dict[str, Any]],
                                             list[RunRow]]:
    """Runs waiting for a human: (needs review details, awaiting approval details,
    rows that could not be read). Raises StoreError when the run list cannot be read."""
    now = data.now()
    reviews: list[dict[str, Any]] = []
    approvals: list[dict[str, Any]] = []
    broken: list[RunRow] = []
    for row in data.list_runs(data.limit):
        phase = row.get("phase")
        if phase not in (Phase.NEEDS_REVIEW.value, Phase.AWAITING_APPROVAL.value):
            if phase is None:
                broken.append(row)
            continue
        try:
            detail = data.run_detail(str(row["run_id"]), now)
        except RatchetError as exc:
            broken.append({**row, "note": f"unverifiable: {exc.message}"})
            continue
        (reviews if phase == Phase.NEEDS_REVIEW.value else approvals).append(detail)
    return reviews, approvals, broken
