"""What the multi-host drill is asked to do, and what it records while doing it.

The drill (:mod:`ratchet.chaos.drill.hosts`) fills a :class:`HostDrillRecord`; the checker
(:mod:`ratchet.chaos.drill.hostchecks`) judges it with the stores and the logs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ratchet.errors import ConfigurationError

__all__ = [
    "ENVIRONMENTS",
    "GIT_HOST_FAULTS",
    "HOST_FAULTS",
    "HostDrillOptions",
    "HostDrillRecord",
    "RunInfo",
    "host_name",
    "parse_host_faults",
]

#: Every fault kind ``ratchet drill --hosts N --faults`` accepts (``all``: every one).
#: ``kill``: SIGKILL at the crash windows on every host; ``host-loss`` / ``host-return``:
#: a host lost whole and brought back with its disk; ``cancel`` (then the same task
#: submitted again), ``retry``, ``rebaseline``: the operator's paths; ``misroute``: jobs put
#: on another host's queue and on the shared one (a stale routing hint).
HOST_FAULTS = ("kill", "host-loss", "host-return", "cancel", "retry", "rebaseline", "misroute")
#: The faults of ``--environment git`` (``all``: every one). ``kill`` aims at the git
#: workspace's push (``git_before_push`` / ``git_after_push``) instead of the folder's
#: journal; ``git-server-kill``: the git server's process group SIGKILLed while a push is
#: in flight, restarted on its port. No ``rebaseline`` (a disk changed by hand) and no
#: ``misroute`` (a host's queue): a git run lives on no host's disk and has no host queue.
GIT_HOST_FAULTS = ("kill", "host-loss", "host-return", "cancel", "retry", "git-server-kill")
#: Where the runs' files live: a folder on their host's disk, or a branch of a git remote.
ENVIRONMENTS = ("folder", "git")
#: Faults that act on the runs of a lost host.
_NEED_LOSS = ("host-return", "retry", "rebaseline")


def parse_host_faults(text: str, environment: str = "folder") -> frozenset[str]:
    """``all`` or a comma list of :data:`HOST_FAULTS` (:data:`GIT_HOST_FAULTS` with
    ``environment`` git). Raises ConfigurationError (an unknown environment or name, or a
    fault that needs a host lost and brought back without it)."""
    if environment not in ENVIRONMENTS:
        raise ConfigurationError(
            f"--environment must be one of {', '.join(ENVIRONMENTS)}", field="environment"
        )
    known = GIT_HOST_FAULTS if environment == "git" else HOST_FAULTS
    names = {part.strip() for part in text.split(",") if part.strip()}
    if not names:
        raise ConfigurationError("--faults needs at least one fault", field="faults")
    if "all" in names:
        return frozenset(known)
    unknown = sorted(names - set(known))
    if unknown:
        raise ConfigurationError(
            f"faults {unknown} are not faults of --hosts with --environment {environment}; "
            f"those are: {', '.join(known)}",
            field="faults",
        )
    if "host-loss" in names and "host-return" not in names:
        raise ConfigurationError(
            "host-loss needs host-return: a host lost for good strands its runs",
            field="faults",
        )
    lacking = sorted(n for n in names if n in _NEED_LOSS and "host-loss" not in names)
    if lacking:
        raise ConfigurationError(f"faults {lacking} need host-loss", field="faults")
    return frozenset(names)


def host_name(number: int) -> str:
    """The host name (and ``RATCHET_HOST``, by its UTS namespace) of host ``number``."""
    return f"drill-host-{number + 1}"


@dataclass
class HostDrillOptions:
    hosts: int = 2
    workers: int = 2  # per host
    runs: int = 16
    lease_ttl_s: float = 1.0
    duration_s: float = 240.0
    faults: frozenset[str] = frozenset(HOST_FAULTS)
    seed: int = 1
    folder: Path | None = None
    think_ms: int = 150
    redis_server: str | None = None
    host_losses: int | None = None  # None: every host but one, at least one
    environment: str = "folder"  # folder: a workspace on its host's disk; git: a branch

    @property
    def ttl_ms(self) -> int:
        return max(50, round(self.lease_ttl_s * 1000))

    @property
    def host_timeout_ms(self) -> int:
        """When a host with no worker reporting in counts as gone: a few reaper ticks
        longer than a worker's restart, so a host whose workers a kill took is not gone."""
        return max(3000, 4 * self.ttl_ms)

    @property
    def settle_bound_s(self) -> float:
        # How long settling waits with nothing moving (it ends as soon as every run
        # ended). A straggler waiting for its host back, a lease to expire and a restarted
        # worker's backoff on a loaded machine went past 30 s with nothing wrong.
        return max(60.0, 20 * self.lease_ttl_s)

    @property
    def losses(self) -> int:
        if "host-loss" not in self.faults:
            return 0
        return self.host_losses if self.host_losses is not None else max(1, self.hosts - 1)

    @property
    def git(self) -> bool:
        """The runs' files live on branches of a git remote (``--environment git``)."""
        return self.environment == "git"

    def check(self) -> None:
        """Raises ConfigurationError for options the drill cannot run."""
        if self.environment not in ENVIRONMENTS:
            raise ConfigurationError(
                f"--environment must be one of {', '.join(ENVIRONMENTS)}", field="environment"
            )
        allowed = GIT_HOST_FAULTS if self.git else HOST_FAULTS
        stray = sorted(self.faults - set(allowed))
        if stray:
            raise ConfigurationError(
                f"faults {stray} do not apply with --environment {self.environment}",
                field="faults",
            )
        if self.hosts < 2:
            raise ConfigurationError("a multi-host drill needs --hosts 2 or more", field="hosts")
        if self.runs < 4 * self.hosts:
            raise ConfigurationError(
                f"--runs must be at least 4 per host ({4 * self.hosts})", field="runs"
            )

    def as_dict(self) -> dict[str, Any]:
        return {
            "hosts": self.hosts,
            "workers_per_host": self.workers,
            "runs": self.runs,
            "lease_ttl_s": self.lease_ttl_s,
            "duration_s": self.duration_s,
            "faults": sorted(self.faults),
            "seed": self.seed,
            "think_ms": self.think_ms,
            "host_losses": self.losses,
            "host_timeout_ms": self.host_timeout_ms,
            "environment": self.environment,
        }

    def host_order(self) -> list[int]:
        """Which host each loss takes, in order (seeded; never the same host twice in a
        row)."""
        rng = random.Random(self.seed * 7919 + 17)  # noqa: S311 - reproducible, not secret
        order: list[int] = []
        while len(order) < self.losses:
            block = list(range(self.hosts))
            rng.shuffle(block)
            if order and block[0] == order[-1]:
                block.reverse()
            order += block
        return order[: self.losses]


