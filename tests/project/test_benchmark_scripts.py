"""The benchmark scripts run and report what they promise (no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_checkpoint_cost_quick_json_reports_the_four_ratios_as_positive_numbers() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "checkpoint_cost.py"), "--quick", "--json"],
        capture_output=True,
        text=True,
        check=False,
        timeout=110,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    for key in (
        "sign_ratio_4k",
        "sign_ratio_64k",
        "restore_ratio_4k",
        "restore_ratio_64k",
        "size_4k",
        "size_64k",
    ):
        value = report[key]
        assert isinstance(value, int | float) and not isinstance(value, bool), key
        assert value > 0, key
    assert report["size_4k"] < report["size_64k"]


def _run_quick(script: str, timeout_s: float) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), "--quick", "--json"],
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout_s,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout)
    assert isinstance(report, dict)
    return report


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def _rate_or_reason(report: dict[str, Any], peer: str, rate_key: str, ratio_key: str) -> None:
    """A peer that ran reports a positive rate and ratio; one that could not, null and a
    reason."""
    rate, ratio = report[rate_key], report[ratio_key]
    if rate is None:
        reason = report[f"{peer}_reason"]
        assert isinstance(reason, str) and reason, peer
        assert ratio is None, peer
    else:
        assert _positive(rate), peer
        assert _positive(ratio), peer


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_durable_steps_quick_json_reports_every_contender_as_a_rate_or_a_reason() -> None:
    # DBOS and LangGraph come with the ``bench`` extra and DBOS needs PostgreSQL; without
    # them the script must still succeed, reporting null with the reason.
    report = _run_quick("durable_steps.py", 200)
    assert _positive(report["ratchet_steps_per_s"])
    assert report["ratchet_reason"] is None
    assert _positive(report["ratchet_commits_per_step"])
    assert _positive(report["ratchet_checkpoint_bytes_end_of_run"])
    assert _positive(report["payload_bytes"])
    # Counted, not timed: two fenced commits per write either way; coalesced, a write's
    # receipt commit shares the next write's round trip (20 writes: 21 round trips).
    assert report["ratchet_commits_per_step"] == report["ratchet_separate_commits_per_step"] == 2.0
    assert report["ratchet_separate_round_trips_per_step"] == 2.0
    assert report["ratchet_round_trips_per_step"] == 1.05
    assert _positive(report["ratchet_separate_steps_per_s"])
    for peer in ("dbos", "langgraph"):
        _rate_or_reason(report, peer, f"{peer}_steps_per_s", f"ratio_vs_{peer}")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fleet_steps_quick_json_reports_ratchet_and_each_peer_as_a_rate_or_a_reason() -> None:
    # The peers come with the ``bench`` extra and need PostgreSQL; without them the script
    # must still succeed, reporting null with the reason.
    report = _run_quick("fleet_steps.py", 200)
    assert report["processes"] == 4
    for key in (
        "ratchet_fleet_steps_per_s",
        "ratchet_single_run_steps_per_s",
        "floor_single_run_steps_per_s",
        "ratchet_single_run_fraction_of_floor",
    ):
        assert _positive(report[key]), key
    assert report["ratchet_reason"] is None
    assert report["ratchet_fleet_processes"] == 4
    assert report["ratchet_commits_per_step"] == 2.0
    rounds = report["ratchet_fleet_steps_per_s_rounds"]
    assert isinstance(rounds, list) and len(rounds) == report["rounds"]
    for peer in ("dbos", "langgraph_postgres"):
        _rate_or_reason(report, peer, f"{peer}_fleet_steps_per_s", f"ratio_vs_{peer}_fleet")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_takeover_quick_json_reports_percentiles_of_real_takeovers() -> None:
    report = _run_quick("takeover.py", 200)
    kills = report["kills"]
    assert isinstance(kills, int) and kills >= 1
    for key in ("lease_ttl_ms", "reaper_interval_ms", "p50_ms", "p99_ms"):
        assert _positive(report[key]), key
    p50, p99 = report["p50_ms"], report["p99_ms"]
    assert isinstance(p50, int) and isinstance(p99, int) and p50 <= p99
    assert report["duplicate_effects"] == 0


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fleet_views_quick_json_reports_every_view_at_every_size_as_a_ratio() -> None:
    report = _run_quick("fleet_views.py", 200)
    sizes = report["sizes"]
    assert isinstance(sizes, list) and len(sizes) == 2 and sizes[0] < sizes[1]
    results = report["results"]
    growth = report["growth"]
    assert isinstance(results, dict) and isinstance(growth, dict)
    for view in ("list_page", "next_page", "review_queue", "metrics_scrape"):
        for size in sizes:
            row = results[str(size)]
            assert _positive(row["bare_ms"]) and _positive(row[f"{view}_ms"]), (view, size)
            assert _positive(row[f"{view}_ratio"]), (view, size)
        assert _positive(growth[view]), view
    assert isinstance(report["goal_met"], bool)


def test_scale_quick_json_reports_the_step_restore_and_view_ratios_with_their_bounds() -> None:
    """The smoke profile of benchmarks/scale.py (the takeover and short-run sections start
    worker processes and run in the full benchmark only)."""
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "scale.py"),
            "--quick",
            "--json",
            "--only",
            "commit,views",
        ],
        capture_output=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
    report = json.loads(done.stdout)
    for key in (
        "commit_ratio_step5000_vs_10",
        "restore_ratio_long_vs_short",
        "views_ratio_100k_vs_1k",
    ):
        assert _positive(report[key]), (key, report[key])
        assert report["bounds"][key] > 0 and isinstance(report["bounds_met"][key], bool)
    assert report["views_worst"] in report["views_growth"]
    assert report["long_run_steps"] >= 200


def test_scale_refuses_an_unknown_section_in_one_line() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "scale.py"), "--only", "commit,nope"],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.decode().strip().splitlines()[-1].endswith("unknown section(s): nope")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_revisions_quick_json_reports_both_trees_and_their_ratio_for_each_effect() -> None:
    """The per-step cost of the working tree against a base revision (here the last
    commit, checked out with git worktree) for both write effects."""
    report = _run_quick("revisions.py", 220)
    assert report["base"] == "HEAD"
    assert [row["effect"] for row in report["results"]] == ["ledger", "workspace"]
    for row in report["results"]:
        assert _positive(row["steps_per_s"]["old"]) and _positive(row["steps_per_s"]["new"])
        assert _positive(row["ratio_new_vs_old"])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_tool_ledger_quick_json_reports_both_ledgers_and_their_ratio() -> None:
    """A declared tool's call with its ledger in the store against the file ledger."""
    report = _run_quick("tool_ledger.py", 220)
    assert set(report["calls_per_s"]) == {"file", "store"}
    assert all(_positive(v) for v in report["calls_per_s"].values())
    assert _positive(report["ratio_store_vs_file"])
