"""The simulated environment: a workspace of files and an orders service, each a fenced
part that keeps its own truth, and the adapter a worker reaches them through.

Each part checks what the real one checks (:mod:`ratchet.adapters.journal` for files,
:mod:`ratchet.chaos.orders` for orders): the fence first (a fence below the highest the
part accepted for the run is refused and counted; an accepted one becomes the highest),
then the idempotency key (the same key and intent returns the existing receipt without a
second effect; another intent is a conflict carrying the receipt), then the planned
environment version, and only then the write, with its receipt, in one step.

What the simulator judges by is kept beside that check, not inside it: every fence a part
accepted (:attr:`Part.highest`), every effect with the fence and writer it came with
(:attr:`Part.effects`). A broken check (a mutant that accepts stale fences) is therefore
seen for what it is: a write accepted under a fence lower than one accepted before.

The adapter (:class:`SimAdapter`, one per worker process, like separate processes would
have) routes as :class:`ratchet.adapters.RouterAdapter` does: ``external_call`` to the
orders part, everything else to the files; one observation over both (the versions
summed, one fingerprint over both parts' states); a fence raised on both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ratchet.errors import AdapterError, FenceRejectedError, IdempotencyConflictError
from ratchet.runtime.actions import Action, ActionKind
from ratchet.runtime.canonical import Domain, digest
from ratchet.runtime.ports import Fence, Observation, ReadResult, Receipt, VerifierReport
from ratchet.runtime.scenario import Scenario

__all__ = [
    "INSTANCE_ID",
    "NOTE",
    "PLAN",
    "Effect",
    "Part",
    "SimAdapter",
    "SimEnvironment",
    "scenario",
]

NOTE = "note.txt"
INSTANCE_ID = "sim-env-1"
_DONE = "run 0: done\n"

#: The run's plan: the drill's without its first read (a read commits like any step and
#: adds nothing a write does not exercise): two file writes and an order (three intents),
#: a verification, finish. Every write's key is fixed by its position in the plan.
PLAN: list[dict[str, Any]] = [
    {"kind": "write_file", "args": {"path": NOTE, "content": "run 0: step 1\n"}},
    {
        "kind": "external_call",
        "args": {"operation": "place-order", "body": '{"qty":1,"run":0,"sku":"sim-0"}'},
    },
    {"kind": "write_file", "args": {"path": NOTE, "content": _DONE}},
    {"kind": "run_verifier", "args": {"target": "check"}},
    {"kind": "finish", "args": {"summary": "simulated plan done"}},
]
INTENTS = 3


def scenario() -> Scenario:
    """The run's task contract (the drill's, with this environment's names)."""
    return Scenario.model_validate(
        {
            "schema_version": 1,
            "task_id": "sim-order",
            "task_version": "1",
            "policy_id": "sim",
            "policy_version": "1",
            "permissions": ["read_file", "write_file", "external_call", "run_verifier", "finish"],
            "allowed_paths": [NOTE],
            "allowed_verifier_targets": ["check"],
            "allowed_operations": ["place-order"],
            "approval_required": [],
            "budgets": {
                "proposals": 400,
                "steps": 300,
                "wall_clock_seconds": 24 * 3600,
                "cost_units": 0,
            },
            "initial_files": {NOTE: "draft\n"},
            "verifier": {"target": "check", "expected_files": {NOTE: _DONE}},
        }
    )


@dataclass(frozen=True, slots=True)
class Effect:
    """One write a part performed: the intent, and the fence and writer it came with."""

    key: str
    intent_digest: str
    fence: tuple[int, int]
    writer: str
    seq: int  # the simulation's decision point at which it happened


@dataclass
class Part:
    """One fenced part of the environment (files or orders) and its truth."""

    name: str
    version: int = 0
    receipts: dict[str, Receipt] = field(default_factory=dict)
    fences: dict[str, tuple[int, int]] = field(default_factory=dict)  # what the check keeps
    highest: dict[str, tuple[int, int]] = field(default_factory=dict)  # every fence accepted
    effects: list[Effect] = field(default_factory=list)
    refused_stale: int = 0

    def check_fence(self, fence: Fence) -> bool:
        """The part's own fence check (the journal's): refuse a fence below the highest
        seen for the run; otherwise it becomes the highest."""
        seen = self.fences.get(fence.run_id)
        if seen is not None and fence.key() < seen:
            return False
        self.fences[fence.run_id] = fence.key()
        return True

    def admit(self, fence: Fence) -> tuple[int, int] | None:
        """Run the check; on acceptance record the fence in the truth. Returns the highest
        fence accepted *before* this one (None: none), for the caller's judgement.

        Raises FenceRejectedError when the check refuses it."""
        before = self.highest.get(fence.run_id)
        if not self.check_fence(fence):
            self.refused_stale += 1
            raise FenceRejectedError(
                f"the {self.name} part has seen a newer fence",
                run_id=fence.run_id,
                fence=fence.key(),
                seen=self.fences.get(fence.run_id),
            )
        if before is None or fence.key() > before:
            self.highest[fence.run_id] = fence.key()
        return before


# What the simulation is told when a part performs a write: (part, effect, fence accepted
# before it, the action); it judges the write there (see ratchet.chaos.sim.invariants).
WriteWitness = Callable[[Part, Effect, "tuple[int, int] | None", Action], None]


