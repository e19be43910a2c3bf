"""What a signed checkpoint costs, against plain ``json`` plus stdlib HMAC of the same data.

For a realistic checkpoint of about 4 KB and about 64 KB this measures:

* **sign**: build, validate, sign and serialise one checkpoint
  (:func:`ratchet.runtime.checkpoint.seal_checkpoint`: schema re-validation, invariants,
  canonical JSON, checksum, HMAC);
* **restore**: verify and restore one (:func:`ratchet.runtime.restore.restore_checkpoint`:
  strict envelope parse, checksum, constant-time HMAC, schema, canonical payload, scenario,
  invariants, generation against an in-memory high-water store, environment, and the
  Ed25519 trust check of the approval the state holds).

Each is a ratio against a baseline measured in the same run on the same data:

* sign vs ``json.dumps(state_dict)`` + ``hmac.new(key, data, sha256).digest()``;
* restore vs ``json.loads`` + a stdlib HMAC verify (``hmac.compare_digest``) of the same
  bytes, and also vs the literal issue baseline (``json.dumps`` + HMAC).

The states are built by driving :class:`ratchet.runtime.RunEngine` on the in-memory ports:
cycles of write (with an adapter receipt), verify and read, ending in a pending external
write that carries a fresh signed approval, grown step by step until the envelope is as
close to the target size as whole steps allow. Every operation runs inside every batch
(rotating order, equal wall time each); ratios are medians of per-batch ratios, times are
medians of per-batch means. The run also reports the Ed25519 trust check alone, and the
restore ratio without it, to show its share.

Usage::

    python benchmarks/checkpoint_cost.py            # rich table, about 20 s
    python benchmarks/checkpoint_cost.py --json     # one JSON object
    python benchmarks/checkpoint_cost.py --quick    # smoke run, about 3 s
"""

from __future__ import annotations

import hashlib
import hmac
import json
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from harness import emit, median, median_of_ratios, parse_args, parser, print_table

from ratchet.runtime import (
    Action,
    ApprovalClaims,
    KeyRing,
    Observation,
    RunEngine,
    RunState,
    Scenario,
    TrustRoots,
    derive_idempotency_key,
    restore_checkpoint,
    seal_checkpoint,
    sign_approval,
)
from ratchet.testing.memory import ManualClock, MemoryGenerationStore, MemoryWorkspace
from ratchet.worker.executor import Executor

BENCH_KEY = bytes(range(32)) + b"bench-checkpoint-key"
TARGETS = {"4k": 4 * 1024, "64k": 64 * 1024}
RISKS = {
    "read_file": "read_only",
    "write_file": "reversible_write",
    "external_call": "irreversible_external_write",
    "run_verifier": "verification",
}


def _scenario() -> Scenario:
    app = 'def greet(name):\n    return f"Hello, {name}"\n\nprint(greet("world"))\n'
    return Scenario.model_validate(
        {
            "schema_version": 1,
            "task_id": "fix-greeting",
            "task_version": "7",
            "policy_id": "default",
            "policy_version": "3",
            "permissions": ["read_file", "write_file", "run_verifier", "finish", "external_call"],
            "allowed_paths": ["app.py", "docs"],
            "allowed_verifier_targets": ["unit"],
            "allowed_operations": ["open-pull-request"],
            "approval_required": ["external_call"],
            "budgets": {
                "proposals": 10_000,
                "steps": 10_000,
                "wall_clock_seconds": 86_400,
                "cost_units": 1_000_000,
            },
            "initial_files": {"app.py": 'print("Hello, wrold")\n', "docs/README.md": "# app\n"},
            "verifier": {"target": "unit", "expected_files": {"app.py": app}},
        }
    )


@dataclass
class Built:
    """A checkpoint at the store's high-water mark, and everything restore needs."""

    label: str
    state: RunState
    blob: bytes
    generation: int
    scenario: Scenario
    keyring: KeyRing
    store: MemoryGenerationStore
    observation: Observation
    approvers: TrustRoots
    steps: int


