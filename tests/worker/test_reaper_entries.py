"""The reaper survives bad entries: an entry it cannot handle is recorded, counted and
parked, never stops the tick, and every dead worker's run behind it is still handed on."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ratchet.fleet import metrics
from ratchet.fleet.context import Fleet
from ratchet.fleet.runs import RunDocument
from ratchet.leasing import EXPIRY_INDEX, run_keys
from ratchet.ops import submit
from ratchet.worker.reaper import reap_once
from tests.worker.fleet_harness import poll

MakeWorkspace = Callable[..., tuple[Path, RunDocument]]


def dead_holder(fleet: Fleet, workspace: MakeWorkspace, name: str) -> str:
    """A run whose worker died holding its lease (it expired; the index still has it)."""
    _root, document = workspace()
    run_id = submit(fleet, document, run_id=name)
    lease = fleet.store.acquire(run_id, owner="w-dead", ttl_ms=60)
    assert lease is not None
    poll(
        lambda: not fleet.store.read_run(run_id).lease_live,
        deadline_s=10,
        what="the dead worker's lease expired",
    )
    return run_id


def test_a_corrupted_entry_is_parked_and_the_runs_behind_it_are_still_handed_on(
    fleet: Fleet, workspace: MakeWorkspace
) -> None:
    bad = dead_holder(fleet, workspace, "r-bad-lease")
    good = dead_holder(fleet, workspace, "r-good-lease")
    client = fleet.store.client
    client.hset(run_keys(bad).lease, "lease_version", "not-an-integer")
    client.zadd(EXPIRY_INDEX, {bad: 1})  # the oldest entry: first in every tick
    client.zadd(EXPIRY_INDEX, {"../junk": 2})  # not a run id at all
    before = metrics.REAPER_BAD_ENTRIES._value.get()
    enqueued: list[str] = []
    result = reap_once(fleet.store, enqueued.append, park_ms=60_000)
    assert enqueued == [good]
    assert result.parked == (bad,)
    assert metrics.REAPER_BAD_ENTRIES._value.get() == before + 2
    score = client.zscore(EXPIRY_INDEX, bad)
    assert score is not None and score > fleet.store.server_time_ms()  # parked later
    assert client.zscore(EXPIRY_INDEX, "../junk") is None  # junk names no run: gone
    kinds = [i["kind"] for i in fleet.store.records.incidents(bad)]
    assert "reaper_entry_refused" in kinds
    # The next tick does not stumble on it again until it is due.
    assert reap_once(fleet.store, enqueued.append).parked == ()
