"""What a drill is asked to do, and what it records while doing it.

The drill (:mod:`ratchet.chaos.drill.runner`) fills a :class:`DrillRecord`; the checker
(:mod:`ratchet.chaos.drill.checker`) judges it with the stores and the logs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ratchet.chaos.drill.cluster import RedisChoice
from ratchet.chaos.drill.schedule import FAULTS
from ratchet.chaos.drill.scrape import MetricsWatch

__all__ = ["DrillOptions", "DrillRecord"]


@dataclass
class DrillOptions:
    workers: int = 3
    runs: int = 24
    lease_ttl_s: float = 1.0
    duration_s: float = 240.0
    faults: frozenset[str] = frozenset(FAULTS)
    seed: int = 1
    folder: Path | None = None
    think_ms: int = 150
    redis_server: str | None = None
    max_in_flight: int | None = None
    # "replicated": a primary, a replica and Sentinels; redis-kill is a failover there
    # (ratchet.chaos.drill.replicated). "cluster": three masters and the queue's own Redis;
    # redis-kill is a master's crash and restart (ratchet.chaos.drill.clustered).
    # min_replicas_ack: the fleet's acknowledgement rule.
    topology: str = "single"
    min_replicas_ack: int = 0

    @property
    def ttl_ms(self) -> int:
        return max(50, round(self.lease_ttl_s * 1000))

    @property
    def settle_bound_s(self) -> float:
        """How long after injection stops a run may still be unsettled before it counts as
        stuck: a takeover (TTL + reaper tick) several times over, plus the run's own work."""
        return max(20.0, 15 * self.lease_ttl_s)


@dataclass
class DrillRecord:
    """What the runner saw and did; the checker reads it with the logs and the stores."""

    folder: Path
    options: DrillOptions
    redis: RedisChoice
    runs: dict[str, int] = field(default_factory=dict)
    redis_kills: list[float] = field(default_factory=list)
    failovers: list[dict[str, Any]] = field(default_factory=list)  # replicated topology
    master_kills: list[dict[str, Any]] = field(default_factory=list)  # cluster topology
    rollback: dict[str, Any] | None = None
    rollback_skipped: str | None = None
    duplicate_enqueues: list[dict[str, Any]] = field(default_factory=list)
    cancels: list[dict[str, Any]] = field(default_factory=list)  # operator cancels posted
    pauses: list[dict[str, Any]] = field(default_factory=list)
    deaths: list[dict[str, object]] = field(default_factory=list)
    specs_used: int = 0
    workers: list[dict[str, Any]] = field(default_factory=list)
    started_at: float = 0.0
    injection_ended_at: float = 0.0
    finished_at: float = 0.0
    final: dict[str, tuple[str, str]] = field(default_factory=dict)  # run -> (status, phase)
    errors: list[str] = field(default_factory=list)
    metrics: MetricsWatch | None = None
    # Store faults: each one injected (kind, times, what it saw), and those skipped (why).
    store_faults: list[dict[str, Any]] = field(default_factory=list)
    store_skipped: dict[str, str] = field(default_factory=dict)
    corrupted: dict[str, dict[str, Any]] = field(default_factory=dict)  # run -> corruption
    twins: list[int] = field(default_factory=list)  # pids started with one worker name
    wipe: dict[str, Any] | None = None
    # Network faults (ratchet.chaos.drill.netfaults): each injected, and those skipped.
    net_faults: list[dict[str, Any]] = field(default_factory=list)
    net_skipped: dict[str, str] = field(default_factory=dict)
    # Workspace faults (ratchet.chaos.drill.workspacefaults): each injected, and skipped.
    workspace_faults: list[dict[str, Any]] = field(default_factory=list)
    workspace_skipped: dict[str, str] = field(default_factory=dict)
    # Approvers and skewed clocks (ratchet.chaos.drill.humans): what was signed and posted.
    humans: dict[str, Any] = field(default_factory=dict)
    # Reviewers (ratchet.chaos.drill.reviewers): conflicts planted, decisions signed.
    reviews: dict[str, Any] = field(default_factory=dict)

    def faults_of(self, kind: str) -> list[dict[str, Any]]:
        return [f for f in self.store_faults if f.get("kind") == kind]

    @property
    def fired_log(self) -> Path:
        return self.folder / "failpoints.jsonl"

    @property
    def events_dir(self) -> Path:
        return self.folder / "events"
