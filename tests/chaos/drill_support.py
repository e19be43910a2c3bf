"""What the drill tests share: a drill record to judge synthetic evidence on, and the
`ratchet drill` command run as a subprocess."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from ratchet.chaos.drill.cluster import RedisChoice
from ratchet.chaos.drill.runner import DrillOptions, DrillRecord
from ratchet.chaos.drill.schedule import FAULTS


def drill_record(tmp_path: Path, **fields: Any) -> DrillRecord:
    """A record of a drill that requested every fault, on a Redis 7.0 with no rollback
    support, holding runs ``r1`` and ``r2`` unless ``runs`` says otherwise; ``fields`` set
    the record's attributes."""
    rec = DrillRecord(
        folder=tmp_path,
        options=DrillOptions(faults=frozenset(FAULTS)),
        redis=RedisChoice("redis-server", (7, 0, 0), None, None),
    )
    for name, value in fields.items():
        setattr(rec, name, value)
    rec.runs = rec.runs or {"r1": 0, "r2": 1}
    return rec


RATCHET = str(Path(sys.executable).with_name("ratchet"))


def run_drill(
    folder: Path, *args: str, env: dict[str, str] | None = None, timeout_s: float = 420
) -> tuple[int, dict[str, Any]]:
    """``ratchet drill ARGS --json --dir FOLDER`` (the folder emptied first): its exit code
    and its report."""
    shutil.rmtree(folder, ignore_errors=True)
    done = subprocess.run(
        [RATCHET, "drill", *args, "--json", "--dir", str(folder)],
        capture_output=True,
        timeout=timeout_s,
        check=False,
        env={**os.environ, **(env or {})},
    )
    assert done.stdout, done.stderr.decode(errors="replace")[-2000:]
    report: dict[str, Any] = json.loads(done.stdout)
    return done.returncode, report


def topology_profile(topology: str, *args: str) -> list[str]:
    """The CI profile of the drill on another topology (replicated, cluster): two workers,
    twelve runs, the worker faults and redis-kill, seed 1."""
    return [
        "--topology",
        topology,
        "--workers",
        "2",
        "--runs",
        "12",
        "--lease-ttl",
        "1",
        "--faults",
        "kill,pause,redis-kill",
        "--seed",
        "1",
        *args,
    ]
