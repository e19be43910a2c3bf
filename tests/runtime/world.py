"""A small world for the core's tests: one scenario, its ports, keys and action builders."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from ratchet.runtime import (
    Action,
    ApprovalClaims,
    ApprovalEvidence,
    CrashWindow,
    KeyRing,
    Observation,
    RebaselineClaims,
    RebaselineDecision,
    Receipt,
    ReviewDecision,
    ReviewDecisionClaims,
    ReviewVerdict,
    RunEngine,
    Scenario,
    TrustRoots,
    derive_idempotency_key,
    sign_approval,
    sign_rebaseline,
    sign_review_decision,
)
from ratchet.runtime.canonical import canonical_json
from ratchet.runtime.effects import Hooks
from ratchet.runtime.engine import Probe
from ratchet.runtime.signing import parse_envelope, seal_envelope
from ratchet.testing.memory import ManualClock, MemoryGenerationStore, MemoryWorkspace
from ratchet.worker.executor import Executor, WindowProbe

CHECKPOINT_SECRET = b"checkpoint-key-0123456789abcdef!!CANARY"
OTHER_SECRET = b"another-checkpoint-key-0123456789abcdef"
WRONG_GREETING = 'print("Hello, wrold")\n'
RIGHT_GREETING = 'print("Hello, world")\n'


def scenario_data(**overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "schema_version": 1,
        "task_id": "fix-greeting",
        "task_version": "1",
        "policy_id": "default",
        "policy_version": "3",
        "permissions": [
            "read_file",
            "write_file",
            "delete_file",
            "run_verifier",
            "finish",
            "external_call",
        ],
        "allowed_paths": ["app.py", "docs"],
        "allowed_verifier_targets": ["unit"],
        "allowed_operations": ["place-order"],
        "approval_required": ["external_call"],
        "budgets": {"proposals": 40, "steps": 30, "wall_clock_seconds": 3600, "cost_units": 1000},
        "initial_files": {"app.py": WRONG_GREETING},
        "verifier": {"target": "unit", "expected_files": {"app.py": RIGHT_GREETING}},
    }
    data.update(overrides)
    return data


def resign(world: World, blob: bytes, edit: Callable[[dict[str, Any]], None]) -> bytes:
    """Tamper with the payload and sign it again with the real key (an insider's view)."""
    _, body = parse_envelope(blob)
    data = json.loads(body)
    edit(data)
    return seal_envelope(world.keyring, canonical_json(data))


def public_bytes(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


@dataclass
class World:
    scenario: Scenario = field(default_factory=lambda: Scenario.model_validate(scenario_data()))
    clock: ManualClock = field(default_factory=ManualClock)
    keyring: KeyRing = field(
        default_factory=lambda: KeyRing.from_secrets({"k1": CHECKPOINT_SECRET}, signing_kid="k1")
    )
    approver_key: Ed25519PrivateKey = field(default_factory=Ed25519PrivateKey.generate)
    reviewer_key: Ed25519PrivateKey = field(default_factory=Ed25519PrivateKey.generate)
    store: MemoryGenerationStore = field(default_factory=MemoryGenerationStore)
    run_id: str = "run-1"
    instance_id: str = "ws-a"
    adapter: MemoryWorkspace = field(init=False)
    nonce_counter: int = 0

    def __post_init__(self) -> None:
        self.adapter = self.new_adapter(self.instance_id)

    def new_adapter(self, instance_id: str) -> MemoryWorkspace:
        return MemoryWorkspace(
            instance_id,
            self.scenario.initial_files,
            clock=self.clock,
            expectations={"unit": self.scenario.verifier.expected_files},
        )

    @property
    def approvers(self) -> TrustRoots:
        return TrustRoots.from_public_bytes("approver", {"alice": public_bytes(self.approver_key)})

    @property
    def reviewers(self) -> TrustRoots:
        return TrustRoots.from_public_bytes("reviewer", {"rita": public_bytes(self.reviewer_key)})

    def ports(
        self,
        *,
        store: Any = None,
        adapter: Any = None,
        probe: Probe | None = None,
        hooks: Hooks | None = None,
        **extra: Any,
    ) -> dict[str, Any]:
        """RunEngine.start/resume's arguments: this world's scenario, keys, clock and trust
        roots, and an executor on its adapter and store (or the ones given), with
        ``probe`` called at every crash window."""
        if probe is not None:
            hooks = WindowProbe(probe, hooks)
        executor = Executor(
            self.adapter if adapter is None else adapter,
            self.store if store is None else store,
            hooks=hooks,
        )
        return {
            "scenario": self.scenario,
            "keyring": self.keyring,
            "executor": executor,
            "clock": self.clock,
            "approvers": self.approvers,
            "reviewers": self.reviewers,
            **extra,
        }

    def start(self, probe: Probe | None = None) -> RunEngine:
        return RunEngine.start(self.run_id, **self.ports(probe=probe, store=self.store.leased(1)))

    def resume(
        self, blob: bytes | None = None, probe: Probe | None = None, lease_version: int = 2
    ) -> RunEngine:
        """What a new owner does: load the latest checkpoint, restore, reconcile later."""
        if blob is None:
            blob = next(iter(self.store.checkpoints.values())).blob
        store = self.store.leased(lease_version)
        store.claim(self.run_id)  # acquiring the lease comes before anything else
        return RunEngine.resume(
            blob, lease_version=lease_version, **self.ports(probe=probe, store=store)
        )

    # -- actions --------------------------------------------------------------------------

    def action(
        self,
        engine: RunEngine,
        kind: str,
        args: dict[str, str],
        *,
        key: str | None = None,
        action_id: str | None = None,
        cost: int = 0,
    ) -> Action:
        state = engine.state
        return Action.model_validate(
            {
                "action_id": action_id or f"a-{state.next_seq}",
                "kind": kind,
                "risk": {
                    "read_file": "read_only",
                    "write_file": "reversible_write",
                    "delete_file": "reversible_write",
                    "external_call": "irreversible_external_write",
                    "run_verifier": "verification",
                    "finish": "control",
                }[kind],
                "args": args,
                "idempotency_key": key,
                "expected_env_version": state.environment.version,
                "deadline_at": self.clock.now() + 600,
                "cost_units": cost,
            }
        )

    def write(
        self,
        engine: RunEngine,
        content: str = RIGHT_GREETING,
        *,
        path: str = "app.py",
        key: str | None = None,
        **kw: Any,
    ) -> Action:
        key = key or derive_idempotency_key(engine.state.run_id, engine.state.plan_cursor)
        return self.action(engine, "write_file", {"path": path, "content": content}, key=key, **kw)

    def order(
        self,
        engine: RunEngine,
        body: str = '{"sku":"A-1","qty":1}',
        *,
        key: str = "order-1",
        **kw: Any,
    ) -> Action:
        return self.action(
            engine, "external_call", {"operation": "place-order", "body": body}, key=key, **kw
        )

    def verify(self, engine: RunEngine) -> Action:
        return self.action(engine, "run_verifier", {"target": "unit"})

    def finish(self, engine: RunEngine) -> Action:
        return self.action(engine, "finish", {"summary": "greeting fixed"})

    # -- signed evidence --------------------------------------------------------------------

    def next_nonce(self) -> str:
        self.nonce_counter += 1
        return f"nonce-{self.nonce_counter}"

    def approve(
        self,
        engine: RunEngine,
        *,
        ttl: int = 300,
        max_proposals: int | None = None,
        key: Ed25519PrivateKey | None = None,
        **overrides: Any,
    ) -> ApprovalEvidence:
        """An approval of the engine's current pending write, as an operator would sign."""
        state = engine.state
        pending = state.pending
        if pending is None:
            raise AssertionError("nothing pending to approve")
        claims = {
            "task_id": state.task_id,
            "run_id": state.run_id,
            "policy_id": state.policy_id,
            "policy_version": state.policy_version,
            "action_id": pending.action.action_id,
            "idempotency_key": pending.action.idempotency_key,
            "intent_digest": pending.intent_digest,
            "env_instance_id": state.environment.instance_id,
            "env_fingerprint": state.environment.fingerprint,
            "env_version": state.environment.version,
            "generation": engine.generation,
            "nonce": self.next_nonce(),
            "expires_at": self.clock.now() + ttl,
            "max_proposals": (
                state.usage.proposals + 10 if max_proposals is None else max_proposals
            ),
        }
        claims.update(overrides)
        return sign_approval(
            key or self.approver_key, "alice", ApprovalClaims.model_validate(claims)
        )

    def decide(
        self,
        engine: RunEngine,
        verdict: str,
        *,
        key: Ed25519PrivateKey | None = None,
        reviewer_id: str = "rita",
        **overrides: Any,
    ) -> ReviewDecision:
        state = engine.state
        case = state.review
        if case is None:
            raise AssertionError("no review case open")
        claims = {
            "task_id": state.task_id,
            "run_id": state.run_id,
            "policy_id": state.policy_id,
            "policy_version": state.policy_version,
            "case_id": case.case_id,
            "action_id": case.pending.action.action_id,
            "idempotency_key": case.pending.action.idempotency_key,
            "pending_intent_digest": case.pending.intent_digest,
            "receipt_intent_digest": case.receipt.intent_digest if case.receipt else None,
            "receipt_fingerprint": case.receipt_fingerprint,
            "env_instance_id": case.environment.instance_id,
            "env_version": case.environment.version,
            "verdict": ReviewVerdict(verdict),
            "nonce": self.next_nonce(),
        }
        claims.update(overrides)
        return sign_review_decision(
            key or self.reviewer_key, reviewer_id, ReviewDecisionClaims.model_validate(claims)
        )

    def rebaseline(
        self,
        engine: RunEngine,
        observed: Observation | None = None,
        *,
        key: Ed25519PrivateKey | None = None,
        reviewer_id: str = "rita",
        **overrides: Any,
    ) -> RebaselineDecision:
        """A reviewer's decision making the environment as observed now the run's
        baseline, bound to the engine's state and generation."""
        state, seen = engine.state, observed or self.adapter.observe()
        claims: dict[str, Any] = {
            "task_id": state.task_id,
            "run_id": state.run_id,
            "policy_id": state.policy_id,
            "policy_version": state.policy_version,
            "incident_id": "inc-1",
            "generation": engine.generation,
            "old_env_instance_id": state.environment.instance_id,
            "old_env_version": state.environment.version,
            "old_env_fingerprint": state.environment.fingerprint,
            "new_env_instance_id": seen.instance_id,
            "new_env_version": seen.version,
            "new_env_fingerprint": seen.fingerprint,
            "nonce": self.next_nonce(),
        }
        claims.update(overrides)
        return sign_rebaseline(
            key or self.reviewer_key, reviewer_id, RebaselineClaims.model_validate(claims)
        )


# -- faults the core's tests inject ---------------------------------------------------------


class SimulatedCrash(Exception):
    """The worker died here."""


def crash_at(window: CrashWindow) -> Probe:
    def probe(seen: CrashWindow) -> None:
        if seen is window:
            raise SimulatedCrash(window.value)

    return probe


def plant_foreign_receipt(world: World, key: str) -> Receipt:
    receipt = Receipt(
        namespace=world.adapter.namespace,
        receipt_version=1,
        receipt_id="rcpt-foreign",
        idempotency_key=key,
        intent_digest="a" * 64,
        result={"path": "app.py"},
        committed_at=world.clock.now(),
        env_version_after=9,
    )
    world.adapter.plant_receipt(receipt)
    return receipt