class _Builder:
    """Drives one run on the in-memory ports until its checkpoint reaches a size."""

    def __init__(self) -> None:
        self.scenario = _scenario()
        self.clock = ManualClock()
        self.keyring = KeyRing.from_secrets({"k1": BENCH_KEY}, signing_kid="k1")
        self.approver = Ed25519PrivateKey.generate()
        pub = self.approver.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.approvers = TrustRoots.from_public_bytes("approver", {"alice": pub})
        self.store = MemoryGenerationStore()
        self.adapter = MemoryWorkspace(
            "ws-bench",
            self.scenario.initial_files,
            clock=self.clock,
            expectations={"unit": self.scenario.verifier.expected_files},
        )
        self.engine = RunEngine.start(
            "run-bench",
            scenario=self.scenario,
            keyring=self.keyring,
            executor=Executor(self.adapter, self.store),
            clock=self.clock,
            approvers=self.approvers,
        )

    def _action(self, kind: str, args: dict[str, str], key: str | None = None) -> Action:
        state = self.engine.state
        return Action.model_validate(
            {
                "action_id": f"a-{state.next_seq}",
                "kind": kind,
                "risk": RISKS[kind],
                "args": args,
                "idempotency_key": key,
                "expected_env_version": state.environment.version,
                "deadline_at": self.clock.now() + 600,
                "cost_units": 1,
            }
        )

    def step(self, n: int) -> None:
        """One step of a cycle: write a new revision (receipted), verify it, read a file."""
        engine = self.engine
        rev, phase = divmod(n, 3)
        path = "app.py" if rev % 2 == 0 else "docs/README.md"
        if phase == 0:
            body = (
                f'def greet(name):\n    return f"Hello, {{name}}"  # rev {rev}\n\n'
                f'print(greet("world"))\n'
                if path == "app.py"
                else f"# app\n\nRevision {rev}: describe the greeting fix.\n"
            )
            key = derive_idempotency_key(engine.state.run_id, engine.state.plan_cursor)
            engine.propose(self._action("write_file", {"path": path, "content": body}, key))
        elif phase == 1:
            engine.propose(self._action("run_verifier", {"target": "unit"}))
        else:
            engine.propose(self._action("read_file", {"path": path}))
        self.clock.advance(7 + phase)

    def approve_external_write(self) -> None:
        """Leave a pending external write that carries a fresh signed approval."""
        engine = self.engine
        body = json.dumps({"title": "Fix greeting", "branch": "fix/greeting", "draft": False})
        engine.propose(
            self._action(
                "external_call",
                {"operation": "open-pull-request", "body": body},
                key=f"pr-{engine.state.plan_cursor}",
            )
        )
        state, pending = engine.state, engine.state.pending
        if pending is None:
            raise RuntimeError("the external write did not stay pending")
        claims = ApprovalClaims(
            task_id=state.task_id,
            run_id=state.run_id,
            policy_id=state.policy_id,
            policy_version=state.policy_version,
            action_id=pending.action.action_id,
            idempotency_key=pending.action.idempotency_key or "",
            intent_digest=pending.intent_digest,
            env_instance_id=state.environment.instance_id,
            env_fingerprint=state.environment.fingerprint,
            env_version=state.environment.version,
            generation=engine.generation,
            nonce=f"nonce-{state.next_seq}",
            expires_at=self.clock.now() + 3600,
            max_proposals=state.usage.proposals + 50,
        )
        engine.refresh_pending_approval(
            sign_approval(self.approver, "alice", claims), execute=False
        )

    def built(self, label: str, steps: int) -> Built:
        engine = self.engine
        return Built(
            label,
            engine.state,
            engine.checkpoint,
            engine.generation,
            self.scenario,
            self.keyring,
            self.store,
            self.adapter.observe(),
            self.approvers,
            steps,
        )


