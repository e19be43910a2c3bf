"""Network faults in `ratchet drill`: each invariant on synthetic evidence (pass, fail,
unknown), the orders service as a process that survives a SIGKILL and restart, and a
short drill of every network fault that must pass."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from redis.exceptions import RedisError

from ratchet.chaos.drill.evidence import AdapterRecords, Evidence, RunFacts
from ratchet.chaos.drill.netchecks import (
    cut_orders_settled_once,
    net_fired,
    orders_restart_one_order,
    partition_fenced,
)
from ratchet.chaos.drill.netfaults import NET_FAULTS, NetFaults, http_timeout_s
from ratchet.chaos.drill.schedule import FAULTS, parse_faults
from ratchet.chaos.drill.services import TenantOrders, order_body
from tests.chaos.drill_support import drill_record as record

RATCHET = str(Path(sys.executable).with_name("ratchet"))


def facts(
    run_id: str,
    index: int = 0,
    *,
    status: str = "terminal",
    orders: int = 1,
    generation: int = 6,
    history: list[tuple[int, int, str]] | None = None,
    inversions: int = 0,
    executed: set[str] | None = None,
) -> RunFacts:
    adapters = AdapterRecords(
        file_effects={"w0": 1, "w1": 1},
        order_effects={order_body(index): orders} if orders else {},
        receipt_keys={"k-order"} if orders else set(),
        lease_inversions=inversions,
    )
    return RunFacts(
        run_id,
        index,
        status,
        "completed" if status == "terminal" else "running",
        generation,
        history if history is not None else [(6, 3, "d6"), (5, 3, "d5"), (4, 2, "d4")],
        executed if executed is not None else {"k-order"},
        None,
        [],
        adapters,
    )


def evidence(runs: list[RunFacts], **events: list[dict[str, Any]]) -> Evidence:
    return Evidence([], dict(events), {f.run_id: f for f in runs})


def ev(kind: str, run_id: str, lease_version: int, pid: int, **fields: Any) -> dict[str, Any]:
    return {
        "kind": kind,
        "run_id": run_id,
        "lease_version": lease_version,
        "pid": pid,
        "at": 1.0,
        **fields,
    }


def partition(kind: str = "partition-store", **fields: Any) -> dict[str, Any]:
    return {
        "kind": kind,
        "at": 10.0,
        "healed_at": 13.0,
        "pid": 100,
        "run_id": "r1",
        "lease_version": 2,
        "generation": 4,
        "taken_over_by": 3,
        **fields,
    }


# -- the fault list ------------------------------------------------------------------------


def test_every_network_fault_is_a_drill_fault_and_all_includes_it() -> None:
    assert set(NET_FAULTS) <= set(FAULTS)
    assert set(NET_FAULTS) <= parse_faults("all")
    assert http_timeout_s() > 0


# -- taking turns on the Redis lane ---------------------------------------------------------


class _DownClient:
    """A Redis client that cannot reach Redis: every call fails as a RedisError would."""

    def __getattr__(self, name: str) -> Any:
        def fail(*args: Any, **kwargs: Any) -> Any:
            raise RedisError("unreachable")

        return fail


class _Drill:
    """What NetFaults reads of the runner's drill, with nothing to hit (Redis unreachable)."""

    def __init__(self, unsettled: set[str]) -> None:
        self.holding: dict[str, Any] | None = None
        self.cut: object | None = None
        self.last_redis_fault = 0.0
        self._unsettled = unsettled
        self.pending: list[str] = []
        self.settled: dict[str, Any] = {}
        self.rec = SimpleNamespace(corrupted={})
        self.fleet = SimpleNamespace(store=SimpleNamespace(client=_DownClient()))
        self.pool = SimpleNamespace(workers={})

    def unsettled(self) -> set[str]:
        return set(self._unsettled)


def _net(tmp_path: Path, *faults: str) -> NetFaults:
    return NetFaults(frozenset(faults), None, None, events_dir=tmp_path, ttl_s=1.0)  # type: ignore[arg-type]


def test_a_partition_kept_off_the_lane_by_a_store_fault_keeps_its_patience(
    tmp_path: Path,
) -> None:
    net, drill = _net(tmp_path, "partition-store"), _Drill({"r1"})
    drill.holding = {"kind": "maxmemory"}  # the Redis lane is taken
    net.tick(drill, 100.0, 0.5)
    drill.holding = None
    net.tick(drill, 200.0, 0.5)  # its first look finds nothing: it waits, not skipped
    assert net.skipped == {}
    assert [k for k, _ in net.wanted] == ["partition-store"]
    net.tick(drill, 261.0, 0.5)  # 61 s of looking: skipped, with why
    assert net.wanted == []
    assert net.skipped["partition-store"].startswith("nothing to hit within 60 s")