@dataclass
class RunInfo:
    """One run of the drill: its task (index: workspace ``ws-<index>`` and orders tenant
    ``t<index>``), the host it was submitted on, and whether it is the task submitted again
    after its first run was cancelled (``again_of``)."""

    run_id: str
    index: int
    host: str
    again_of: str | None = None
    submitted_at: float = 0.0
    submitted_host: str | None = None  # the host the submitter reported (its settings)


@dataclass
class HostDrillRecord:
    folder: Path
    options: HostDrillOptions
    hosts: list[str] = field(default_factory=list)
    runs: dict[str, RunInfo] = field(default_factory=dict)
    started_at: float = 0.0
    injection_ended_at: float = 0.0
    finished_at: float = 0.0
    losses: list[dict[str, Any]] = field(default_factory=list)  # one per host loss
    cancels: list[dict[str, Any]] = field(default_factory=list)  # cancel, then submit again
    misroutes: list[dict[str, Any]] = field(default_factory=list)
    terminal_at: dict[str, float] = field(default_factory=dict)  # first seen ended
    final: dict[str, tuple[str, str]] = field(default_factory=dict)  # (status, phase)
    deaths: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # by host
    fired: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # by host
    workers_started: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # a fault not injected: why
    sandbox: str = ""
    remote_url: str = ""  # --environment git: the shared remote every run's branch is on
    remote_served: str = ""  # how: "git daemon" or "file://"
    server_kills: list[dict[str, Any]] = field(default_factory=list)  # git-server-kill

    @property
    def remote_path(self) -> Path:
        """--environment git: the bare repository, in the drill folder (no host's disk)."""
        return self.folder / "remote" / "drill.git"

    def host_backing(self, host: str) -> Path:
        """The folder that is ``host``'s disk."""
        return self.folder / "hosts" / host

    @property
    def mountpoint(self) -> Path:
        """Where every host sees its own disk."""
        return self.folder / "disk"
