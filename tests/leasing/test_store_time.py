"""Time that gates an effect is the store's: the commit script itself refuses to commit
an approved write for execution once the approval expired by Redis' clock, however far
the engine's own clock is off."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from ratchet.errors import ApprovalWindowClosedError, ContractError
from ratchet.leasing import RedisStore
from ratchet.runtime import (
    Action,
    ApprovalClaims,
    KeyRing,
    Phase,
    RunEngine,
    Scenario,
    TraceOutcome,
    TrustRoots,
    sign_approval,
)
from ratchet.runtime.canonical import canonical_json
from ratchet.testing.memory import ManualClock, MemoryWorkspace
from ratchet.worker.executor import Executor

SECRET = b"integration-checkpoint-key-0123456789abcdef"
APPROVER = Ed25519PrivateKey.generate()


def scenario() -> Scenario:
    return Scenario.model_validate(
        {
            "schema_version": 1,
            "task_id": "t",
            "task_version": "1",
            "policy_id": "p",
            "policy_version": "1",
            "permissions": ["write_file", "run_verifier", "finish"],
            "allowed_paths": ["app.py"],
            "allowed_verifier_targets": ["unit"],
            "approval_required": ["write_file"],
            "budgets": {"proposals": 40, "steps": 30, "wall_clock_seconds": 10**9, "cost_units": 0},
            "initial_files": {"app.py": "old\n"},
            "verifier": {"target": "unit", "expected_files": {"app.py": "new\n"}},
        }
    )


def engine_on_redis(
    store: RedisStore, run_id: str, clock: ManualClock, adapter: MemoryWorkspace
) -> RunEngine:
    scn = scenario()
    keyring = KeyRing.from_secrets({"k1": SECRET}, signing_kid="k1")
    approvers = TrustRoots.from_public_bytes(
        "approver", {"alice": APPROVER.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)}
    )
    ports: dict[str, Any] = {
        "scenario": scn,
        "keyring": keyring,
        "clock": clock,
        "approvers": approvers,
    }
    creator = store.creator(canonical_json(scn.model_dump(mode="json")))
    RunEngine.start(run_id, executor=Executor(adapter, creator), **ports)
    lease = store.acquire(run_id, owner="w-time", ttl_ms=60_000)
    assert lease is not None
    snap = lease.read(with_checkpoint=True)
    assert snap.checkpoint is not None
    return RunEngine.resume(
        snap.checkpoint,
        executor=Executor(adapter, lease),
        lease_version=lease.lease_version,
        **ports,
    )


def waiting_write(engine: RunEngine, clock: ManualClock) -> None:
    action = Action.model_validate(
        {
            "action_id": "a-1",
            "kind": "write_file",
            "risk": "reversible_write",
            "args": {"path": "app.py", "content": "new\n"},
            "idempotency_key": "k-1",
            "expected_env_version": engine.state.environment.version,
            "deadline_at": clock.now() + 600,
        }
    )
    assert engine.propose(action).outcome is TraceOutcome.AWAITING_APPROVAL


def approval(engine: RunEngine, expires_at: int) -> Any:
    state, pending = engine.state, engine.state.pending
    assert pending is not None
    env = state.environment
    return sign_approval(
        APPROVER,
        "alice",
        ApprovalClaims(
            task_id=state.task_id,
            run_id=state.run_id,
            policy_id=state.policy_id,
            policy_version=state.policy_version,
            action_id=pending.action.action_id,
            idempotency_key="k-1",
            intent_digest=pending.intent_digest,
            env_instance_id=env.instance_id,
            env_fingerprint=env.fingerprint,
            env_version=env.version,
            generation=engine.generation,
            nonce=f"n-{uuid.uuid4().hex[:12]}",
            expires_at=expires_at,
            max_proposals=10,
        ),
    )


@pytest.mark.parametrize("skew_s", [-7200, 0])
def test_an_approval_expired_by_redis_time_is_never_committed_for_execution(
    store: RedisStore, new_run_id: Any, skew_s: int
) -> None:
    """The engine's clock is 2 h behind Redis' (or right): the approval expired a minute
    ago by Redis' clock, the engine thinks it is valid, and the commit script refuses the
    commit that would let the write go. Nothing reaches the adapter."""
    store_s = store.server_time_ms() // 1000
    clock = ManualClock()
    clock.current = store_s + skew_s - 60 if skew_s else store_s - 61
    adapter = MemoryWorkspace("ws-a", {"app.py": "old\n"}, clock=clock)
    engine = engine_on_redis(store, new_run_id(), clock, adapter)
    waiting_write(engine, clock)
    generation = engine.generation
    with pytest.raises(ApprovalWindowClosedError) as err:
        engine.refresh_pending_approval(approval(engine, expires_at=store_s - 60))
    assert err.value.now_ms > err.value.not_after_ms
    assert adapter.write_count == 0
    assert store.read_run(engine.state.run_id).generation == generation
    assert engine.generation == generation
    assert engine.state.phase is Phase.AWAITING_APPROVAL  # the last acknowledged state


def test_an_approval_still_valid_by_redis_time_executes_whatever_the_engine_clock(
    store: RedisStore, new_run_id: Any
) -> None:
    store_s = store.server_time_ms() // 1000
    clock = ManualClock()
    clock.current = store_s - 7200
    adapter = MemoryWorkspace("ws-a", {"app.py": "old\n"}, clock=clock)
    engine = engine_on_redis(store, new_run_id(), clock, adapter)
    waiting_write(engine, clock)
    result = engine.refresh_pending_approval(approval(engine, expires_at=store_s + 600))
    assert result.outcome is TraceOutcome.EXECUTED
    assert adapter.write_count == 1


def test_a_bad_not_after_is_refused_before_redis(store: RedisStore, new_run_id: Any) -> None:
    with pytest.raises(ContractError):
        store.prepare_commit("r-1", generation=2, checkpoint=b"x", not_after_ms=-1)
