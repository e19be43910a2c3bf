"""``ratchet demo --hosts``: runs on a git workspace finish on another host after theirs
was lost right after a push, with one commit per write on the remote."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ratchet.demo.hosts import run_hosts_demo

pytestmark = pytest.mark.slow


def test_every_run_finishes_on_the_surviving_host_with_one_commit_per_write() -> None:
    report = run_hosts_demo(runs=2, workers=2, lease_ttl_ms=1000)
    assert report.ok, report.as_dict()
    assert report.lost_after_push  # host a died with a push on the remote, unrecorded
    assert report.continued_on_survivor == report.runs == report.completed
    assert all(counts == [1] for counts in report.commits_per_write.values())


def test_the_cli_runs_the_hosts_demo_and_prints_its_report() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ratchet.cli.entry", "demo", "--hosts", "--runs", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(done.stdout)
    assert data["ok"] and data["duplicate_commits"] == 0 and data["runs"] == 2
