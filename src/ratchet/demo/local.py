"""The spec's example task, run end to end on the contract core with a crash in the middle.

A workspace holds ``app.py`` printing the wrong greeting. A scripted agent reads it, writes
the fix under an idempotency key, runs the verifier and finishes. The first owner (lease
version 1) dies in the hardest window, after the adapter applied the write and before its
receipt was committed; a new owner (lease version 2) restores the last checkpoint, raises
the adapter's fence, reconciles the write from the adapter's receipt, and completes the
run. The old owner's late retry is refused by the fence. The workspace records exactly one
write.

Everything runs in one process on the in-memory stand-ins of :mod:`ratchet.testing.memory`
(a dict workspace, a dict generation store, a hand-moved clock): it shows the contract,
not the distributed system. The multi-worker demo on embedded Redis is
:mod:`ratchet.demo.fleet`.
"""

from __future__ import annotations

import contextlib
import secrets
from dataclasses import dataclass, field
from typing import Any

from ratchet.demo.examples import RIGHT_GREETING, greeting_scenario
from ratchet.errors import FenceRejectedError
from ratchet.runtime import (
    Action,
    CrashWindow,
    KeyRing,
    RunEngine,
    RunState,
    Scenario,
    derive_idempotency_key,
    effects,
)
from ratchet.runtime.checkpoint import run_key
from ratchet.runtime.effects import drive
from ratchet.testing.memory import ManualClock, MemoryGenerationStore, MemoryWorkspace
from ratchet.worker.executor import Executor, WindowProbe

__all__ = ["DEMO_NOTE", "DemoReport", "InjectedCrash", "run_demo"]

DEMO_NOTE = (
    "This demo runs in one process on in-memory stand-ins (a dict workspace and an "
    "in-memory generation store). The multi-worker demo on embedded Redis, with a worker "
    "killed mid-run, is `ratchet demo` without --local."
)
RUN_ID = "demo-run-1"
CRASH_WINDOW = CrashWindow.AFTER_ADAPTER_BEFORE_RECEIPT
_RISKS = {
    "read_file": "read_only",
    "write_file": "reversible_write",
    "run_verifier": "verification",
    "finish": "control",
}


class InjectedCrash(Exception):  # noqa: N818 - it is a simulated crash, not an error
    """Raised by the demo's probe to play a worker dying at one crash window."""


def demo_scenario() -> Scenario:
    """The task contract of the example: fix the greeting in ``app.py``."""
    return greeting_scenario(
        budgets={"proposals": 20, "steps": 10, "wall_clock_seconds": 600, "cost_units": 100}
    )


@dataclass
class DemoReport:
    """What the demo did and the checks it made. ``ok`` is True when every check held."""

    run_id: str
    phase: str
    generation: int
    write_count: int
    crash_window: str
    recovered_window: str | None
    reconcile_outcome: str
    lease_version: int
    stale_write_refused: bool
    final_content: str
    trace: list[dict[str, Any]]
    checks: dict[str, bool] = field(default_factory=dict)
    note: str = DEMO_NOTE

    @property
    def ok(self) -> bool:
        return all(self.checks.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "run_id": self.run_id,
            "phase": self.phase,
            "generation": self.generation,
            "write_count": self.write_count,
            "crash_window": self.crash_window,
            "crash_window_recovered": self.recovered_window,
            "reconcile_outcome": self.reconcile_outcome,
            "lease_version": self.lease_version,
            "stale_write_refused": self.stale_write_refused,
            "trace_outcomes": [e["outcome"] for e in self.trace],
            "trace": self.trace,
            "checks": self.checks,
            "note": self.note,
        }


def _action(
    engine: RunEngine, clock: ManualClock, kind: str, args: dict[str, str], key: str | None = None
) -> Action:
    """What the scripted agent proposes: planned against the current environment version."""
    state = engine.state
    return Action.model_validate(
        {
            "action_id": f"a-{state.next_seq}",
            "kind": kind,
            "risk": _RISKS[kind],
            "args": args,
            "idempotency_key": key,
            "expected_env_version": state.environment.version,
            "deadline_at": clock.now() + 60,
        }
    )


