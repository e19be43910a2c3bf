"""What the drill's checker tests share: a drill record to judge synthetic evidence on."""

from __future__ import annotations

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
