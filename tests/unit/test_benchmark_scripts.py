"""The benchmark scripts run and report what they promise (no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_checkpoint_cost_quick_json_reports_the_four_ratios_as_positive_numbers() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "checkpoint_cost.py"), "--quick", "--json"],
        capture_output=True, text=True, check=False, timeout=110, cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    for key in ("sign_ratio_4k", "sign_ratio_64k", "restore_ratio_4k", "restore_ratio_64k",
                "size_4k", "size_64k"):
        value = report[key]
        assert isinstance(value, int | float) and not isinstance(value, bool), key
        assert value > 0, key
    assert report["size_4k"] < report["size_64k"]
