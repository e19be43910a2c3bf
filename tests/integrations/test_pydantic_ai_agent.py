"""The Pydantic AI integration without a fleet: declarations, configuration, what the
model is offered, a response's calls proposed one per step from the journal, model
errors, and the journal's bound."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip(
    "pydantic_ai", reason="pydantic-ai-slim is not installed (pip install -e '.[pydantic-ai]')"
)

from pydantic_ai import Agent, RunContext
from pydantic_ai.exceptions import ModelHTTPError
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from ratchet.agents import step_key
from ratchet.errors import AdapterError, ConfigurationError, IntegrityError
from ratchet.integrations.pydantic_ai import (
    PydanticAIState,
    RatchetAgent,
    current_call,
)
from ratchet.runtime import TraceOutcome
from ratchet.runtime.catalog import BUILTIN_TOOLS
from ratchet.tools import Recovery, ToolCall
from tests.integrations import shop
from tests.integrations.views import view

REFUND = shop.create_refund_tool.spec
STATUS = shop.order_status_tool.spec
ALL = (REFUND, STATUS, BUILTIN_TOOLS["run_verifier"], BUILTIN_TOOLS["finish"])


# -- declarations -----------------------------------------------------------------------------


def test_a_function_tool_is_declared_with_its_description_schema_and_approval() -> None:
    assert REFUND.risk.value == "irreversible_external_write"
    assert REFUND.recovery is Recovery.IDEMPOTENT and not REFUND.requires_approval
    assert REFUND.description.startswith("Refund part of an order.")
    assert set(REFUND.json_schema["properties"]) == {"order_id", "amount_cents"}
    assert STATUS.risk.value == "read_only"
    closing = shop.close_account_tool.spec  # the agent's tool asks for approval
    assert closing.requires_approval and closing.recovery is Recovery.REVIEW


def test_the_tool_runs_the_agents_function_and_it_sees_the_call(shop_dir: Any) -> None:
    assert current_call() is None
    call = ToolCall(run_id="run-1", tool="create_refund", idempotency_key="k-1", fence=None)
    out = shop.create_refund_tool.run(
        shop.create_refund_tool.parse_args({"order_id": "A-1", "amount_cents": 5}), call
    )
    assert out == {"order_id": "A-1", "amount_cents": 5}
    assert (shop_dir / "create_refund" / "k-1").exists() and current_call() is None


def plain(order_id: str) -> str:
    return order_id


def test_declarations_that_cannot_hold_are_refused_in_one_line() -> None:
    agent: Agent[None, str] = Agent(FunctionModel(lambda m, i: ModelResponse(parts=[])))

    @agent.tool
    def with_context(ctx: RunContext[None], order_id: str) -> str:
        return order_id

    @agent.tool_plain
    def priced(amount: float) -> float:
        return amount

    wrapped = RatchetAgent(agent, prompt="p")
    for name, message in (
        ("missing", "has no function tool 'missing'"),
        ("with_context", "takes a RunContext"),
        ("priced", "admit floats"),
    ):
        with pytest.raises(ConfigurationError, match=message) as caught:
            wrapped.tool(name)
        assert "\n" not in str(caught.value)
    clash: Agent[None, str] = Agent(FunctionModel(lambda m, i: ModelResponse(parts=[])))
    clash.tool_plain(name="read_file")(plain)
    with pytest.raises(ConfigurationError, match="built-in kind's name"):
        RatchetAgent(clash)


def test_the_configuration_is_checked_strictly() -> None:
    with pytest.raises(ConfigurationError) as caught:
        shop.refunds({"promt": "x"})
    assert caught.value.field == "agent_config.promt"
    with pytest.raises(ConfigurationError, match="tokens_per_cost_unit"):
        shop.refunds({"tokens_per_cost_unit": 0})
    with pytest.raises(ConfigurationError, match=r"agent_config\.prompt is needed"):
        RatchetAgent(shop.refund_agent)({})
    assert shop.refunds({"prompt": "Refund A-2."}).config.prompt == "Refund A-2."


# -- steps ------------------------------------------------------------------------------------


class Recorded:
    """A FunctionModel's function that answers from a list and records what it was shown."""

    def __init__(self, *responses: ModelResponse) -> None:
        self.responses = list(responses)
        self.offered: list[list[str]] = []

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.offered.append(sorted(t.name for t in info.function_tools))
        return self.responses.pop(0)


def two_calls() -> ModelResponse:
    return ModelResponse(
        parts=[
            ToolCallPart(
                "create_refund", {"order_id": "A-1", "amount_cents": 5}, tool_call_id="c1"
            ),
            ToolCallPart("order_status", {"order_id": "A-1"}, tool_call_id="c2"),
        ]
    )


