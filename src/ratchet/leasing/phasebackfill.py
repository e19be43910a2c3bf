"""Runs their phase index lacks, and how each is listed under its phase again.

A run created before phase indexes existed has no phase in its state hash and is in no
phase index; on a Cluster, where a run's index move is a write after its commit, a crash
or an outage can leave the move undone (the run missing from its phase's index, or listed
under another phase too). :meth:`PhaseBackfill.runs_missing_phase` walks the runs index
and names them; :meth:`PhaseBackfill.record_phase` lists one under its phase alone
(``ratchet store init`` does both, reading a phase the state hash lacks from the run's
verified checkpoint). Part of :class:`ratchet.leasing.listing.RunListings`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

from redis.exceptions import WatchError

from ratchet.errors import RatchetError
from ratchet.leasing.keyspace import PHASES, check_id, run_keys
from ratchet.leasing.listedruns import _int, _text
from ratchet.leasing.walk import Position, position_after
from ratchet.leasing.walkreads import WalkReads

__all__ = ["PhaseBackfill"]


def _ms(value: object) -> int:
    """A stored millisecond time, 0 when absent or not a number."""
    try:
        return _int(value) or 0
    except ValueError:
        return 0


class PhaseBackfill(WalkReads):
    """Finds and lists the runs a phase index lacks (see the module docstring). Part of
    RedisStore."""

    _inline_indexes: bool  # set by RedisStore: a single Redis (not a Cluster)

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
