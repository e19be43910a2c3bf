"""The drill on Redis Cluster: three masters with AOF always, the queue on a Redis of its
own, and redis-kill crashing the master that holds the most runs in flight, then
restarting it on its folder while the other masters' runs go on."""

from __future__ import annotations

from pathlib import Path

import pytest

from ratchet.chaos.drill.runner import DrillOptions, _check_topology
from ratchet.errors import ConfigurationError
from tests.chaos.drill_support import run_drill, topology_profile


@pytest.mark.parametrize("faults", [{"redis-pause"}, {"rollback"}, {"partition-store"}])
def test_faults_that_need_one_server_are_refused_on_the_cluster(faults: set[str]) -> None:
    with pytest.raises(ConfigurationError, match="cluster topology runs"):
        _check_topology(DrillOptions(topology="cluster", faults=frozenset(faults)))


def test_the_acknowledgement_rule_is_refused_on_the_cluster() -> None:
    with pytest.raises(ConfigurationError, match="replicated"):
        _check_topology(DrillOptions(topology="cluster", min_replicas_ack=1))


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.timeout(420)
def test_a_master_crashed_and_restarted_mid_drill_loses_no_ack_and_doubles_no_effect(
    tmp_path: Path,
) -> None:
    _, report = run_drill(tmp_path / "drill", *topology_profile("cluster"), timeout_s=400)
    statuses = {k: v["status"] for k, v in report["invariants"].items()}
    assert report["drill_errors"] == []
    assert len(report["master_kills"]) >= 1, report
    assert all(kill["runs_on_it"] for kill in report["master_kills"])  # it hit runs in flight
    assert report["duplicate_effects"] == 0
    assert report["acked_checkpoints"] > 0
    assert "fail" not in statuses.values(), report["invariants"]
    for name in (
        "every_fault_fired",
        "no_acked_checkpoint_lost",
        "no_run_stuck",
        "one_effect_per_intent",
    ):
        assert statuses[name] == "pass", (name, report["invariants"][name])
    assert report["runs_by_status"] == {"terminal": 12}
