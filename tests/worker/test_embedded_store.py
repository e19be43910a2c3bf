"""The embedded default: a read-only command never starts a server that outlives it. It
uses the embedded Redis a worker started, or refuses in one line saying how to get one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ratchet.errors import ConfigurationError
from ratchet.fleet.context import (
    Fleet,
    ensure_embedded_redis,
    running_embedded_redis,
    stop_embedded_redis,
)
from ratchet.fleet.settings import Settings
from tests.worker.processes import redis_servers_under

pytestmark = pytest.mark.slow

RATCHET = [sys.executable, "-m", "ratchet.cli.entry"]


def clean_env(tmp_path: Path) -> dict[str, str]:
    """No RATCHET_* variable, a fresh HOME; the state folder is ``<tmp>/.ratchet``."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("RATCHET_")}
    env.update(HOME=str(home), RATCHET_LOG_LEVEL="WARNING")
    return env


def ratchet(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*RATCHET, *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture
def embedded(tmp_path: Path) -> Iterator[Path]:
    """The embedded server of ``<tmp>/.ratchet``, started as ``ratchet worker`` starts it."""
    state = tmp_path / ".ratchet"
    ensure_embedded_redis(state)
    try:
        yield state
    finally:
        stop_embedded_redis(state)


@pytest.mark.parametrize(
    "command", [["runs"], ["show", "r-1"], ["runs", "--json"], ["console", "--port", "0"]]
)
def test_a_read_only_command_with_no_store_refuses_in_one_line_and_starts_no_server(
    tmp_path: Path,
    command: list[str],
) -> None:
    done = ratchet(*command, env=clean_env(tmp_path), cwd=tmp_path)
    assert done.returncode == 2
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("ratchet: error: no store configured: set RATCHET_REDIS_URL")
    assert "ratchet worker" in lines[0]
    assert not (tmp_path / ".ratchet" / "redis.json").exists()
    assert not (tmp_path / ".ratchet" / "redis").exists()
    assert redis_servers_under(tmp_path) == []


def test_listing_keys_with_no_store_starts_no_server(tmp_path: Path) -> None:
    done = ratchet("keys", "list", "--json", env=clean_env(tmp_path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert set(json.loads(done.stdout)) == {"checkpoint", "approvers", "reviewers"}
    assert redis_servers_under(tmp_path) == []


def test_a_read_only_command_uses_the_embedded_server_a_worker_started(
    embedded: Path,
    tmp_path: Path,
) -> None:
    info = json.loads((embedded / "redis.json").read_text())
    servers = redis_servers_under(tmp_path)
    assert servers == [info["pid"]]
    done = ratchet("runs", "--json", env=clean_env(tmp_path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["runs"] == []
    assert json.loads((embedded / "redis.json").read_text()) == info
    assert redis_servers_under(tmp_path) == servers  # the same one, no other


def test_connect_starts_the_embedded_server_only_when_asked(tmp_path: Path) -> None:
    state = tmp_path / ".ratchet"
    settings = Settings(state_dir=state, verifier_sandbox="none")
    with pytest.raises(ConfigurationError) as caught:
        Fleet.connect(settings)
    assert caught.value.field == "redis_url"
    assert running_embedded_redis(state) is None
    assert redis_servers_under(tmp_path) == []
    try:
        fleet = Fleet.connect(settings, start_embedded=True)  # what worker processes do
        assert fleet.epoch is not None  # the embedded store initialised its epoch
        assert running_embedded_redis(state) == fleet.url
        assert Fleet.connect(settings).url == fleet.url  # now read-only use finds it
    finally:
        stop_embedded_redis(state)
    assert running_embedded_redis(state) is None
