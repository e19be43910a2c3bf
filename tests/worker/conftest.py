"""Fixtures for worker tests: a real redis-server, settings pointing at it, workspaces."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from ratchet.demo.examples import greeting_document, make_greeting_workspace
from ratchet.fleet.context import Fleet
from ratchet.fleet.runs import RunDocument
from ratchet.fleet.settings import Settings
from ratchet.leasing import RedisStore
from ratchet.redis_server import RedisServer
from tests.conftest import test_sandbox_mode
from tests.tools.plugins import installed  # noqa: F401 - a fixture of these tests

CANARY_KEY = "c0ffee" * 8  # 48 hex chars = 24 bytes... padded below to 32 bytes
CHECKPOINT_KEY_HEX = (CANARY_KEY + "a1" * 32)[:64]


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    RedisStore(server.client()).identity.init_epoch()  # what `ratchet store init` does
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def settings(redis_server: RedisServer, tmp_path: Path) -> Settings:
    return Settings(
        redis_url=SecretStr(redis_server.url),
        state_dir=tmp_path / "state",
        queue=f"q-{secrets.token_hex(4)}",
        lease_ttl_ms=1500,
        renew_interval_ms=300,
        stall_timeout_ms=20_000,
        reaper_interval_ms=200,
        job_timeout_s=600,
        checkpoint_key=SecretStr(CHECKPOINT_KEY_HEX),
        verifier_sandbox=test_sandbox_mode(),
    )


@pytest.fixture
def fleet(settings: Settings) -> Fleet:
    return Fleet.connect(settings)


@pytest.fixture
def workspace(tmp_path: Path) -> Callable[..., tuple[Path, RunDocument]]:
    counter = {"n": 0}

    def make(**kw: Any) -> tuple[Path, RunDocument]:
        counter["n"] += 1
        root = make_greeting_workspace(tmp_path / f"ws-{counter['n']}")
        return root, greeting_document(root, **kw)

    return make