def build_checkpoint(label: str, target: int) -> Built:
    """A run whose final checkpoint is as close to ``target`` bytes as whole steps allow.

    The pending approved write adds a fixed amount, measured once; steps (write, verify,
    read, ...) are added until the trace and the executed list bring the envelope to the
    target. At least one receipted write is always included.
    """
    probe = _Builder()
    base = len(probe.engine.checkpoint)
    probe.approve_external_write()
    pending_extra = len(probe.engine.checkpoint) - base
    sizes = [len(probe.engine.checkpoint)]
    probe = _Builder()
    while sizes[-1] < target or len(sizes) < 2:
        probe.step(len(sizes) - 1)
        sizes.append(len(probe.engine.checkpoint) + pending_extra)
    steps = len(sizes) - 1
    if steps > 1 and target - sizes[-2] < sizes[-1] - target:
        steps -= 1
    builder = _Builder()
    for n in range(steps):
        builder.step(n)
    builder.approve_external_write()
    return builder.built(label, steps)


# --- the operations -----------------------------------------------------------------------


def ops(b: Built) -> dict[str, Callable[[], object]]:
    """The measured callables for one checkpoint, each checked once for correctness.

    ``sign`` and ``restore`` are ratchet's; ``dumps_hmac`` and ``loads_verify`` are the
    plain baselines over the same state; ``trust`` is the Ed25519 check of the approval
    inside, which restore includes, measured alone to show its share.
    """
    state_dict = b.state.model_dump(mode="json")
    plain = json.dumps(state_dict).encode()
    plain_mac = hmac.new(BENCH_KEY, plain, hashlib.sha256).digest()
    observation = b.observation
    pending = b.state.pending
    approval = pending.approval if pending is not None else None
    if approval is None:
        raise RuntimeError("the benchmark state must hold an approved pending write")

    def observe(state: RunState, generation: int) -> Observation:
        return observation

    def sign() -> bytes:
        return seal_checkpoint(b.state, b.scenario, b.keyring, generation=b.generation)

    def restore() -> RunState:
        return restore_checkpoint(
            b.blob,
            scenario=b.scenario,
            keyring=b.keyring,
            high_water=b.store.high_water,
            observe=observe,
            approvers=b.approvers,
        ).state

    def dumps_hmac() -> bytes:
        data = json.dumps(state_dict).encode()
        return data + hmac.new(BENCH_KEY, data, hashlib.sha256).digest()

    def loads_verify() -> object:
        if not hmac.compare_digest(hmac.new(BENCH_KEY, plain, hashlib.sha256).digest(), plain_mac):
            raise RuntimeError("baseline MAC does not verify")
        return json.loads(plain)

    def trust() -> None:
        b.approvers.verify_approval(approval)

    # Correctness once, outside the timed loops: each side really round-trips the state.
    if sign() != b.blob:
        raise RuntimeError("sealing is not deterministic for the same state and generation")
    if restore() != b.state or loads_verify() != state_dict:
        raise RuntimeError("restore did not return the state that was sealed")
    return {
        "sign": sign,
        "restore": restore,
        "dumps_hmac": dumps_hmac,
        "loads_verify": loads_verify,
        "trust": trust,
    }


def _batch_us(fn: Callable[[], object], reps: int) -> float:
    clock = time.perf_counter_ns
    start = clock()
    for _ in range(reps):
        fn()
    return (clock() - start) / reps / 1000.0