def test_a_partition_that_never_found_a_run_in_flight_says_so(tmp_path: Path) -> None:
    net, drill = _net(tmp_path, "partition-reply"), _Drill(set())
    net.tick(drill, 100.0, 0.5)
    assert net.skipped == {"partition-reply": "every run settled before it found something to hit"}


def test_a_store_fault_due_after_a_waiting_partition_gives_it_the_lane(tmp_path: Path) -> None:
    net = _net(tmp_path, "partition-store", "orders-kill")  # partition-store at 0.12
    assert not net.redis_turn(0.10, 0.35)  # the partition is not due yet
    assert net.redis_turn(0.20, 0.35)  # due, and before the store fault: its turn
    assert not net.redis_turn(0.20, 0.10)  # the store fault fell due first
    net.wanted = [w for w in net.wanted if w[0] != "partition-store"]
    assert not net.redis_turn(0.90, 0.35)  # orders faults never take the Redis lane
    net.lanes["redis"] = {"kind": "partition-store"}
    assert net.redis_turn(0.90, 0.0)  # a partition in force keeps the lane


# -- partition-store and partition-reply ---------------------------------------------------


@pytest.mark.parametrize("kind", ["partition-store", "partition-reply"])
def test_a_partitioned_worker_refused_after_the_takeover_passes(tmp_path: Path, kind: str) -> None:
    rec = record(tmp_path, net_faults=[partition(kind)])
    # The cut worker acked g4 before the takeover (lease 3 restored g4); its stalled
    # commit after the heal was refused and its job ended lease_lost.
    got = partition_fenced(
        rec,
        evidence(
            [facts("r1"), facts("r2", 1)],
            restore=[ev("restore", "r1", 3, 200, generation=4)],
            ack=[ev("ack", "r1", 2, 100, generation=4, digest="d4")],
            job_end=[ev("job_end", "r1", 2, 100, outcome="lease_lost")],
        ),
        kind,
    )
    assert got.status == "pass", got.detail
    assert "1 taken over while cut" in got.detail


@pytest.mark.parametrize("kind", ["partition-store", "partition-reply"])
def test_a_commit_accepted_under_the_old_lease_after_the_takeover_fails(
    tmp_path: Path, kind: str
) -> None:
    rec = record(tmp_path, net_faults=[partition(kind)])
    # Lease 3 restored g4, yet Redis' history holds g5 under lease 2: accepted after it.
    got = partition_fenced(
        rec,
        evidence(
            [facts("r1", history=[(6, 3, "d6"), (5, 2, "d5"), (4, 2, "d4")])],
            restore=[ev("restore", "r1", 3, 200, generation=4)],
        ),
        kind,
    )
    assert got.status == "fail"
    assert "r1 g5 under lease 2" in got.detail


def test_a_lost_ack_of_the_cut_worker_fails(tmp_path: Path) -> None:
    rec = record(tmp_path, net_faults=[partition("partition-reply")])
    got = partition_fenced(
        rec,
        evidence(
            [facts("r1")],
            restore=[ev("restore", "r1", 3, 200, generation=4)],
            ack=[ev("ack", "r1", 2, 100, generation=4, digest="another")],
        ),
        "partition-reply",
    )
    assert got.status == "fail"
    assert "ack g4 lost" in got.detail


def test_a_partitioned_run_left_unsettled_or_with_a_lease_inversion_fails(
    tmp_path: Path,
) -> None:
    rec = record(tmp_path, net_faults=[partition()])
    restore = [ev("restore", "r1", 3, 200, generation=4)]
    unsettled = partition_fenced(
        rec, evidence([facts("r1", status="active")], restore=restore), "partition-store"
    )
    assert unsettled.status == "fail"
    assert "unsettled" in unsettled.detail
    inverted = partition_fenced(
        rec, evidence([facts("r1", inversions=1)], restore=restore), "partition-store"
    )
    assert inverted.status == "fail"


def test_a_partition_without_a_takeover_or_none_at_all_is_unknown(tmp_path: Path) -> None:
    none = partition_fenced(record(tmp_path), evidence([facts("r1")]), "partition-store")
    assert none.status == "unknown"
    quiet = record(tmp_path, net_faults=[partition(taken_over_by=None)])
    got = partition_fenced(quiet, evidence([facts("r1")]), "partition-store")
    assert got.status == "unknown"
    assert net_fired(quiet)["partition-store"] == 0
    assert net_fired(record(tmp_path, net_faults=[partition()]))["partition-store"] == 1


# -- partition-adapter ---------------------------------------------------------------------


def cut(**fields: Any) -> dict[str, Any]:
    return {"kind": "partition-adapter", "at": 5.0, "run_id": "r1", "calls_cut": 2, **fields}


