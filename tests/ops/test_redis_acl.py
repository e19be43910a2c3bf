"""Least-privilege Redis users on a real server: each role does its job and no more."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from pydantic import SecretStr
from redis.exceptions import NoPermissionError, ResponseError

from ratchet.demo.examples import greeting_document, make_greeting_workspace
from ratchet.errors import ReplicationUnconfirmedError, StoreProtocolError
from ratchet.fleet.context import Fleet
from ratchet.fleet.settings import Settings
from ratchet.leasing import RedisStore, run_keys
from ratchet.leasing.acl import AclUser, Role, acl_file, role_commands, script_commands
from ratchet.leasing.scripts import ScriptName, load_script
from ratchet.ops import inspect_run, submit
from ratchet.redis_server import RedisServer
from ratchet.worker.reaper import reap_once
from tests.conftest import test_sandbox_mode
from tests.ops.helpers import poll
from tests.worker.conftest import CHECKPOINT_KEY_HEX
from tests.worker.fleet_harness import workers

pytestmark = pytest.mark.slow

PASSWORDS = {role: secrets.token_urlsafe(24) for role in Role}


@pytest.fixture
def acl_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    folder = tmp_path_factory.mktemp("redis-acl")
    users = [AclUser.with_password(f"ratchet-{r.value}", r, PASSWORDS[r]) for r in Role]
    (folder / "users.acl").write_text(acl_file(users))
    server = RedisServer(folder / "data", extra_args=["--aclfile", str(folder / "users.acl")])
    server.start()
    RedisStore(client(server, Role.ADMIN)).identity.init_epoch()  # the admin initialises the store
    try:
        yield server
    finally:
        server.kill()


def url(server: RedisServer, role: Role) -> str:
    return f"redis://ratchet-{role.value}:{PASSWORDS[role]}@127.0.0.1:{server.port}/0"


def client(server: RedisServer, role: Role) -> redis.Redis:
    return redis.Redis(
        host="127.0.0.1",
        port=server.port,
        username=f"ratchet-{role.value}",
        password=PASSWORDS[role],
        socket_timeout=10,
    )


def settings_for(server: RedisServer, role: Role, tmp_path: Path, queue: str) -> Settings:
    return Settings(
        redis_url=SecretStr(url(server, role)),
        state_dir=tmp_path / "state",
        queue=queue,
        lease_ttl_ms=1500,
        renew_interval_ms=300,
        stall_timeout_ms=20_000,
        reaper_interval_ms=200,
        job_timeout_s=600,
        checkpoint_key=SecretStr(CHECKPOINT_KEY_HEX),
        verifier_sandbox=test_sandbox_mode(),
    )


def test_the_role_command_lists_come_from_the_scripts_and_exclude_destructive_commands() -> None:
    worker = set(role_commands(Role.WORKER))
    assert script_commands(ScriptName.COMMIT) <= worker
    for forbidden in (
        "eval",
        "script|load",
        "script|flush",
        "flushall",
        "flushdb",
        "del",
        "unlink",
        "rename",
        "expire",
        "keys",
        "config",
        "debug",
        "acl",
    ):
        assert forbidden not in worker, forbidden
    reader = set(role_commands(Role.READER))
    assert not reader & {"set", "hset", "del", "lpush", "zadd", "sadd", "hdel", "zrem"}
    assert "del" not in set(role_commands(Role.QUEUE)) - {"del"}  # RQ's DEL: rq:* keys only


def test_workers_do_their_job_under_acls_and_cannot_move_a_lease_or_hwm_by_hand(
    acl_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    RedisStore(client(acl_server, Role.ADMIN)).load_scripts()  # the admin loads the scripts
    queue = f"acl-{tmp_path.name}"
    monkeypatch.setenv("RATCHET_QUEUE_REDIS_URL", url(acl_server, Role.QUEUE))
    operator = Fleet.connect(settings_for(acl_server, Role.OPERATOR, tmp_path, queue))
    reader = Fleet.connect(settings_for(acl_server, Role.READER, tmp_path, queue))
    root = make_greeting_workspace(tmp_path / "ws")
    run_id = submit(
        operator,
        greeting_document(root, agent_config={"think_ms": 400}, runner="python"),
        run_id="r-acl-1",
    )
    worker_settings = settings_for(acl_server, Role.WORKER, tmp_path, queue)
    with workers(worker_settings) as pool:
        pool.start(1, env={"RATCHET_QUEUE_REDIS_URL": url(acl_server, Role.QUEUE)})
        poll(
            lambda: inspect_run(reader, run_id).state.phase.value == "completed",
            deadline_s=60,
            what="the run completed by a worker under ACLs",
        )
        # The job releases its lease after the completing commit: wait for that before
        # the pool is stopped, or a kill could land between the two.
        poll(
            lambda: client(acl_server, Role.ADMIN).hget(run_keys(run_id).lease, "owner") == b"",
            deadline_s=30,
            what="the worker released the run's lease",
        )
    view = inspect_run(reader, run_id)
    assert view.generation >= 4
    # One worker took the run once: every commit after the creation is under one lease,
    # the one Redis still names (released, so free now).
    entries = client(acl_server, Role.ADMIN).lrange(run_keys(run_id).history, 0, -1)
    leases = {int(e.decode().split("|")[2]) for e in entries} - {0}
    assert leases == {view.snapshot.lease_version}
    store = Fleet.connect(worker_settings).store
    assert reap_once(store, lambda _run: None).enqueued == ()  # the reaper's reads work
    admin = client(acl_server, Role.ADMIN)
    assert any(admin.scan_iter(match="rq:*"))  # RQ worked under its own user

    keys = run_keys(run_id)
    before = reader.store.read_run(run_id)
    as_worker, as_reader, as_queue = (
        client(acl_server, r) for r in (Role.WORKER, Role.READER, Role.QUEUE)
    )
    worker_refused = [
        ("DEL", keys.lease),
        ("UNLINK", keys.state),
        ("RENAME", keys.ckpt, keys.ckpt + "x"),
        ("EXPIRE", keys.lease, "1"),
        ("HINCRBY", keys.state, "generation", "-1"),
        ("EVAL", "return redis.call('HSET', KEYS[1], 'generation', 1)", "1", keys.state),
        ("SCRIPT", "LOAD", "return 1"),
        ("SCRIPT", "FLUSH"),
        ("FLUSHALL",),
        ("FLUSHDB",),
        ("CONFIG", "SET", "appendonly", "no"),
        ("KEYS", "*"),
        ("LPUSH", f"rq:queue:{queue}", "forged"),
        ("GET", f"rq:job:{run_id}"),
    ]
    reader_refused = [
        ("SET", keys.ckpt, "forged"),
        ("HSET", keys.state, "generation", "1"),
        ("HSET", keys.lease, "owner", "me", "lease_version", "99"),
        ("DEL", keys.lease),
        ("EVAL", "return 1", "0"),
        ("FLUSHALL",),
    ]
    queue_refused = [
        ("GET", keys.ckpt),
        ("HSET", keys.lease, "owner", "me"),
        ("DEL", keys.state),
        ("EVAL", "return 1", "0"),
        ("FLUSHALL",),
        ("CONFIG", "GET", "*"),
    ]
    for conn, refused in (
        (as_worker, worker_refused),
        (as_reader, reader_refused),
        (as_queue, queue_refused),
    ):
        for command in refused:
            with pytest.raises(NoPermissionError):
                conn.execute_command(*command)
    # The reader may call the scripts, but Redis checks each command a script issues: a
    # lease grab or a commit fails at its first write, before anything is written.
    acquire = load_script(ScriptName.ACQUIRE_LEASE)
    # A live lease would make the script answer "held" before any write: wait until the
    # worker's lease is gone (released, or expired if the worker was stopped before).
    poll(
        lambda: not reader.store.read_run(run_id).lease_live,
        deadline_s=10,
        what="the worker's lease released or expired",
    )
    with pytest.raises(ResponseError, match="can't run this command"):
        as_reader.evalsha(acquire.sha, 2, keys.lease, keys.state, "intruder", 60_000)
    # RQ's user may load and run its own Lua, confined to rq:* keys the same way.
    sha = as_queue.script_load("return redis.call('HSET', KEYS[1], 'owner', 'intruder')")
    with pytest.raises(ResponseError):
        as_queue.evalsha(sha, 1, keys.lease)
    after = reader.store.read_run(run_id)
    assert (after.generation, after.lease_version, after.owner, after.expires_at_ms) == (
        before.generation,
        before.lease_version,
        before.owner,
        before.expires_at_ms,
    )
    assert admin.hget(keys.lease, "owner") == b""


def test_a_worker_never_loads_scripts_and_says_so_when_they_are_missing(
    acl_server: RedisServer,
) -> None:
    admin = RedisStore(client(acl_server, Role.ADMIN))
    worker = RedisStore(client(acl_server, Role.WORKER))
    with pytest.raises(StoreProtocolError) as missing:
        worker.read_run("r-none")
    assert "ratchet redis load-scripts" in missing.value.message
    admin.load_scripts()
    with pytest.raises(Exception, match="no run"):
        worker.read_run("r-none")


def test_worker_and_operator_users_may_wait_for_replicas(acl_server: RedisServer) -> None:
    """With RATCHET_MIN_REPLICAS_ACK the store sends WAIT after its writes: the generated
    users may. (This server has no replica, so nothing is confirmed: each write is
    unconfirmed, not refused for want of a permission.)"""
    RedisStore(client(acl_server, Role.ADMIN)).load_scripts()

    def store(role: Role, replicas: int) -> RedisStore:
        return RedisStore(
            client(acl_server, role), min_replicas_ack=replicas, replicas_ack_timeout_ms=50
        )

    with pytest.raises(ReplicationUnconfirmedError):
        store(Role.OPERATOR, 1).create_run(
            "r-wait-1", task_id="t", env_instance_id="e", scenario=b"s", checkpoint=b"g1"
        )
    store(Role.OPERATOR, 0).create_run(
        "r-wait-2", task_id="t", env_instance_id="e", scenario=b"s", checkpoint=b"g1"
    )
    with pytest.raises(ReplicationUnconfirmedError):  # an acquire waits too
        store(Role.WORKER, 1).acquire("r-wait-2", owner="w-1", ttl_ms=60_000)


def test_an_operator_may_retry_a_create_which_indexes_the_run_again(
    acl_server: RedisServer,
) -> None:
    """A retried create (the reply of the first was lost) writes the run's index entries
    again, after the script: the operator user may."""
    RedisStore(client(acl_server, Role.ADMIN)).load_scripts()
    operator = RedisStore(client(acl_server, Role.OPERATOR))
    for _ in range(2):
        created = operator.create_run(
            "r-acl-retry",
            task_id="t",
            env_instance_id="e",
            scenario=b"s",
            checkpoint=b"g1",
            commit_id="c-1",
        )
    assert created.already_applied
    assert "r-acl-retry" in operator.run_ids()