class SimEnvironment:
    """The files and the orders service of one simulated run (shared by every worker)."""

    def __init__(self, wall_s: Callable[[], int], witness: WriteWitness | None = None) -> None:
        self.files_part = Part("files")
        self.orders_part = Part("orders")
        self.files: dict[str, str] = {NOTE: "draft\n"}
        self.orders: list[str] = []
        self.wall_s = wall_s
        self.witness = witness
        self.seq: Callable[[], int] = lambda: 0
        self._seen: tuple[int, int, Observation] | None = None

    @property
    def version(self) -> int:
        return self.files_part.version + self.orders_part.version

    def _fingerprint(self, files: dict[str, str], orders: int) -> str:
        return digest(Domain.ENVIRONMENT, {"files": files, "orders": orders})

    def observe(self) -> Observation:
        # Every change moves a part's version on, so the pair of versions names the state.
        files, orders = self.files_part.version, self.orders_part.version
        seen = self._seen
        if seen is None or seen[0] != files or seen[1] != orders:
            observation = Observation(
                instance_id=INSTANCE_ID,
                version=files + orders,
                fingerprint=self._fingerprint(self.files, len(self.orders)),
            )
            seen = self._seen = (files, orders, observation)
        return seen[2]

    def project(self, action: Action, before: Observation) -> Observation | None:
        if not before.same_state(self.observe()):
            return None
        files, orders = dict(self.files), len(self.orders)
        if action.kind is ActionKind.EXTERNAL_CALL:
            orders += 1
        elif action.kind is ActionKind.WRITE_FILE:
            files[action.text("path")] = action.text("content")
        else:
            return None
        return Observation(
            instance_id=INSTANCE_ID,
            version=self.version + 1,
            fingerprint=self._fingerprint(files, orders),
        )

    def part_for(self, action: Action) -> Part:
        return self.orders_part if action.kind is ActionKind.EXTERNAL_CALL else self.files_part

    def raise_fence(self, fence: Fence) -> None:
        for part in (self.files_part, self.orders_part):
            part.admit(fence)

    def execute(
        self, action: Action, intent_digest: str, fence: Fence, writer: str
    ) -> tuple[Receipt, bool]:
        """Perform one write (fence, key, precondition, then the effect): the receipt and
        whether a new effect happened. Raises what a real part raises."""
        part = self.part_for(action)
        before = part.admit(fence)
        key = action.idempotency_key
        if key is None:
            raise AdapterError("writes need an idempotency key", retryable=False)
        existing = part.receipts.get(key)
        if existing is not None:
            if existing.intent_digest != intent_digest:
                raise IdempotencyConflictError(
                    "key was used for another intent", idempotency_key=key, receipt=existing
                )
            return existing, False
        if action.expected_env_version != self.version:
            raise AdapterError(
                "environment precondition failed",
                retryable=False,
                expected=action.expected_env_version,
                actual=self.version,
            )
        if action.kind is ActionKind.EXTERNAL_CALL:
            self.orders.append(key)
            result: dict[str, str | int] = {"operation": action.text("operation"), "status": "ok"}
        else:
            self.files[action.text("path")] = action.text("content")
            result = {"path": action.text("path")}
        part.version += 1
        receipt = Receipt(
            namespace=f"sim-{part.name}",
            receipt_version=1,
            receipt_id=f"{part.name}-{len(part.receipts) + 1}",
            idempotency_key=key,
            intent_digest=intent_digest,
            result=result,
            committed_at=self.wall_s(),
            env_version_after=self.version,
        )
        part.receipts[key] = receipt
        effect = Effect(key, intent_digest, fence.key(), writer, self.seq())
        part.effects.append(effect)
        if self.witness is not None:
            self.witness(part, effect, before, action)
        return receipt, True

    def lookup(self, key: str) -> Receipt | None:
        return self.files_part.receipts.get(key) or self.orders_part.receipts.get(key)

    def read(self, action: Action) -> ReadResult:
        path = action.text("path")
        if path not in self.files:
            raise AdapterError(f"no such file {path!r}", retryable=False, path=path)
        return ReadResult(content=self.files[path], env_version=self.version)

    def verify(self, target: str) -> VerifierReport:
        if target != "check":
            raise AdapterError(f"unknown verifier target {target!r}", target=target)
        passed = self.files.get(NOTE) == _DONE
        seen = self.observe()
        return VerifierReport(
            target=target,
            passed=passed,
            env_instance_id=seen.instance_id,
            env_version=seen.version,
            env_fingerprint=seen.fingerprint,
            output_digest=digest(Domain.ENVIRONMENT, {"target": target, "passed": passed}),
        )

    @property
    def effects(self) -> list[Effect]:
        return [*self.files_part.effects, *self.orders_part.effects]


class SimAdapter:
    """One worker process's adapter over the shared environment (see the module
    docstring). ``writer`` names the worker in the environment's truth."""

    enforces_preconditions = False  # the engine re-observes before each write, as for files

    def __init__(self, env: SimEnvironment, writer: str) -> None:
        self.env = env
        self.writer = writer

    def __repr__(self) -> str:
        return f"SimAdapter(writer={self.writer!r})"

    @property
    def namespace(self) -> str:
        return "sim"

    def observe(self) -> Observation:
        return self.env.observe()

    def project(self, action: Action, before: Observation) -> Observation | None:
        return self.env.project(action, before)

    def raise_fence(self, fence: Fence) -> None:
        self.env.raise_fence(fence)

    def execute(
        self, action: Action, intent_digest: str, fence: Fence, approval_digest: str | None
    ) -> Receipt:
        receipt, _ = self.env.execute(action, intent_digest, fence, self.writer)
        return receipt

    def lookup(self, idempotency_key: str) -> Receipt | None:
        return self.env.lookup(idempotency_key)

    def read(self, action: Action) -> ReadResult:
        return self.env.read(action)

    def verify(self, target: str) -> VerifierReport:
        return self.env.verify(target)
