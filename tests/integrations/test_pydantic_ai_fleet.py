"""A Pydantic AI agent run by ratchet on a real fleet: a real redis-server, the worker's
own job code (in this process, and in worker processes one of which is SIGKILLed right
after the tool call), the agents of ``tests.integrations.shop`` driven by Pydantic AI's
own test models, and a payments service that counts its calls and effects outside ratchet.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

pytest.importorskip(
    "pydantic_ai", reason="pydantic-ai-slim is not installed (pip install -e '.[pydantic-ai]')"
)

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from ratchet.chaos.failpoints import FailpointFired
from ratchet.demo.examples import make_greeting_workspace
from ratchet.fleet.context import Fleet
from ratchet.fleet.settings import Settings
from ratchet.integrations.pydantic_ai import PydanticAIState
from ratchet.ops import approve, inspect_run, submit
from ratchet.runtime import Phase, ReviewReason, TraceOutcome
from ratchet.worker.hooks import WorkerHooks
from ratchet.worker.job import execute_run
from tests.integrations.runs import outcomes, run_to_rest, shop_document
from tests.integrations.shop import effects, model_requests, tool_calls
from tests.worker.fleet_harness import phase, poll, workers

pytestmark = pytest.mark.slow


def journal(fleet: Fleet, run_id: str) -> PydanticAIState:
    return PydanticAIState.load(inspect_run(fleet, run_id).state.agent_state)


def test_a_pydantic_ai_agent_completes_on_worker_processes_with_one_refund(
    pai_fleet: Fleet, pai_settings: Settings, tmp_path: Path
) -> None:
    root = make_greeting_workspace(tmp_path / "ws")
    run_id = submit(pai_fleet, shop_document(root, "shop:refunds", tools=["create_refund"]))
    with workers(pai_settings) as pool:
        pool.start(1)
        poll(
            lambda: phase(pai_fleet, run_id) in ("completed", "failed"),
            deadline_s=90,
            what="the run ended",
        )
    state = inspect_run(pai_fleet, run_id).state
    assert state.phase is Phase.COMPLETED, state.stop_reason
    assert effects("create_refund") == 1 and tool_calls("create_refund") == 1
    # The refund, the model's answer with its result, the verification, the finish.
    assert model_requests("refunds") == 2
    kept = journal(pai_fleet, run_id)
    assert kept.model_requests == 2 and kept.output == "Refunded 500 cents on order A-1."
    receipt = state.executed[-1].receipt
    assert receipt.result["tool"] == "create_refund"
    assert json.loads(str(receipt.result["output"])) == {"amount_cents": 500, "order_id": "A-1"}
    # What the model was told: the call took effect.
    messages = kept.messages()
    returned = [
        p for m in messages for p in getattr(m, "parts", []) if p.part_kind == "tool-return"
    ]
    assert [(p.tool_name, p.outcome) for p in returned] == [("create_refund", "success")]
    assert json.loads(str(returned[0].content))["status"] == "done"


def test_pydantic_ais_test_model_drives_a_run_to_completion(
    pai_fleet: Fleet, tmp_path: Path
) -> None:
    root = make_greeting_workspace(tmp_path / "ws")
    doc = shop_document(root, "shop:test_model_refunds", tools=["create_refund"])
    run_id = submit(pai_fleet, doc)
    assert run_to_rest(pai_fleet, run_id, "w") == "completed"
    assert effects("create_refund") == 1
    assert journal(pai_fleet, run_id).model_requests == 2


def test_a_worker_killed_right_after_the_tool_call_is_taken_over_without_asking_again(
    pai_fleet: Fleet, pai_settings: Settings, tmp_path: Path
) -> None:
    root = make_greeting_workspace(tmp_path / "ws")
    run_id = submit(pai_fleet, shop_document(root, "shop:refunds", tools=["create_refund"]))
    with workers(pai_settings) as pool:
        # The first write's adapter call returned; its receipt is not committed: SIGKILL.
        (doomed,) = pool.start(1, env={"RATCHET_FAILPOINTS": "after_adapter_before_receipt=kill"})
        poll(lambda: not doomed.is_alive(), deadline_s=60, what="the doomed worker died")
        assert doomed.exitcode == -signal.SIGKILL
        stored = inspect_run(pai_fleet, run_id).state
        assert stored.pending is not None and stored.pending.receipt is None  # intent only
        assert stored.pending.action.kind == "create_refund"
        assert effects("create_refund") == 1  # ... and the refund was made
        assert model_requests("refunds") == 1
        # The journaled response came with the intent, in the same commit.
        assert PydanticAIState.load(stored.agent_state).model_requests == 1
        pool.start(1)
        poll(
            lambda: phase(pai_fleet, run_id) in ("completed", "failed"),
            deadline_s=90,
            what="the run taken over and ended",
        )
    state = inspect_run(pai_fleet, run_id).state
    assert state.phase is Phase.COMPLETED, state.stop_reason
    # The new owner settled the call from the tool ledger's record of it (the call had
    # returned): reconciled, never sent again.
    assert effects("create_refund") == 1 and tool_calls("create_refund") == 1
    assert TraceOutcome.RECONCILED in outcomes(pai_fleet, run_id)
    # The model was asked for the step after the refund only: the refund's step came
    # from the journal, not from a second request.
    assert model_requests("refunds") == 2
    assert journal(pai_fleet, run_id).model_requests == 2


class DieAfterTheCall(WorkerHooks):
    """The worker dies right after the tool returned, before anything recorded it."""

    def write_stage(self, stage: str) -> None:
        if stage == "after_call":
            raise FailpointFired("after_call")


def test_a_call_cut_off_inside_a_tool_without_recovery_waits_for_a_reviewer(
    pai_settings: Settings, tmp_path: Path
) -> None:
    fleet = Fleet.connect(pai_settings.model_copy(update={"lease_ttl_ms": 1000}))
    root = make_greeting_workspace(tmp_path / "ws")
    run_id = submit(fleet, shop_document(root, "shop:cancels", tools=["cancel_order"]))
    with pytest.raises(FailpointFired):
        execute_run(fleet, run_id, owner="w-dies", hooks=DieAfterTheCall())
    assert effects("cancel_order") == 1 and model_requests("cancels") == 1
    poll(lambda: not fleet.store.read_run(run_id).lease_live, deadline_s=30, what="expired")
    # The tool can neither be looked up nor called again: its started row proves the call
    # was sent, nothing proves how it ended. A reviewer decides; ratchet does not resend.
    execute_run(fleet, run_id, owner="w-next")
    view = inspect_run(fleet, run_id)
    assert view.state.phase is Phase.NEEDS_REVIEW
    case = view.state.review
    assert case is not None and case.reason is ReviewReason.OUTCOME_UNKNOWN
    assert case.pending.action.kind == "cancel_order"
    assert effects("cancel_order") == 1 and tool_calls("cancel_order") == 1
    assert model_requests("cancels") == 1


def test_a_call_of_a_tool_that_needs_approval_waits_for_it(
    settings: Settings, pai_settings: Settings, tmp_path: Path
) -> None:
    key = Ed25519PrivateKey.generate()
    trust = tmp_path / "approvers.json"
    raw = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()
    trust.write_text(json.dumps({"alice": raw}))
    fleet = Fleet.connect(pai_settings.model_copy(update={"approvers_file": trust}))
    root = make_greeting_workspace(tmp_path / "ws")
    doc = shop_document(
        root, "shop:accounts", tools=["close_account"], approval_required=("close_account",)
    )
    run_id = submit(fleet, doc)
    assert run_to_rest(fleet, run_id, "w") == "awaiting_approval"
    assert effects("close_account") == 0 and tool_calls("close_account") == 0
    pending = inspect_run(fleet, run_id).state.pending
    assert pending is not None and pending.action.kind == "close_account"
    assert dict(pending.action.args) == {"customer": "c-7"}
    # Nothing asks the model while the run waits: a job finds nothing to do.
    execute_run(fleet, run_id, owner="w-idle")
    assert model_requests("accounts") == 1 and effects("close_account") == 0
    approve(fleet, run_id, pending.action.action_id, key=key, approver_id="alice")
    assert run_to_rest(fleet, run_id, "w-after") == "completed"
    assert effects("close_account") == 1
    receipt = inspect_run(fleet, run_id).state.executed[-1].receipt
    assert receipt.approval_digest is not None
    assert model_requests("accounts") == 2


def test_a_proposals_budget_stops_an_agent_that_keeps_calling(
    pai_fleet: Fleet, tmp_path: Path
) -> None:
    root = make_greeting_workspace(tmp_path / "ws")
    budgets = {"proposals": 4, "steps": 4, "wall_clock_seconds": 3600, "cost_units": 0}
    doc = shop_document(root, "shop:curious", tools=["order_status"], budgets=budgets)
    run_id = submit(pai_fleet, doc)
    assert run_to_rest(pai_fleet, run_id, "w") == "failed"
    state = inspect_run(pai_fleet, run_id).state
    assert state.stop_reason == "budget exhausted: proposals"
    assert state.usage.proposals == 4 and tool_calls("order_status") == 4
    assert outcomes(pai_fleet, run_id)[-1] is TraceOutcome.BUDGET_EXHAUSTED


def test_model_tokens_are_charged_as_cost_units_until_the_budget_runs_out(
    pai_fleet: Fleet, tmp_path: Path
) -> None:
    root = make_greeting_workspace(tmp_path / "ws")
    budgets = {"proposals": 20, "steps": 20, "wall_clock_seconds": 3600, "cost_units": 30}
    doc = shop_document(
        root,
        "shop:curious",
        tools=["order_status"],
        budgets=budgets,
        agent_config={"tokens_per_cost_unit": 10},
    )
    run_id = submit(pai_fleet, doc)
    assert run_to_rest(pai_fleet, run_id, "w") == "failed"
    state = inspect_run(pai_fleet, run_id).state
    assert state.stop_reason == "budget exhausted: cost_units"
    # Each step charged its request's tokens: what was spent is within the budget, and
    # the step that would have gone past it was refused before its call.
    assert 0 < state.usage.cost_units <= 30
    assert tool_calls("order_status") == state.usage.steps