def test_a_responses_calls_are_proposed_one_per_step_without_asking_again(shop_dir: Any) -> None:
    model = Recorded(two_calls(), ModelResponse(parts=[TextPart("All done.")]))
    agent = RatchetAgent(shop.refund_agent, prompt="Refund A-1.")
    with shop.refund_agent.override(model=FunctionModel(model)):
        ratchet_agent = agent({"tokens_per_cost_unit": 10})
        first = ratchet_agent.next_step(view(ALL))
        assert first is not None
        action = first.action
        assert (action["kind"], action["args"]) == (
            "create_refund",
            {"order_id": "A-1", "amount_cents": 5},
        )
        assert action["idempotency_key"] == step_key(view(ALL), 0)
        assert action["expected_env_version"] == 3 and action["cost_units"] >= 1
        # finish is the output's, never a tool; order_status only because it is permitted.
        assert model.offered == [["create_refund", "order_status", "run_verifier"]]
        # The refund took effect: the next call of the same response, from the journal.
        done = view(
            ALL,
            first.agent_state,
            proposals=1,
            outcome=TraceOutcome.EXECUTED,
            executed=frozenset({action["idempotency_key"]}),
        )
        second = ratchet_agent.next_step(done)
        assert second is not None and second.action["kind"] == "order_status"
        assert second.action["idempotency_key"] is None and "cost_units" not in second.action
        assert len(model.offered) == 1
        # The read returned: both results go back, the model answers, the output is verified.
        read = view(
            ALL,
            second.agent_state,
            proposals=2,
            outcome=TraceOutcome.READ,
            last_read='{"status":"shipped"}',
        )
        third = ratchet_agent.next_step(read)
    assert third is not None and third.action["kind"] == "finish"
    assert third.action["args"] == {"summary": "All done."}
    state = PydanticAIState.load(third.agent_state)
    assert state.model_requests == 2 and len(model.offered) == 2
    returns = {
        p.tool_call_id: (p.outcome, p.content)
        for m in state.messages()
        for p in getattr(m, "parts", [])
        if p.part_kind == "tool-return"
    }
    assert returns["c2"] == ("success", '{"status":"shipped"}')
    assert returns["c1"][0] == "success" and json.loads(returns["c1"][1])["status"] == "done"


def test_a_call_that_did_not_go_through_fails_and_the_rest_of_the_response_is_not_run() -> None:
    model = Recorded(two_calls(), ModelResponse(parts=[TextPart("It failed.")]))
    with shop.refund_agent.override(model=FunctionModel(model)):
        ratchet_agent = shop.refunds({})
        first = ratchet_agent.next_step(view(ALL))
        assert first is not None
        refused = view(
            ALL, first.agent_state, proposals=1, outcome=TraceOutcome.REJECTED_PERMISSION
        )
        second = ratchet_agent.next_step(refused)
    assert second is not None and second.action["kind"] == "finish"
    returns = {
        p.tool_call_id: p.outcome
        for m in PydanticAIState.load(second.agent_state).messages()
        for p in getattr(m, "parts", [])
        if p.part_kind == "tool-return"
    }
    assert returns == {"c1": "failed", "c2": "failed"}


@pytest.mark.parametrize(("status", "retryable"), [(429, True), (503, True), (401, False)])
def test_a_model_error_is_an_adapter_error_without_the_providers_body(
    status: int, retryable: bool
) -> None:
    def failing(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        raise ModelHTTPError(status, "m", body={"error": "key sk-secret-123 refused"})

    with (
        shop.refund_agent.override(model=FunctionModel(failing)),
        pytest.raises(AdapterError) as caught,
    ):
        shop.refunds({}).next_step(view(ALL))
    assert caught.value.retryable is retryable
    assert f"HTTP {status}" in caught.value.message and "sk-secret" not in repr(caught.value)


def test_the_journal_keeps_the_first_request_and_the_newest_exchanges_within_its_bound(
    shop_dir: Any,
) -> None:
    tools = (STATUS, BUILTIN_TOOLS["finish"])
    ratchet_agent = shop.curious({"max_history_bytes": 4096})
    state: dict[str, Any] = {}
    for n in range(12):
        outcome = TraceOutcome.READ if n else TraceOutcome.STARTED
        step = ratchet_agent.next_step(
            view(tools, state, proposals=n, outcome=outcome, last_read="x" * 300)
        )
        assert step is not None and step.action["kind"] == "order_status"
        state = step.agent_state
    kept = PydanticAIState.load(state)
    assert len(kept.journal.encode()) <= 4096 and kept.dropped > 0
    messages = kept.messages()
    first = messages[0].parts[0]
    assert first.part_kind == "user-prompt" and first.content == "Where is my order?"
    assert isinstance(messages[1], ModelResponse)
    assert kept.model_requests == 12


def test_a_state_that_is_not_this_agents_is_refused() -> None:
    with pytest.raises(IntegrityError, match="not a Pydantic AI agent's state"):
        shop.refunds({}).next_step(view(ALL, {"messages": []}))


def test_an_async_tool_runs_to_completion_and_sees_its_call() -> None:
    agent: Agent[None, str] = Agent(FunctionModel(lambda m, i: ModelResponse(parts=[])))

    @agent.tool_plain
    async def send_voucher(customer: str) -> dict[str, Any]:
        call = current_call()
        return {"customer": customer, "key": call.idempotency_key if call else None}

    made = RatchetAgent(agent, prompt="p").tool("send_voucher", idempotent=True)
    call = ToolCall(run_id="run-1", tool="send_voucher", idempotency_key="k-9", fence=None)
    out = made.run(made.parse_args({"customer": "c-1"}), call)
    assert out == {"customer": "c-1", "key": "k-9"} and current_call() is None
