"""The core runtime restoring and committing through the Redis store (the port in use)."""

from __future__ import annotations

from typing import Any

import pytest

from ratchet.errors import CheckpointError, LeaseLostError
from ratchet.leasing import RedisStore
from ratchet.runtime import Action, KeyRing, RunEngine, Scenario
from ratchet.runtime.canonical import canonical_json
from ratchet.runtime.ports import RunKey
from ratchet.testing.memory import ManualClock, MemoryWorkspace
from ratchet.worker.executor import Executor

SECRET = b"integration-checkpoint-key-0123456789abcdef"
GREETING = 'print("Hello, wrold")\n'


def scenario() -> Scenario:
    return Scenario.model_validate(
        {
            "schema_version": 1,
            "task_id": "fix-greeting",
            "task_version": "1",
            "policy_id": "default",
            "policy_version": "3",
            "permissions": ["read_file", "write_file", "run_verifier", "finish"],
            "allowed_paths": ["app.py"],
            "allowed_verifier_targets": ["unit"],
            "allowed_operations": [],
            "approval_required": [],
            "budgets": {
                "proposals": 40,
                "steps": 30,
                "wall_clock_seconds": 3600,
                "cost_units": 1000,
            },
            "initial_files": {"app.py": GREETING},
            "verifier": {"target": "unit", "expected_files": {"app.py": GREETING}},
        }
    )


def read_action(engine: RunEngine, clock: ManualClock) -> Action:
    state = engine.state
    return Action.model_validate(
        {
            "action_id": f"a-{state.next_seq}",
            "kind": "read_file",
            "risk": "read_only",
            "args": {"path": "app.py"},
            "idempotency_key": None,
            "expected_env_version": state.environment.version,
            "deadline_at": clock.now() + 600,
            "cost_units": 0,
        }
    )


@pytest.fixture
def world(store: RedisStore, new_run_id: Any) -> dict[str, Any]:
    scn = scenario()
    clock = ManualClock()
    adapter = MemoryWorkspace(
        "ws-a", scn.initial_files, clock=clock, expectations={"unit": scn.verifier.expected_files}
    )
    keyring = KeyRing.from_secrets({"k1": SECRET}, signing_kid="k1")
    return {
        "scenario": scn,
        "clock": clock,
        "adapter": adapter,
        "keyring": keyring,
        "run_id": new_run_id(),
        "scenario_bytes": canonical_json(scn.model_dump(mode="json")),
    }


def ports(world: dict[str, Any], store: Any) -> dict[str, Any]:
    return {
        "scenario": world["scenario"],
        "keyring": world["keyring"],
        "executor": Executor(world["adapter"], store),
        "clock": world["clock"],
    }


def test_a_run_started_by_the_engine_is_restored_and_advanced_through_a_lease(
    store: RedisStore, world: dict[str, Any]
) -> None:
    first = RunEngine.start(world["run_id"], **ports(world, store.creator(world["scenario_bytes"])))
    run = store.acquire(world["run_id"], owner="worker-1", ttl_ms=60_000)
    assert run is not None
    stored = run.load(first.key)
    assert stored.generation == 1 and stored.blob == first.checkpoint
    engine = RunEngine.resume(stored.blob, lease_version=run.lease_version, **ports(world, run))
    engine.propose(read_action(engine, world["clock"]))
    snap = store.read_run(world["run_id"], with_checkpoint=True, with_scenario=True)
    assert snap.generation == engine.generation == 2
    assert snap.checkpoint == engine.checkpoint
    assert snap.scenario == world["scenario_bytes"]


def test_a_validly_signed_checkpoint_of_an_older_generation_is_refused_on_restore(
    store: RedisStore, world: dict[str, Any]
) -> None:
    first = RunEngine.start(world["run_id"], **ports(world, store.creator(world["scenario_bytes"])))
    old_blob = first.checkpoint
    run = store.acquire(world["run_id"], owner="worker-1", ttl_ms=60_000)
    assert run is not None
    engine = RunEngine.resume(old_blob, lease_version=run.lease_version, **ports(world, run))
    engine.propose(read_action(engine, world["clock"]))
    assert run.high_water(engine.key) == 2
    with pytest.raises(CheckpointError) as err:
        RunEngine.resume(old_blob, lease_version=run.lease_version, **ports(world, run))
    assert err.value.reason == "stale_generation"
    assert err.value.generation == 1 and err.value.high_water == 2


def test_an_engine_whose_lease_was_taken_over_cannot_commit(
    store: RedisStore, world: dict[str, Any], expire: Any
) -> None:
    RunEngine.start(world["run_id"], **ports(world, store.creator(world["scenario_bytes"])))
    # Long enough for the restore on a loaded machine (at 60 ms it could expire first).
    run = store.acquire(world["run_id"], owner="worker-1", ttl_ms=500)
    assert run is not None
    engine = RunEngine.resume(
        run.load(run_key_of(world)).blob, lease_version=run.lease_version, **ports(world, run)
    )
    expire(store, world["run_id"])
    assert store.acquire(world["run_id"], owner="worker-2", ttl_ms=60_000) is not None
    with pytest.raises(LeaseLostError):
        engine.propose(read_action(engine, world["clock"]))
    assert store.read_run(world["run_id"]).generation == 1


def run_key_of(world: dict[str, Any]) -> RunKey:
    return RunKey(world["scenario"].task_id, world["run_id"], "ws-a")


def test_a_read_under_the_lease_answers_the_restores_high_water_check_once(
    store: RedisStore, world: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    RunEngine.start(world["run_id"], **ports(world, store.creator(world["scenario_bytes"])))
    run = store.acquire(world["run_id"], owner="worker-1", ttl_ms=60_000)
    assert run is not None
    snap = run.read(with_checkpoint=True, with_scenario=True)
    assert snap.scenario == world["scenario_bytes"] and snap.checkpoint is not None
    reads: list[str] = []
    original = store.read_run

    def counted(*args: Any, **kwargs: Any) -> Any:
        reads.append("read_run")
        return original(*args, **kwargs)

    monkeypatch.setattr(store, "read_run", counted)
    engine = RunEngine.resume(snap.checkpoint, lease_version=run.lease_version, **ports(world, run))
    assert reads == []  # the restore's high-water check was the read above
    engine.propose(read_action(engine, world["clock"]))
    # Once used (and after a commit), every later check reads Redis again.
    assert run.high_water(engine.key) == 2 and reads == ["read_run"]
    # An older checkpoint is still refused: the snapshot proves nothing about it.
    run.read(with_checkpoint=True)
    with pytest.raises(CheckpointError) as err:
        RunEngine.resume(snap.checkpoint, lease_version=run.lease_version, **ports(world, run))
    assert err.value.reason == "stale_generation"


def test_a_read_under_a_lease_that_was_taken_over_is_refused(
    store: RedisStore, world: dict[str, Any], expire: Any
) -> None:
    RunEngine.start(world["run_id"], **ports(world, store.creator(world["scenario_bytes"])))
    run = store.acquire(world["run_id"], owner="worker-1", ttl_ms=60)
    assert run is not None
    expire(store, world["run_id"])
    assert store.acquire(world["run_id"], owner="worker-2", ttl_ms=60_000) is not None
    with pytest.raises(LeaseLostError):
        run.read()