def test_a_cut_order_call_settled_with_one_order_passes(tmp_path: Path) -> None:
    got = cut_orders_settled_once(record(tmp_path, net_faults=[cut()]), evidence([facts("r1")]))
    assert got.status == "pass", got.detail


def test_a_cut_order_call_placed_twice_or_unrecorded_fails(tmp_path: Path) -> None:
    rec = record(tmp_path, net_faults=[cut()])
    twice = cut_orders_settled_once(rec, evidence([facts("r1", orders=2)]))
    assert twice.status == "fail"
    assert "2 orders" in twice.detail
    unrecorded = cut_orders_settled_once(rec, evidence([facts("r1", executed=set())]))
    assert unrecorded.status == "fail"
    missing = cut_orders_settled_once(rec, evidence([facts("r1", orders=0, executed=set())]))
    assert missing.status == "fail"
    assert "without its one order" in missing.detail


def test_a_cut_nobody_called_through_is_unknown(tmp_path: Path) -> None:
    rec = record(tmp_path, net_faults=[cut(calls_cut=0)])
    got = cut_orders_settled_once(rec, evidence([facts("r1", orders=2)]))
    assert got.status == "unknown"
    assert net_fired(rec)["partition-adapter"] == 0


# -- orders-kill ---------------------------------------------------------------------------


def kill(**fields: Any) -> dict[str, Any]:
    return {
        "kind": "orders-kill",
        "at": 5.0,
        "restarted_at": 5.6,
        "runs_at_order": ["r1"],
        **fields,
    }


def test_runs_across_an_orders_restart_with_one_order_each_pass(tmp_path: Path) -> None:
    rec = record(tmp_path, net_faults=[kill()])
    got = orders_restart_one_order(rec, evidence([facts("r1"), facts("r2", 1)]))
    assert got.status == "pass", got.detail


def test_a_second_order_after_the_restart_fails_on_any_run(tmp_path: Path) -> None:
    rec = record(tmp_path, net_faults=[kill()])
    got = orders_restart_one_order(rec, evidence([facts("r1"), facts("r2", 1, orders=2)]))
    assert got.status == "fail"
    assert "r2" in got.detail
    stuck = orders_restart_one_order(rec, evidence([facts("r1", status="active")]))
    assert stuck.status == "fail"


def test_no_orders_restart_is_unknown(tmp_path: Path) -> None:
    rec = record(tmp_path, net_skipped={"orders-kill": "nothing to hit"})
    got = orders_restart_one_order(rec, evidence([facts("r1", orders=2)]))
    assert got.status == "unknown"
    assert "nothing to hit" in got.detail


# -- the orders service as a process --------------------------------------------------------


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=5) as reply:
        data: dict[str, Any] = json.loads(reply.read())
        return data


@pytest.mark.timeout(60)
def test_the_orders_process_serves_the_same_databases_after_a_sigkill(tmp_path: Path) -> None:
    orders = TenantOrders(tmp_path / "orders", process=True)
    try:
        url = orders.add("t0")
        before = _get(url + "/v1/identity")
        first = orders.pid
        orders.kill()
        with pytest.raises(OSError):
            _get(url + "/v1/identity")
        orders.restart()
        assert orders.pid != first
        assert _get(url + "/v1/identity")["service_id"] == before["service_id"]
    finally:
        orders.stop()


# -- a short drill of every network fault ---------------------------------------------------


# The CI profile (tests/chaos/test_drill.py) fires every network fault and requires a
# pass; this drill of the network faults alone is opt-in.
@pytest.mark.chaos
@pytest.mark.timeout(420)
def test_a_short_drill_of_every_network_fault_passes(tmp_path: Path) -> None:
    folder = tmp_path / "drill"
    shutil.rmtree(folder, ignore_errors=True)
    args = ["--workers", "3", "--runs", "12", "--lease-ttl", "1", "--faults", ",".join(NET_FAULTS)]
    done = subprocess.run(
        [RATCHET, "drill", *args, "--json", "--dir", str(folder)],
        capture_output=True,
        timeout=400,
        check=False,
        env=dict(os.environ),
    )
    assert done.stdout, done.stderr.decode(errors="replace")[-2000:]
    report = json.loads(done.stdout)
    invariants = report["invariants"]
    for name in (
        "partitioned_workers_fenced",
        "reply_partition_acks_kept",
        "cut_orders_settled_once",
        "orders_restart_one_order",
        "no_acked_checkpoint_lost",
        "no_run_stuck",
        "every_fault_fired",
    ):
        assert invariants[name]["status"] == "pass", (name, invariants[name])
    assert not report["failed_invariants"], report["failed_invariants"]
    assert report["duplicate_effects"] == 0
    kinds = {f["kind"] for f in report["net_faults"]}
    assert kinds == set(NET_FAULTS), report["net_faults"]
