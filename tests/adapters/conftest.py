from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ratchet.chaos.orders import OrdersService, RunningService, serve
from ratchet.testing.memory import ManualClock


class ServiceBox:
    """A reference orders service that tests can stop, restart and reset."""

    def __init__(self, db: Path, clock: ManualClock) -> None:
        self.db = db
        self.clock = clock
        self.offset = 0
        self.running: RunningService | None = None
        self.port = 0

    def now(self) -> int:
        return self.clock.now() + self.offset

    def start(self, **service_options: object) -> RunningService:
        service = OrdersService(self.db, clock=self.now, **service_options)  # type: ignore[arg-type]
        self.running = serve(service, port=self.port)
        self.port = self.running.port
        return self.running

    def stop(self) -> None:
        if self.running is not None:
            self.running.stop()
            self.running = None

    def restart(self, **service_options: object) -> RunningService:
        self.stop()
        return self.start(**service_options)

    def reset(self) -> RunningService:
        """Wipe the service's database: a new service identity on the same address."""
        self.stop()
        for suffix in ("", "-wal", "-shm"):
            Path(str(self.db) + suffix).unlink(missing_ok=True)
        return self.start()

    @property
    def url(self) -> str:
        if self.running is None:
            raise AssertionError("service is not running")
        return self.running.url

    @property
    def service(self) -> OrdersService:
        if self.running is None:
            raise AssertionError("service is not running")
        return self.running.service

    def effects(self) -> int:
        return int(self.service.stats()[1]["effects"])


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def orders(tmp_path: Path, clock: ManualClock) -> Iterator[ServiceBox]:
    box = ServiceBox(tmp_path / "orders.sqlite3", clock)
    box.start()
    yield box
    box.stop()
