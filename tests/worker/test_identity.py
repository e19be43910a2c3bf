"""Lease owner ids are unique per process incarnation: two live processes configured with
one worker name are two owners, and neither can take the other's live lease."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import pytest

from ratchet.fleet.identity import owner_id
from ratchet.fleet.settings import Settings
from ratchet.leasing import LeaseHolder, RedisStore
from ratchet.redis_server import RedisServer


def _child_owner(name: str, out: mp.Queue) -> None:  # type: ignore[type-arg]
    out.put(owner_id(name))


def _child_acquire(url: str, run_id: str, name: str, out: mp.Queue) -> None:  # type: ignore[type-arg]
    store = RedisStore.from_url(url)
    got = store.try_acquire(run_id, owner=owner_id(name), ttl_ms=60_000)
    out.put(("held", got.owner) if isinstance(got, LeaseHolder) else ("acquired", got.owner))


def _spawned(target: object, *args: object) -> object:
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    proc = ctx.Process(target=target, args=(*args, out))  # type: ignore[arg-type]
    proc.start()
    try:
        return out.get(timeout=60)
    finally:
        proc.join(timeout=30)


def test_two_processes_configured_with_one_name_have_different_owner_ids() -> None:
    first, second = _spawned(_child_owner, "same"), _spawned(_child_owner, "same")
    assert isinstance(first, str) and isinstance(second, str)
    assert first != second
    assert first.startswith("same-") and second.startswith("same-")
    assert first.rsplit("-", 1)[-1].isdigit()  # the pid stays last


def test_a_forked_child_draws_its_own_incarnation() -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.write(write, owner_id("same").encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    child = os.read(read, 1024).decode()
    os.close(read)
    parent = owner_id("same")
    assert child.split("-")[1] != parent.split("-")[1]


def test_another_process_with_the_same_name_cannot_take_a_live_lease(
    redis_server: RedisServer, settings: Settings, tmp_path: Path
) -> None:
    from ratchet.demo.examples import greeting_document, make_greeting_workspace
    from ratchet.fleet.context import Fleet
    from ratchet.ops import submit

    fleet = Fleet.connect(settings.model_copy(update={"worker_name": "same"}))
    run_id = submit(
        fleet, greeting_document(make_greeting_workspace(tmp_path / "ws")), run_id="r-same-name"
    )
    mine = fleet.store.acquire(run_id, owner=owner_id("same"), ttl_ms=60_000)
    assert mine is not None
    outcome = _spawned(_child_acquire, redis_server.url, run_id, "same")
    assert outcome == ("held", mine.owner)
    snap = fleet.store.read_run(run_id)
    assert (snap.owner, snap.lease_version) == (mine.owner, mine.lease_version)


_IN_CONTAINER = """
import json, sys
from pydantic import SecretStr
from ratchet.leasing import LeaseHolder
from ratchet.worker import job
from ratchet.fleet.context import Fleet
from ratchet.fleet.settings import Settings
url, state, run_id = sys.argv[1:4]
fleet = Fleet.connect(Settings(redis_url=SecretStr(url), state_dir=state, worker_name="same",
                               checkpoint_key=SecretStr("ab" * 32)))
owner = job._owner(fleet)  # the id the worker's jobs acquire with
got = fleet.store.try_acquire(run_id, owner=owner, ttl_ms=60_000)
held = isinstance(got, LeaseHolder)
print(json.dumps({"owner": owner, "outcome": "held" if held else "acquired",
                  "lease_version": None if held else got.lease_version}))
"""


def _in_own_pid_namespace(url: str, state: Path, run_id: str) -> dict[str, object]:
    """A worker process as a container runs it: in a pid namespace of its own (pid 1),
    configured with the shared name ``same``."""
    import json
    import shutil
    import subprocess
    import sys

    unshare = shutil.which("unshare")
    if os.geteuid() != 0 or unshare is None:
        pytest.skip("pid namespaces need root and util-linux's unshare")
    done = subprocess.run(
        [
            unshare,
            "--pid",
            "--fork",
            "--mount-proc",
            sys.executable,
            "-c",
            _IN_CONTAINER,
            url,
            str(state),
            run_id,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return dict(json.loads(done.stdout))


def test_two_workers_with_one_name_and_one_pid_are_two_owners(
    redis_server: RedisServer, settings: Settings, tmp_path: Path
) -> None:
    """``hostname-pid`` repeats across containers: both workers here run as pid 1 with
    the same configured name. The second must find the first's live lease held."""
    from ratchet.demo.examples import greeting_document, make_greeting_workspace
    from ratchet.fleet.context import Fleet
    from ratchet.ops import submit

    fleet = Fleet.connect(settings)
    run_id = submit(
        fleet, greeting_document(make_greeting_workspace(tmp_path / "ws")), run_id="r-same-pid"
    )
    first = _in_own_pid_namespace(redis_server.url, tmp_path / "a", run_id)
    second = _in_own_pid_namespace(redis_server.url, tmp_path / "b", run_id)
    assert first["outcome"] == "acquired"
    assert str(first["owner"]).endswith("-1") and str(second["owner"]).endswith("-1")
    assert first["owner"] != second["owner"]
    assert second["outcome"] == "held"
    snap = fleet.store.read_run(run_id)
    assert (snap.owner, snap.lease_version) == (first["owner"], first["lease_version"])