def _trace(state: RunState) -> list[dict[str, Any]]:
    return [
        {
            "seq": e.seq,
            "outcome": e.outcome.value,
            "idempotency_key": e.idempotency_key,
            "env_version": e.env_version,
        }
        for e in state.trace
    ]


def run_demo(checkpoint_key: bytes | None = None) -> DemoReport:
    """Run the example with an injected crash and a recovery by a new owner.

    ``checkpoint_key`` signs the checkpoints (at least 32 bytes); by default a fresh
    random key is used and forgotten. It never appears in the report.

    Raises:
        RatchetError: the core refused something the script expected to work.
    """
    scenario = demo_scenario()
    clock = ManualClock()
    keyring = KeyRing.from_secrets(
        {"demo": checkpoint_key or secrets.token_bytes(32)}, signing_kid="demo"
    )
    workspace = MemoryWorkspace(
        "ws-demo",
        scenario.initial_files,
        clock=clock,
        expectations={"unit": scenario.verifier.expected_files},
    )
    store = MemoryGenerationStore()
    ports: dict[str, Any] = {
        "scenario": scenario,
        "keyring": keyring,
        "executor": Executor(workspace, store),
        "clock": clock,
        "archive_trace": True,
    }

    crashed: list[CrashWindow] = []

    def crash_once(window: CrashWindow) -> None:
        if window is CRASH_WINDOW and not crashed:
            crashed.append(window)
            raise InjectedCrash(window.value)

    crashing = {**ports, "executor": Executor(workspace, store, hooks=WindowProbe(crash_once))}

    # Owner 1 (lease version 1): read, then write the fix; it dies after the adapter
    # applied the write and before the receipt was committed.
    first = RunEngine.start(RUN_ID, lease_version=1, **crashing)
    first.propose(_action(first, clock, "read_file", {"path": "app.py"}))
    clock.advance(2)
    key = derive_idempotency_key(RUN_ID, first.state.plan_cursor)
    with contextlib.suppress(InjectedCrash):  # recorded in ``crashed`` by the probe
        first.propose(
            _action(first, clock, "write_file", {"path": "app.py", "content": RIGHT_GREETING}, key)
        )
    clock.advance(30)  # the lease expires; another worker takes the run over

    # Owner 2 (lease version 2): restore the checkpoint at the high-water mark (which
    # raises the fence), then reconcile the pending write from the adapter's receipt.
    stored = drive(effects.load(run_key(first.state)), ports["executor"])
    second = RunEngine.resume(stored.blob, archive=stored.archive, lease_version=2, **ports)
    reconciled = second.reconcile()

    # The old owner wakes up and retries its write: the fence refuses it.
    refused_before, stale_refused = workspace.refused_stale, False
    try:
        first.execute_pending()
    except FenceRejectedError:
        stale_refused = workspace.refused_stale == refused_before + 1

    second.propose(_action(second, clock, "run_verifier", {"target": "unit"}))
    clock.advance(1)
    second.propose(_action(second, clock, "finish", {"summary": "greeting fixed"}))
    # The final checkpoint restores under every check, as a third owner would see it.
    stored = drive(effects.load(second.key), ports["executor"])
    final = RunEngine.resume(stored.blob, archive=stored.archive, lease_version=3, **ports)

    state = final.state
    report = DemoReport(
        run_id=state.run_id,
        phase=state.phase.value,
        generation=final.generation,
        write_count=workspace.write_count,
        crash_window=CRASH_WINDOW.value,
        recovered_window=reconciled.window.value if reconciled.window else None,
        reconcile_outcome=reconciled.outcome.value,
        lease_version=second.lease_version,
        stale_write_refused=stale_refused,
        final_content=workspace.files["app.py"],
        trace=_trace(state),
    )
    report.checks = {
        "crash was injected": crashed == [CRASH_WINDOW],
        "recovered the same window": report.recovered_window == CRASH_WINDOW.value,
        "reconciled from the adapter's receipt": report.reconcile_outcome == "reconciled",
        "exactly one write": report.write_count == 1,
        "stale owner fenced off": stale_refused,
        "greeting fixed": report.final_content == RIGHT_GREETING,
        "run completed": report.phase == "completed",
    }
    return report
