"""Shared pieces for the adapter tests: a scenario, a run harness over any adapter, action
builders, approvals, and a crash probe."""

from __future__ import annotations

import http.client
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from ratchet.runtime import (
    Action,
    Adapter,
    ApprovalClaims,
    ApprovalEvidence,
    CrashWindow,
    Fence,
    KeyRing,
    RunEngine,
    Scenario,
    TrustRoots,
    derive_idempotency_key,
    sign_approval,
)
from ratchet.runtime.engine import Probe
from ratchet.testing.memory import ManualClock, MemoryGenerationStore
from ratchet.worker.executor import Executor, WindowProbe
from tests.adapters.conftest import ServiceBox

WRONG_GREETING = 'print("Hello, wrold")\n'
RIGHT_GREETING = 'print("Hello, world")\n'
ORDER_BODY = '{"sku":"A-1","qty":1}'
TEST_FILE = (
    "import subprocess\n"
    "import sys\n\n\n"
    "def test_app_prints_the_greeting():\n"
    "    out = subprocess.run([sys.executable, 'app.py'], capture_output=True, text=True)\n"
    "    assert out.stdout == 'Hello, world\\n'\n"
)
# A cheap verifier for tests that are not about pytest itself.
QUICK_CHECK = [
    sys.executable,
    "-c",
    f"import sys; sys.exit(open('app.py').read() != {RIGHT_GREETING!r})",
]
PYTEST_CHECK = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"]

WRITE_WINDOWS = [
    CrashWindow.AFTER_PENDING_BEFORE_ADAPTER,
    CrashWindow.AFTER_ADAPTER_BEFORE_RECEIPT,
    CrashWindow.AFTER_RECEIPT_BEFORE_STATE,
]


class SimulatedCrash(Exception):
    """The worker died here."""


def crash_at(window: CrashWindow) -> Probe:
    def probe(seen: CrashWindow) -> None:
        if seen is window:
            raise SimulatedCrash(window.value)

    return probe


def scenario(**overrides: Any) -> Scenario:
    data: dict[str, Any] = {
        "schema_version": 1,
        "task_id": "fix-greeting",
        "task_version": "1",
        "policy_id": "default",
        "policy_version": "1",
        "permissions": [
            "read_file",
            "write_file",
            "delete_file",
            "run_verifier",
            "finish",
            "external_call",
        ],
        "allowed_paths": ["app.py", "tests"],
        "allowed_verifier_targets": ["unit"],
        "allowed_operations": ["place-order"],
        "approval_required": [],
        "budgets": {"proposals": 40, "steps": 30, "wall_clock_seconds": 3600, "cost_units": 1000},
        "initial_files": {"app.py": WRONG_GREETING},
        "verifier": {"target": "unit", "expected_files": {"app.py": RIGHT_GREETING}},
    }
    data.update(overrides)
    return Scenario.model_validate(data)


def make_workspace(root: Path, *, git: bool = False) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "app.py").write_text(WRONG_GREETING)
    (root / "tests").mkdir(exist_ok=True)
    (root / "tests" / "test_app.py").write_text(TEST_FILE)
    if git:
        run_git(root, "init", "-q")
        run_git(root, "add", "app.py", "tests")
        run_git(root, "commit", "-q", "-m", "initial")
    return root