def measure(
    fns: dict[str, Callable[[], object]], *, budget_s: float, batches: int, warmup: int
) -> dict[str, list[float]]:
    """Per-batch mean microseconds of every callable.

    All callables run inside every batch (in a rotating order), each for about the same
    wall time, so machine noise and drift hit candidate and baseline alike.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    slot_us = budget_s * 1e6 / batches / len(fns)
    reps = {name: max(3, int(slot_us / max(_batch_us(fn, 5), 0.05))) for name, fn in fns.items()}
    out: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for batch in range(batches):
        shift = batch % len(names)
        for name in names[shift:] + names[:shift]:
            out[name].append(_batch_us(fns[name], reps[name]))
    return out


def run(quick: bool) -> dict[str, Any]:
    """Build both checkpoints, measure, and return the report (see the module docstring)."""
    budget_s, batches, warmup = (0.9, 5, 20) if quick else (10.0, 11, 200)
    report: dict[str, Any] = {
        "python": platform.python_version(),
        "machine": "shared, noisy, 2 cores; ratios travel, absolute times do not",
        "mode": "quick" if quick else "full",
        "batches": batches,
    }
    for label, target in TARGETS.items():
        built = build_checkpoint(label, target)
        t = measure(ops(built), budget_s=budget_s, batches=batches, warmup=warmup)
        without_trust = [r - tr for r, tr in zip(t["restore"], t["trust"], strict=True)]
        report |= {
            f"size_{label}": len(built.blob),
            f"plain_size_{label}": len(json.dumps(built.state.model_dump(mode="json"))),
            f"trace_events_{label}": len(built.state.trace),
            f"executed_writes_{label}": len(built.state.executed),
            f"sign_us_{label}": round(median(t["sign"]), 1),
            f"restore_us_{label}": round(median(t["restore"]), 1),
            f"trust_check_us_{label}": round(median(t["trust"]), 1),
            f"baseline_dumps_hmac_us_{label}": round(median(t["dumps_hmac"]), 1),
            f"baseline_loads_verify_us_{label}": round(median(t["loads_verify"]), 1),
            f"sign_ratio_{label}": median_of_ratios(t["sign"], t["dumps_hmac"], 2),
            # The baseline for every ratio: json.dumps + stdlib HMAC of the same
            # data. The stricter mirror (json.loads + HMAC verify) is reported beside it.
            f"restore_ratio_{label}": median_of_ratios(t["restore"], t["dumps_hmac"], 2),
            f"restore_ratio_vs_loads_verify_{label}": median_of_ratios(
                t["restore"], t["loads_verify"], 2
            ),
            f"restore_ratio_without_trust_{label}": median_of_ratios(
                without_trust, t["dumps_hmac"], 2
            ),
            f"restore_ratio_without_trust_vs_loads_verify_{label}": median_of_ratios(
                without_trust, t["loads_verify"], 2
            ),
        }
    return report


ROWS = [
    ("envelope bytes", "size_{}", "{:d}"),
    ("trace events / executed writes", None, ""),
    ("sign: seal_checkpoint (us)", "sign_us_{}", "{:.1f}"),
    ("baseline json.dumps + HMAC (us)", "baseline_dumps_hmac_us_{}", "{:.1f}"),
    ("sign ratio", "sign_ratio_{}", "{:.2f}x"),
    ("restore: restore_checkpoint (us)", "restore_us_{}", "{:.1f}"),
    ("  of which Ed25519 trust check (us)", "trust_check_us_{}", "{:.1f}"),
    ("baseline json.loads + HMAC verify (us)", "baseline_loads_verify_us_{}", "{:.1f}"),
    ("restore ratio (vs dumps + HMAC, the issue's baseline)", "restore_ratio_{}", "{:.2f}x"),
    ("restore ratio (vs loads + HMAC verify)", "restore_ratio_vs_loads_verify_{}", "{:.2f}x"),
    ("restore ratio without the trust check", "restore_ratio_without_trust_{}", "{:.2f}x"),
]


def _table(report: dict[str, Any]) -> None:
    rows = []
    for title, key, fmt in ROWS:
        if key is None:
            cells = [
                f"{report[f'trace_events_{lb}']} / {report[f'executed_writes_{lb}']}"
                for lb in TARGETS
            ]
        else:
            cells = [fmt.format(report[key.format(lb)]) for lb in TARGETS]
        rows.append([title, *cells])
    print_table(
        f"checkpoint cost ({report['mode']} run, medians of {report['batches']} batches)",
        ["measure", *(f"~{label.upper()}" for label in TARGETS)],
        rows,
        caption=f"machine: {report['machine']}",
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(parser(__doc__), argv, quick="smoke run of about 3 s")
    emit(run(args.quick), as_json=args.json, table=_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
