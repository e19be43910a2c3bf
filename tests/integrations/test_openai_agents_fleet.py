"""An OpenAI Agents SDK agent run by ratchet on a real fleet: a real redis-server, the
worker's own job code (in this process, and in worker processes one of which is
SIGKILLed right after the tool call, before its receipt is committed), the agents of
``tests.integrations.oai_shop`` talking to a local OpenAI-compatible server that counts
the requests it gets from every process, and a payments service that counts its calls
and effects outside ratchet.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

pytest.importorskip(
    "agents", reason="openai-agents is not installed (pip install -e '.[openai-agents]')"
)

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from ratchet.demo.examples import make_greeting_workspace
from ratchet.errors import ConfigurationError
from ratchet.fleet.context import Fleet
from ratchet.fleet.settings import Settings
from ratchet.integrations.openai_agents import OpenAIAgentsState
from ratchet.ops import approve, inspect_run, submit
from ratchet.runtime import Phase, TraceOutcome
from ratchet.testing.chat_stub import ChatStub
from ratchet.worker.job import execute_run
from tests.integrations.oai_shop import OAI_KEY
from tests.integrations.payments import effects, tool_calls
from tests.integrations.runs import outcomes, run_to_rest, shop_document
from tests.worker.fleet_harness import phase, poll, workers

pytestmark = pytest.mark.slow


def journal(fleet: Fleet, run_id: str) -> OpenAIAgentsState:
    return OpenAIAgentsState.load(inspect_run(fleet, run_id).state.agent_state)


def told(state: OpenAIAgentsState) -> list[dict[str, object]]:
    """What the model was told of its calls (the journal's function_call_output items)."""
    return [
        json.loads(str(i["output"]))
        for i in state.items()
        if i.get("type") == "function_call_output"
    ]


def test_an_agents_sdk_agent_completes_on_a_worker_process_with_one_refund(
    oai_fleet: Fleet, oai_settings: Settings, oai_stub: ChatStub, tmp_path: Path
) -> None:
    root = make_greeting_workspace(tmp_path / "ws")
    run_id = submit(oai_fleet, shop_document(root, "oai_shop:refunds", tools=["create_refund"]))
    with workers(oai_settings) as pool:
        pool.start(1)
        poll(
            lambda: phase(oai_fleet, run_id) in ("completed", "failed"),
            deadline_s=90,
            what="the run ended",
        )
    state = inspect_run(oai_fleet, run_id).state
    assert state.phase is Phase.COMPLETED, state.stop_reason
    assert effects("create_refund") == 1 and tool_calls("create_refund") == 1
    # The refund's request, and the answer with its result; verify and finish ask nothing.
    assert len(oai_stub.requests) == 2 and all(r.authorized for r in oai_stub.requests)
    kept = journal(oai_fleet, run_id)
    assert kept.model_requests == 2 and kept.output == "Refunded 500 cents on order A-1."
    receipt = state.executed[-1].receipt
    assert receipt.result["tool"] == "create_refund"
    assert json.loads(str(receipt.result["output"])) == {"amount_cents": 500, "order_id": "A-1"}
    assert [answer["status"] for answer in told(kept)] == ["done"]
    assert OAI_KEY not in json.dumps(state.agent_state)


def test_a_worker_killed_after_the_tool_call_is_taken_over_without_asking_the_model_again(
    oai_fleet: Fleet, oai_settings: Settings, oai_stub: ChatStub, tmp_path: Path
) -> None:
    root = make_greeting_workspace(tmp_path / "ws")
    run_id = submit(oai_fleet, shop_document(root, "oai_shop:refunds", tools=["create_refund"]))
    with workers(oai_settings) as pool:
        # The write's adapter call returned (the refund was made); its receipt is not
        # committed: SIGKILL.
        (doomed,) = pool.start(1, env={"RATCHET_FAILPOINTS": "after_adapter_before_receipt=kill"})
        poll(lambda: not doomed.is_alive(), deadline_s=60, what="the doomed worker died")
        assert doomed.exitcode == -signal.SIGKILL
        stored = inspect_run(oai_fleet, run_id).state
        assert stored.pending is not None and stored.pending.receipt is None  # intent only
        assert stored.pending.action.kind == "create_refund"
        assert effects("create_refund") == 1  # ... and the refund was made
        assert len(oai_stub.requests) == 1
        # The journaled response came with the intent, in the same commit.
        assert OpenAIAgentsState.load(stored.agent_state).model_requests == 1
        pool.start(1)
        poll(
            lambda: phase(oai_fleet, run_id) in ("completed", "failed"),
            deadline_s=90,
            what="the run taken over and ended",
        )
    state = inspect_run(oai_fleet, run_id).state
    assert state.phase is Phase.COMPLETED, state.stop_reason
    # The new owner settled the call from the tool ledger's record of it: reconciled,
    # never sent again, the effect made once.
    assert effects("create_refund") == 1 and tool_calls("create_refund") == 1
    assert TraceOutcome.RECONCILED in outcomes(oai_fleet, run_id)
    # The model was asked for the step after the refund only: the refund's step came
    # from the journal, not from a second request for the first turn.
    assert len(oai_stub.requests) == 2
    second = oai_stub.requests[1].body
    assert second is not None and [m["role"] for m in second["messages"]] == [
        "system",
        "user",
        "assistant",
        "tool",
    ]
    kept = journal(oai_fleet, run_id)
    assert kept.model_requests == 2 and [a["status"] for a in told(kept)] == ["done"]


def test_a_call_of_a_tool_that_needs_approval_waits_for_it(
    oai_settings: Settings, oai_stub: ChatStub, tmp_path: Path
) -> None:
    key = Ed25519PrivateKey.generate()
    trust = tmp_path / "approvers.json"
    raw = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()
    trust.write_text(json.dumps({"alice": raw}))
    fleet = Fleet.connect(oai_settings.model_copy(update={"approvers_file": trust}))
    root = make_greeting_workspace(tmp_path / "ws")
    # The SDK tool's needs_approval made the ratchet tool require approval: a scenario
    # that does not ask for it is refused at submit.
    with pytest.raises(ConfigurationError, match="requires approval"):
        submit(fleet, shop_document(root, "oai_shop:accounts", tools=["close_account"]))
    doc = shop_document(
        root, "oai_shop:accounts", tools=["close_account"], approval_required=("close_account",)
    )
    run_id = submit(fleet, doc)
    assert run_to_rest(fleet, run_id, "w") == "awaiting_approval"
    assert effects("close_account") == 0 and tool_calls("close_account") == 0
    pending = inspect_run(fleet, run_id).state.pending
    assert pending is not None and pending.action.kind == "close_account"
    assert dict(pending.action.args) == {"customer": "c-7"}
    execute_run(fleet, run_id, owner="w-idle")  # nothing asks the model while it waits
    assert len(oai_stub.requests) == 1 and effects("close_account") == 0
    approve(fleet, run_id, pending.action.action_id, key=key, approver_id="alice")
    assert run_to_rest(fleet, run_id, "w-after") == "completed"
    assert effects("close_account") == 1 and len(oai_stub.requests) == 2
    assert inspect_run(fleet, run_id).state.executed[-1].receipt.approval_digest is not None


def test_a_proposals_budget_stops_an_agent_that_keeps_calling(
    oai_fleet: Fleet, tmp_path: Path
) -> None:
    root = make_greeting_workspace(tmp_path / "ws")
    budgets = {"proposals": 4, "steps": 4, "wall_clock_seconds": 3600, "cost_units": 0}
    doc = shop_document(root, "oai_shop:curious", tools=["order_status"], budgets=budgets)
    run_id = submit(oai_fleet, doc)
    assert run_to_rest(oai_fleet, run_id, "w") == "failed"
    state = inspect_run(oai_fleet, run_id).state
    assert state.stop_reason == "budget exhausted: proposals"
    assert state.usage.proposals == 4 and tool_calls("order_status") == 4
    assert outcomes(oai_fleet, run_id)[-1] is TraceOutcome.BUDGET_EXHAUSTED


def test_model_tokens_are_charged_as_cost_units_until_the_budget_runs_out(
    oai_fleet: Fleet, oai_stub: ChatStub, tmp_path: Path
) -> None:
    root = make_greeting_workspace(tmp_path / "ws")
    budgets = {"proposals": 20, "steps": 20, "wall_clock_seconds": 3600, "cost_units": 30}
    doc = shop_document(
        root,
        "oai_shop:curious",
        tools=["order_status"],
        budgets=budgets,
        agent_config={"tokens_per_cost_unit": 10},
    )
    run_id = submit(oai_fleet, doc)
    assert run_to_rest(oai_fleet, run_id, "w") == "failed"
    state = inspect_run(oai_fleet, run_id).state
    assert state.stop_reason == "budget exhausted: cost_units"
    # Every request reports 50 tokens: 5 units a step. Six steps spent the 30; the
    # seventh was refused before its call.
    assert state.usage.cost_units == 30 and state.usage.steps == 6
    assert tool_calls("order_status") == 6 and len(oai_stub.requests) == 7