def run_git(root: Path, *args: str) -> str:
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": str(root),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.invalid",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.invalid",
    }
    done = subprocess.run(
        ["git", "-C", str(root), *args],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return done.stdout


def public_bytes(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


@dataclass
class Harness:
    """One run over real adapters. ``open_adapter`` opens a fresh handle, as a new worker
    process would; ``effects`` counts effects on the adapter's side."""

    open_adapter: Callable[[], Adapter]
    effects: Callable[[], int]
    scenario: Scenario = field(default_factory=scenario)
    clock: ManualClock = field(default_factory=ManualClock)
    store: MemoryGenerationStore = field(default_factory=MemoryGenerationStore)
    approver_key: Ed25519PrivateKey = field(default_factory=Ed25519PrivateKey.generate)
    keyring: KeyRing = field(
        default_factory=lambda: KeyRing.from_secrets(
            {"k1": b"checkpoint-key-0123456789abcdef-adapters"}, signing_kid="k1"
        )
    )
    run_id: str = "run-1"
    nonces: int = 0

    @property
    def approvers(self) -> TrustRoots:
        return TrustRoots.from_public_bytes("approver", {"alice": public_bytes(self.approver_key)})

    def ports(self, adapter: Adapter, store: Any, probe: Probe | None = None) -> dict[str, Any]:
        hooks = WindowProbe(probe) if probe is not None else None
        return {
            "scenario": self.scenario,
            "keyring": self.keyring,
            "executor": Executor(adapter, store, hooks=hooks),
            "clock": self.clock,
            "approvers": self.approvers,
        }

    def start(self, probe: Probe | None = None) -> RunEngine:
        return RunEngine.start(
            self.run_id, **self.ports(self.open_adapter(), self.store.leased(1), probe)
        )

    def latest_blob(self) -> bytes:
        return next(iter(self.store.checkpoints.values())).blob

    def resume(self, lease_version: int = 2, probe: Probe | None = None) -> RunEngine:
        """What a new owner does: take the lease, open the adapter, restore."""
        store = self.store.leased(lease_version)
        store.claim(self.run_id)
        return RunEngine.resume(
            self.latest_blob(),
            lease_version=lease_version,
            **self.ports(self.open_adapter(), store, probe),
        )

    # -- actions ------------------------------------------------------------------------------

    def action(
        self, engine: RunEngine, kind: str, args: dict[str, str], *, key: str | None = None
    ) -> Action:
        risk = {
            "read_file": "read_only",
            "write_file": "reversible_write",
            "delete_file": "reversible_write",
            "external_call": "irreversible_external_write",
            "run_verifier": "verification",
            "finish": "control",
        }[kind]
        return Action.model_validate(
            {
                "action_id": f"a-{engine.state.next_seq}",
                "kind": kind,
                "risk": risk,
                "args": args,
                "idempotency_key": key,
                "expected_env_version": engine.state.environment.version,
                "deadline_at": self.clock.now() + 600,
            }
        )

    def write(
        self, engine: RunEngine, content: str = RIGHT_GREETING, *, key: str | None = None
    ) -> Action:
        key = key or derive_idempotency_key(engine.state.run_id, engine.state.plan_cursor)
        return self.action(engine, "write_file", {"path": "app.py", "content": content}, key=key)

    def order(self, engine: RunEngine, body: str = ORDER_BODY, *, key: str = "order-1") -> Action:
        return self.action(
            engine, "external_call", {"operation": "place-order", "body": body}, key=key
        )

    def verify(self, engine: RunEngine) -> Action:
        return self.action(engine, "run_verifier", {"target": "unit"})

    def finish(self, engine: RunEngine) -> Action:
        return self.action(engine, "finish", {"summary": "greeting fixed"})

    def approve(self, engine: RunEngine, action: Action, *, ttl: int = 300) -> ApprovalEvidence:
        """An operator's exact approval of ``action`` as the engine will propose it."""
        self.nonces += 1
        state = engine.state
        claims = ApprovalClaims(
            task_id=state.task_id,
            run_id=state.run_id,
            policy_id=state.policy_id,
            policy_version=state.policy_version,
            action_id=action.action_id,
            idempotency_key=action.idempotency_key or "",
            intent_digest=action.intent_digest,
            env_instance_id=state.environment.instance_id,
            env_fingerprint=state.environment.fingerprint,
            env_version=state.environment.version,
            generation=engine.generation,
            nonce=f"nonce-{self.nonces}",
            expires_at=self.clock.now() + ttl,
            max_proposals=state.usage.proposals + 10,
        )
        return sign_approval(self.approver_key, "alice", claims)


def order(key: str, body: str = '{"sku":"A-1","qty":1}') -> Action:
    return Action.model_validate(
        {
            "action_id": f"a-{key}",
            "kind": "external_call",
            "risk": "irreversible_external_write",
            "args": {"operation": "place-order", "body": body},
            "idempotency_key": key,
            "expected_env_version": 0,
            "deadline_at": 2**40,
        }
    )


def raw_post(orders: ServiceBox, key: str, body: str, f: Fence, intent: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", orders.port, timeout=10)
    try:
        conn.request(
            "POST",
            "/v1/orders",
            body=body.encode(),
            headers={
                "Idempotency-Key": key,
                "Ratchet-Run-Id": f.run_id,
                "Ratchet-Lease-Version": str(f.lease_version),
                "Ratchet-State-Version": str(f.state_version),
                "Ratchet-Intent-Digest": intent,
            },
        )
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()
