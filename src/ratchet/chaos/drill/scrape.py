"""Scrape the drill's workers' Prometheus metrics while the drill runs.

Each worker process the drill starts serves its own ``/metrics`` on a loopback port from a
block the drill chose (``RATCHET_METRICS_PORT`` + the worker's index, see
:mod:`ratchet.fleet.metrics`). The drill scrapes every live, running worker on every tick
of its main loop (each request bounded by a short timeout) and keeps each worker's last
successful scrape: counters only grow, so the last scrape of a worker that was later killed
still counts everything it did up to then. What it did after its last scrape is lost; the
checker says for how many workers that may be the case.
"""

from __future__ import annotations

import http.client
import random
import socket
import time
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from ratchet.errors import ConfigurationError

__all__ = ["COUNTERS", "MetricsWatch", "Scrape", "free_port_block", "scrape"]

#: The counters the drill reads, without the ``_total`` suffix the exposition adds.
COUNTERS = (
    "ratchet_leases_acquired",
    "ratchet_leases_taken_over",
    "ratchet_stale_commits_refused",
    "ratchet_stale_adapter_writes_refused",
    "ratchet_reaper_requeues",
)

_TIMEOUT_S = 0.5


def _block_free(base: int, size: int) -> bool:
    socks: list[socket.socket] = []
    try:
        for port in range(base, base + size):
            sock = socket.socket()
            socks.append(sock)
            sock.bind(("127.0.0.1", port))
    except OSError:
        return False
    finally:
        for sock in socks:
            sock.close()
    return True


def free_port_block(size: int, *, rng: random.Random | None = None) -> int:
    """A base port with ``size`` consecutive free loopback ports.

    Tried first below the usual ephemeral range (32768+), where outgoing connections (the
    workers' own Redis and HTTP clients) do not take ports from under the block; then
    anywhere the kernel hands out. Raises ConfigurationError when no block is free.
    """
    pick = rng or random.Random()  # noqa: S311 - a port, not a secret
    for _ in range(40):
        base = pick.randrange(20000, 32768 - size)
        if _block_free(base, size):
            return base
    for _ in range(40):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = int(probe.getsockname()[1])
        if base + size < 65536 and _block_free(base, size):
            return base
    raise ConfigurationError("no block of free loopback ports for worker metrics", size=size)


def scrape(port: int, *, timeout_s: float = _TIMEOUT_S) -> dict[str, float] | None:
    """The ``ratchet_`` counters served on ``127.0.0.1:port``, summed per name and label
    set (``name|label=value``); None when the endpoint does not answer in time."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s) as reply:
            text = reply.read().decode("utf-8", "replace")
    except (OSError, ValueError, http.client.HTTPException):
        return None  # refused, timed out, or cut short by a kill: not a scrape
    values: dict[str, float] = {}
    seen: set[str] = set()
    try:
        for family in text_string_to_metric_families(text):
            if family.name not in COUNTERS:
                continue
            seen.add(family.name)
            for sample in family.samples:
                if not sample.name.endswith("_total"):
                    continue  # the _created timestamps
                key = sample.name + "".join(f"|{k}={v}" for k, v in sorted(sample.labels.items()))
                values[key] = float(sample.value)
    except ValueError:
        return None  # a reply cut short: not a scrape
    if seen != set(COUNTERS) or "ratchet_leases_acquired_total" not in values:
        return None  # not every counter served: a process shutting down, not a scrape
    return values


@dataclass
class Scrape:
    """One worker's metrics endpoint and its last successful scrape."""

    pid: int
    port: int
    values: dict[str, float] | None = None
    started_at: float | None = None  # when the last successful scrape's request began
    scrapes: int = 0
    failures: int = 0

    def total(self, name: str, **labels: str) -> float:
        """``name`` summed over every label set matching ``labels``."""
        if self.values is None:
            return 0.0
        want = [f"|{k}={v}" for k, v in labels.items()]
        return sum(
            v
            for key, v in self.values.items()
            if (key == name or key.startswith(name + "|")) and all(w in key for w in want)
        )


@dataclass
class MetricsWatch:
    """Every drill worker's endpoint by pid, and what each one served last."""

    base_port: int
    block: int
    workers: dict[int, Scrape] = field(default_factory=dict)
    rounds: int = 0
    spent_s: float = 0.0

    def port_for(self, busy: set[int]) -> int:
        """A port of the block no live worker holds. Raises ConfigurationError."""
        for port in range(self.base_port, self.base_port + self.block):
            if port not in busy:
                return port
        raise ConfigurationError(
            "every metrics port of the drill's block is taken", block=self.block
        )

    def add(self, pid: int, port: int) -> None:
        self.workers[pid] = Scrape(pid, port)

    def scrape(self, pids: list[int]) -> None:
        """Scrape each worker in ``pids`` once (each bounded by the timeout)."""
        began = time.monotonic()
        self.rounds += 1
        for pid in pids:
            entry = self.workers.get(pid)
            if entry is None:
                continue
            started = time.time()
            got = scrape(entry.port)
            if got is None:
                entry.failures += 1
                continue
            entry.values, entry.started_at = got, started
            entry.scrapes += 1
        self.spent_s += time.monotonic() - began

    @property
    def scraped(self) -> list[Scrape]:
        return [w for w in self.workers.values() if w.values is not None]

    def total(self, name: str, **labels: str) -> int:
        """``name`` summed over every worker's last successful scrape."""
        return round(sum(w.total(name, **labels) for w in self.workers.values()))

    def last_scrape(self, pid: int) -> float | None:
        entry = self.workers.get(pid)
        return entry.started_at if entry is not None else None
