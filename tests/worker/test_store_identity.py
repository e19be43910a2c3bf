"""A lost or evicting store is detected, never run on: every command and worker checks the
store's epoch; workers and submit refuse an evicting maxmemory-policy; a store out of
memory is a typed StoreFullError."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from ratchet.errors import ConfigurationError, StoreEpochError, StoreFullError
from ratchet.fleet.context import Fleet
from ratchet.fleet.runs import RunDocument
from ratchet.fleet.settings import Settings
from ratchet.leasing import RedisStore
from ratchet.ops import submit
from ratchet.redis_server import RedisServer
from ratchet.worker.job import execute_run
from tests.worker.conftest import CHECKPOINT_KEY_HEX

MakeWorkspace = Callable[..., tuple[Path, RunDocument]]


def test_a_wiped_store_is_refused_by_submit_and_by_a_running_worker(
    fleet: Fleet, settings: Settings, workspace: MakeWorkspace, redis_server: RedisServer
) -> None:
    _root, document = workspace()
    run_id = submit(fleet, document)
    redis_server.client().flushall()  # a restart without its AOF: everything is gone
    with pytest.raises(StoreEpochError) as err:
        Fleet.connect(settings)  # any command: submit, runs, show ...
    assert err.value.reason == "missing"
    report = execute_run(fleet, run_id, owner="w-wiped")  # a worker started before
    assert report.outcome == "store_epoch_changed"
    # Initialising it again is a deliberate act; the worker that started on the old
    # store still refuses (another epoch), a new one accepts the new store.
    RedisStore(redis_server.client()).identity.init_epoch()
    assert execute_run(fleet, run_id, owner="w-old").outcome == "store_epoch_changed"
    assert Fleet.connect(settings).epoch != fleet.epoch


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-ttl", "allkeys-random"])
def test_workers_and_submit_refuse_an_evicting_redis(
    settings: Settings, workspace: MakeWorkspace, redis_server: RedisServer, policy: str
) -> None:
    client = redis_server.client()
    client.config_set("maxmemory-policy", policy)
    try:
        fleet = Fleet.connect(settings)
        _root, document = workspace()
        with pytest.raises(ConfigurationError, match=policy):
            submit(fleet, document, run_id=f"r-evict-{policy}")
        with pytest.raises(ConfigurationError, match="noeviction"):
            fleet.check_eviction_policy()
    finally:
        client.config_set("maxmemory-policy", "noeviction")
    Fleet.connect(settings).check_eviction_policy()


def test_the_commands_say_in_one_line_what_happened_to_the_store(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATCHET_")}
    env.update(RATCHET_REDIS_URL=redis_server.url, RATCHET_CHECKPOINT_KEY=CHECKPOINT_KEY_HEX)

    def ratchet(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "ratchet.cli.entry", *args],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    redis_server.client().delete("ratchet:store:epoch")
    listed = ratchet("runs")
    assert listed.returncode == 2
    assert listed.stderr.startswith("ratchet: error:") and "ratchet store init" in listed.stderr
    assert len(listed.stderr.strip().splitlines()) == 1
    made = ratchet("store", "init", "--json")
    assert made.returncode == 0, made.stderr
    assert '"created": true' in made.stdout
    assert ratchet("runs").returncode == 0


def test_a_store_out_of_memory_is_a_typed_refusal(tmp_path: Path) -> None:
    from redis.exceptions import ResponseError

    with RedisServer(
        tmp_path / "redis", extra_args=["--maxmemory", "2mb", "--maxmemory-policy", "noeviction"]
    ) as server:
        client = server.client()
        store = RedisStore(client)
        store.identity.init_epoch()
        with pytest.raises(ResponseError, match="maxmemory"):  # fill it up, bounded
            for index in range(10_000):
                client.set(f"fill:{index}", b"x" * 4096)
        with pytest.raises(StoreFullError) as err:
            store.create_run(
                "r-oom", task_id="t", env_instance_id="e", scenario=b"{}", checkpoint=b"x" * 2048
            )
        assert err.value.reason == "oom"
        assert store.identity.read_epoch() is not None  # reads still work


def test_a_task_resubmitted_on_a_wiped_store_cannot_write_to_its_workspace_again(
    fleet: Fleet, settings: Settings, redis_server: RedisServer, tmp_path: Path
) -> None:
    """The adapters witness the store: a workspace binds the epoch of the first fence it
    sees, so a store wiped and initialised again (a new epoch) cannot have a resubmitted
    task write there a second time."""
    from ratchet.adapters.workspace import WorkspaceAdapter
    from ratchet.demo.examples import greeting_document, make_greeting_workspace

    root = make_greeting_workspace(tmp_path / "ws")
    document = greeting_document(root, runner="python")
    first = submit(fleet, document)
    assert execute_run(fleet, first, owner="w-1").phase == "completed"
    redis_server.client().flushall()
    RedisStore(redis_server.client()).identity.init_epoch()  # someone initialised it again
    fresh = Fleet.connect(settings)  # workers restarted on the new store
    second = submit(fresh, document)
    report = execute_run(fresh, second, owner="w-2")
    assert report.outcome == "restore_refused"
    incident = fresh.store.records.incidents(second)[0]
    assert "another store" in incident["message"]
    with WorkspaceAdapter(root, ["app.py"]) as adapter:
        assert adapter.effects == 1  # the first run's write, once


def test_the_orders_service_binds_one_store_epoch(tmp_path: Path) -> None:
    from ratchet.adapters import HttpAdapter
    from ratchet.chaos.orders import OrdersService, serve
    from ratchet.errors import FenceRejectedError
    from ratchet.runtime import Fence

    with serve(OrdersService(tmp_path / "orders.sqlite3")) as running:
        adapter = HttpAdapter(running.url)
        adapter.raise_fence(
            Fence(
                run_id="r-1",
                lease_version=1,
                state_version=1,
                store_epoch="ep-aaaaaaaaaaaaaaaaaaaaaaaa",
            )
        )
        with pytest.raises(FenceRejectedError):
            adapter.raise_fence(
                Fence(
                    run_id="r-2",
                    lease_version=1,
                    state_version=1,
                    store_epoch="ep-bbbbbbbbbbbbbbbbbbbbbbbb",
                )
            )
        adapter.raise_fence(
            Fence(
                run_id="r-3",
                lease_version=1,
                state_version=1,
                store_epoch="ep-aaaaaaaaaaaaaaaaaaaaaaaa",
            )
        )
