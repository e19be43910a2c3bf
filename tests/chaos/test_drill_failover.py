"""The drill on a replicated store (a primary, a replica, three Sentinels): redis-kill is a
failover after the replica was cut off, and the acknowledgement rule decides whether an
acknowledged commit may be lost to it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ratchet.chaos.drill.checker import _failover_acks_kept, _failover_losses
from ratchet.chaos.drill.evidence import Evidence
from ratchet.chaos.drill.runner import DrillOptions, _check_topology
from ratchet.errors import ConfigurationError
from tests.chaos.drill_support import RATCHET, drill_record, run_drill, topology_profile

FAILOVER = {"at": 100.0, "promoted_at": 103.0, "kept": {"r1": 4, "r2": 7}}


def _ack(run_id: str, generation: int, at: float) -> dict[str, Any]:
    return {"kind": "ack", "run_id": run_id, "generation": generation, "at": at, "digest": "d"}


def _evidence(*acks: dict[str, Any]) -> Evidence:
    return Evidence([], {"ack": list(acks)}, {})


def test_an_ack_above_what_the_promoted_replica_kept_is_lost_to_the_failover(
    tmp_path: Path,
) -> None:
    record = drill_record(tmp_path, failovers=[FAILOVER])
    lost = _failover_losses(
        record,
        _evidence(
            _ack("r1", 4, 99.0),  # kept
            _ack("r1", 5, 99.5),  # lost: the replica stopped at 4
            _ack("r1", 5, 104.0),  # after the promotion: on the new primary
            _ack("r2", 7, 99.9),  # kept
            _ack("r3", 2, 99.0),  # a run the promoted replica never heard of: lost
        ),
    )
    assert {r: [a["generation"] for a in acks] for r, acks in lost.items()} == {
        "r1": [5],
        "r3": [2],
    }


def test_acks_are_judged_against_the_next_failover_after_them(tmp_path: Path) -> None:
    second = {"at": 200.0, "promoted_at": 202.0, "kept": {"r1": 9}}
    record = drill_record(tmp_path, failovers=[FAILOVER, second])
    lost = _failover_losses(record, _evidence(_ack("r1", 9, 150.0), _ack("r1", 10, 199.0)))
    assert [a["generation"] for a in lost["r1"]] == [10]


def test_with_the_rule_a_lost_ack_fails_and_none_lost_passes(tmp_path: Path) -> None:
    options = DrillOptions(topology="replicated", min_replicas_ack=1)
    record = drill_record(tmp_path, failovers=[FAILOVER], options=options)
    assert _failover_acks_kept(record, 1).status == "fail"
    assert _failover_acks_kept(record, 0).status == "pass"
    assert _failover_acks_kept(drill_record(tmp_path, options=options), 0).status == "unknown"


@pytest.mark.parametrize(
    ("topology", "replicas", "faults"),
    [
        ("replicated", 0, {"redis-pause"}),
        ("replicated", 0, {"rollback"}),
        ("replicated", 0, {"partition-store"}),
        ("single", 1, {"kill"}),
        ("ring", 0, {"kill"}),
    ],
)
def test_faults_that_need_one_server_are_refused_on_the_replicated_topology(
    topology: str, replicas: int, faults: set[str]
) -> None:
    options = DrillOptions(topology=topology, min_replicas_ack=replicas, faults=frozenset(faults))
    with pytest.raises(ConfigurationError):
        _check_topology(options)


def test_the_cli_refuses_a_store_fault_on_the_replicated_topology_in_one_line() -> None:
    done = subprocess.run(
        [RATCHET, "drill", "--topology", "replicated", "--faults", "kill,redis-pause"],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    lines = done.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "redis-pause" in lines[0], lines


def _drill(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    _, report = run_drill(
        tmp_path / "drill", *topology_profile("replicated", *args), env=env, timeout_s=400
    )
    return report


def _common(report: dict[str, Any]) -> None:
    """What holds with or without the rule: every failover fired, no effect doubled, no
    run went on silently on a rewound state, none stuck."""
    statuses = {k: v["status"] for k, v in report["invariants"].items()}
    assert len(report["failovers"]) >= 1, (report["failovers"], report["drill_errors"])
    assert report["duplicate_effects"] == 0
    for name in ("one_effect_per_intent", "no_acked_checkpoint_lost", "no_run_stuck"):
        assert statuses[name] == "pass", (report["invariants"][name], report["drill_errors"])
    assert statuses["conflicts_frozen_with_evidence"] != "fail", report["invariants"]
    assert (
        "0 continued silently" in report["invariants"]["conflicts_frozen_with_evidence"]["detail"]
    )


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_with_the_rule_no_acknowledged_commit_is_lost_to_a_failover(tmp_path: Path) -> None:
    report = _drill(tmp_path, "--min-replicas-ack", "1")
    _common(report)
    kept = report["invariants"]["failover_acks_kept"]
    assert kept["status"] == "pass", (kept, report["failovers"], report["drill_errors"])
    assert report["acked_lost_to_failover"] == 0
    assert report["rewound_by_failover"] == []
    assert report["options"]["min_replicas_ack"] == 1


@pytest.mark.chaos
@pytest.mark.timeout(420)
def test_without_the_rule_lost_commits_are_counted_and_their_runs_never_go_on_silently(
    tmp_path: Path,
) -> None:
    report = _drill(tmp_path)
    _common(report)
    assert "failover_acks_kept" not in report["invariants"]  # reported, not judged
    assert report["acked_lost_to_failover"] >= 0


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_build_that_takes_unconfirmed_commits_as_acknowledged_fails_the_drill(
    tmp_path: Path,
) -> None:
    # The broken build is made here, not in the product: a sitecustomize that every
    # process of the drill loads ignores what WAIT counted.
    broken = str(Path(__file__).with_name("unacked"))
    path = os.pathsep.join(p for p in (broken, os.environ.get("PYTHONPATH", "")) if p)
    report = _drill(tmp_path, "--min-replicas-ack", "1", env={"PYTHONPATH": path})
    assert report["verdict"] == "fail"
    assert report["invariants"]["failover_acks_kept"]["status"] == "fail"
    assert report["acked_lost_to_failover"] >= 1
