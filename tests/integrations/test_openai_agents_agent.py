"""The OpenAI Agents SDK integration without a fleet, against a local OpenAI-compatible
server: declarations, configuration, what the model is offered, a response's calls
proposed one per step from the journal (a new job asks nothing again), outcomes and
refusals told to the model, the output verified and finished, budgets, model errors
without the key, and the journal's bound."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip(
    "agents", reason="openai-agents is not installed (pip install -e '.[openai-agents]')"
)

from agents.agent import Agent
from agents.agent_output import AgentOutputSchema
from agents.guardrail import GuardrailFunctionOutput, InputGuardrail
from agents.items import ModelResponse
from agents.lifecycle import AgentHooks
from agents.model_settings import ModelSettings
from agents.models.interface import Model
from agents.run_context import RunContextWrapper
from agents.tool import FunctionTool, WebSearchTool, function_tool
from agents.tool_context import ToolContext
from agents.usage import Usage
from openai.types.responses import (
    ResponseOutputMessage,
    ResponseOutputRefusal,
    ResponseOutputText,
)
from pydantic import BaseModel

from ratchet.agents import step_key
from ratchet.errors import AdapterError, ConfigurationError, IntegrityError
from ratchet.integrations.openai_agents import (
    OpenAIAgentsState,
    RatchetAgent,
    current_call,
)
from ratchet.runtime import TraceOutcome
from ratchet.runtime.catalog import BUILTIN_TOOLS
from ratchet.testing.chat_stub import ChatStub
from ratchet.tools import Recovery, ToolCall
from tests.integrations import oai_shop
from tests.integrations.views import view

REFUND = oai_shop.create_refund_tool.spec
STATUS = oai_shop.order_status_tool.spec
ALL = (REFUND, STATUS, BUILTIN_TOOLS["run_verifier"], BUILTIN_TOOLS["finish"])

Play = Callable[..., ChatStub]


@pytest.fixture
def play(monkeypatch: pytest.MonkeyPatch) -> Iterator[Play]:
    """Start a local model answering with the given replies (or a function of the
    request), expecting the shop's key; each completion reports 40 + 10 tokens."""
    started: list[ChatStub] = []

    def start(*replies: Any, api_key: str = oai_shop.OAI_KEY) -> ChatStub:
        given: Any = replies[0] if len(replies) == 1 and callable(replies[0]) else replies
        stub = ChatStub(given, api_key=api_key, usage=(40, 10)).start()
        started.append(stub)
        monkeypatch.setenv(oai_shop.STUB_URL_ENV, stub.base_url)
        monkeypatch.setenv(oai_shop.STUB_KEY_ENV, oai_shop.OAI_KEY)
        return stub

    yield start
    for stub in started:
        stub.close()


def call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": call_id, "name": name, "arguments": text}


def two_calls() -> dict[str, Any]:
    return {
        "tool_calls": [
            call("c1", "create_refund", {"order_id": "A-1", "amount_cents": 5}),
            call("c2", "order_status", {"order_id": "A-1"}),
        ]
    }


def offered(body: dict[str, Any] | None) -> list[str]:
    assert body is not None
    return sorted(t["function"]["name"] for t in body.get("tools", []))


def returned(body: dict[str, Any] | None) -> dict[str, str]:
    """The tool messages a request carried: call id -> content."""
    assert body is not None
    return {m["tool_call_id"]: m["content"] for m in body["messages"] if m["role"] == "tool"}


# -- declarations -----------------------------------------------------------------------------


def test_a_function_tool_is_declared_with_its_description_schema_and_approval() -> None:
    assert REFUND.risk.value == "irreversible_external_write"
    assert REFUND.recovery is Recovery.IDEMPOTENT and not REFUND.requires_approval
    assert REFUND.description.startswith("Refund part of an order.")
    assert set(REFUND.json_schema["properties"]) == {"order_id", "amount_cents"}
    assert STATUS.risk.value == "read_only"
    closing = oai_shop.close_account_tool.spec  # the SDK tool has needs_approval=True
    assert closing.requires_approval and closing.recovery is Recovery.REVIEW


def test_the_tool_runs_the_wrapped_function_and_it_sees_the_call(shop_dir: Any) -> None:
    assert current_call() is None
    tool = oai_shop.create_refund_tool
    ratchet_call = ToolCall(run_id="run-1", tool="create_refund", idempotency_key="k-1", fence=None)
    out = tool.run(tool.parse_args({"order_id": "A-1", "amount_cents": 5}), ratchet_call)
    assert out == {"order_id": "A-1", "amount_cents": 5}
    assert (shop_dir / "create_refund" / "k-1").exists() and current_call() is None


def test_an_async_tool_runs_to_completion_and_sees_its_call() -> None:
    @function_tool
    async def send_voucher(customer: str) -> dict[str, Any]:
        """Send a voucher."""
        seen = current_call()
        return {"customer": customer, "key": seen.idempotency_key if seen else None}

    made = RatchetAgent(Agent(name="v", tools=[send_voucher])).tool("send_voucher", idempotent=True)
    ratchet_call = ToolCall(run_id="run-1", tool="send_voucher", idempotency_key="k-9", fence=None)
    out = made.run(made.parse_args({"customer": "c-1"}), ratchet_call)
    assert out == {"customer": "c-1", "key": "k-9"} and current_call() is None


def test_declarations_that_cannot_hold_are_refused_in_one_line() -> None:
    @function_tool
    def with_context(ctx: ToolContext[None], order_id: str) -> str:
        """Uses the context."""
        return order_id

    @function_tool
    def priced(amount: float) -> float:
        """Takes a float."""
        return amount

    async def invoke(ctx: ToolContext[Any], arguments: str) -> str:
        return arguments

    handmade = FunctionTool(
        name="handmade", description="d", params_json_schema={}, on_invoke_tool=invoke
    )
    wrapped = RatchetAgent(Agent(name="a", tools=[with_context, priced, handmade]))
    for name, message in (
        ("missing", "has no function tool 'missing'"),
        ("with_context", "takes a RunContextWrapper or ToolContext"),
        ("priced", "admit floats"),
        ("handmade", "not made by @function_tool"),
    ):
        with pytest.raises(ConfigurationError, match=message) as caught:
            wrapped.tool(name)
        assert "\n" not in str(caught.value)


def test_agents_ratchet_cannot_run_faithfully_are_refused_when_wrapped() -> None:
    def tripwire(ctx: Any, agent: Any, given: Any) -> GuardrailFunctionOutput:
        return GuardrailFunctionOutput(output_info=None, tripwire_triggered=False)

    @function_tool(name_override="read_file")
    def shadow(path: str) -> str:
        """Shadows a built-in kind."""
        return path

    def decide(ctx: Any, results: Any) -> Any:
        return None

    cases: list[tuple[Agent[Any], str]] = [
        (Agent(name="h", handoffs=[Agent(name="other")]), "handoffs"),
        (Agent(name="g", input_guardrails=[InputGuardrail(tripwire)]), "guardrails"),
        (Agent(name="k", hooks=AgentHooks()), "lifecycle hooks"),
        (Agent(name="w", tools=[WebSearchTool()]), r"not function tools \(WebSearchTool\)"),
        (Agent(name="f", tool_use_behavior=decide), "tool_use_behavior function"),
        (Agent(name="r", tools=[shadow]), "built-in kind's name"),
    ]
    for agent, message in cases:
        with pytest.raises(ConfigurationError, match=message) as caught:
            RatchetAgent(agent)
        assert "\n" not in str(caught.value)


def test_the_configuration_is_checked_strictly() -> None:
    with pytest.raises(ConfigurationError) as caught:
        oai_shop.refunds({"promt": "x"})
    assert caught.value.field == "agent_config.promt"
    with pytest.raises(ConfigurationError, match="request_timeout_s"):
        oai_shop.refunds({"request_timeout_s": 0})
    with pytest.raises(ConfigurationError, match=r"agent_config\.prompt is needed"):
        RatchetAgent(oai_shop.refund_agent)({})
    assert oai_shop.refunds({"prompt": "Refund A-2."}).config.prompt == "Refund A-2."


# -- steps ------------------------------------------------------------------------------------


def test_a_responses_calls_are_proposed_one_per_step_and_a_new_job_asks_nothing_again(
    play: Play, shop_dir: Any
) -> None:
    stub = play(two_calls(), {"content": "All done."})
    first = oai_shop.refunds({"tokens_per_cost_unit": 10}).next_step(view(ALL))
    assert first is not None
    action = first.action
    assert (action["kind"], action["args"]) == (
        "create_refund",
        {"order_id": "A-1", "amount_cents": 5},
    )
    assert action["idempotency_key"] == step_key(view(ALL), 0)
    assert action["expected_env_version"] == 3
    assert action["cost_units"] == 5  # 40 + 10 tokens, 10 a unit
    # What the runner would send: the instructions, the prompt, the permitted tools (the
    # agent's own as it defines them; run_verifier from its contract; never finish).
    body = stub.requests[0].body
    assert body is not None and body["model"] == "stub-refunds"
    assert body["messages"][:2] == [
        {"role": "system", "content": oai_shop.refund_agent.instructions},
        {"role": "user", "content": "Refund order A-1 for 500 cents."},
    ]
    assert offered(body) == ["create_refund", "order_status", "run_verifier"]
    # The refund took effect. A new job (the factory again, from the committed state):
    # the response's next call comes from the journal, the model is not asked.
    done = view(
        ALL,
        first.agent_state,
        proposals=1,
        outcome=TraceOutcome.EXECUTED,
        executed=frozenset({action["idempotency_key"]}),
    )
    second = oai_shop.refunds({"tokens_per_cost_unit": 10}).next_step(done)
    assert second is not None and second.action["kind"] == "order_status"
    assert second.action["idempotency_key"] is None and "cost_units" not in second.action
    assert len(stub.requests) == 1
    # The read returned: both outcomes go back, in order; the model answers; finish.
    read = view(
        ALL,
        second.agent_state,
        proposals=2,
        outcome=TraceOutcome.READ,
        last_read='{"status":"shipped"}',
    )
    third = oai_shop.refunds({}).next_step(read)
    assert third is not None and third.action["kind"] == "finish"
    assert third.action["args"] == {"summary": "All done."}
    told = returned(stub.requests[1].body)
    assert list(told) == ["c1", "c2"] and told["c2"] == '{"status":"shipped"}'
    assert json.loads(told["c1"])["status"] == "done"
    state = OpenAIAgentsState.load(third.agent_state)
    assert state.model_requests == 2 and state.used_tools and len(stub.requests) == 2
    assert [i.get("type", i.get("role")) for i in state.items()] == [
        "user",
        "function_call",
        "function_call",
        "function_call_output",
        "function_call_output",
        "message",
    ]


def test_a_refused_call_is_told_to_the_model_and_the_rest_of_the_response_is_not_run(
    play: Play,
) -> None:
    stub = play(two_calls(), {"content": "It failed."})
    first = oai_shop.refunds({}).next_step(view(ALL))
    assert first is not None
    refused = view(ALL, first.agent_state, proposals=1, outcome=TraceOutcome.REJECTED_PERMISSION)
    second = oai_shop.refunds({}).next_step(refused)
    assert second is not None and second.action["kind"] == "finish"
    told = returned(stub.requests[1].body)
    refusal = json.loads(told["c1"])
    assert (refusal["status"], refusal["outcome"]) == ("not done", "rejected_permission")
    assert told["c2"].startswith("not run")


def test_calls_that_do_not_fit_their_contracts_are_answered_why_and_none_runs(
    play: Play,
) -> None:
    stub = play(
        {
            "tool_calls": [
                call("b1", "create_refund", {"order_id": "A-1", "amount_cents": "lots"}),
                call("b2", "wire_money", {"to": "x"}),
                call("b3", "order_status", "{not json"),
            ]
        },
        {"content": "Sorry."},
    )
    step = oai_shop.refunds({}).next_step(view(ALL))
    assert step is not None and step.action["kind"] == "finish"  # asked again, same step
    told = returned(stub.requests[1].body)
    assert "arguments invalid at args.amount_cents" in told["b1"]
    assert told["b2"] == "there is no tool named 'wire_money'"
    assert told["b3"].startswith("the arguments are not JSON")
    assert OpenAIAgentsState.load(step.agent_state).malformed == 1


def test_the_output_is_verified_before_finish_and_a_failed_verification_is_told(
    play: Play,
) -> None:
    stub = play({"content": "Done."}, {"content": "Fixed."})
    agent = oai_shop.refunds({"verify_target": "unit"})
    first = agent.next_step(view(ALL))
    assert first is not None and first.action["kind"] == "run_verifier"
    assert first.action["args"] == {"target": "unit"}
    failed = view(ALL, first.agent_state, proposals=1, outcome=TraceOutcome.VERIFIED)
    second = agent.next_step(failed)
    assert second is not None and second.action["kind"] == "run_verifier"
    body = stub.requests[1].body
    assert body is not None and body["messages"][-1]["role"] == "user"
    assert "verification did not pass" in body["messages"][-1]["content"]
    passed = view(
        ALL, second.agent_state, proposals=2, outcome=TraceOutcome.VERIFIED, verified=True
    )
    third = agent.next_step(passed)
    assert third is not None and third.action["args"] == {"summary": "Fixed."}
    assert len(stub.requests) == 2


def test_an_agent_that_stops_at_its_tool_finishes_with_the_tools_output(play: Play) -> None:
    stub = play(oai_shop.shop_replies)
    tools = (STATUS, BUILTIN_TOOLS["finish"])
    first = oai_shop.tracker({}).next_step(view(tools))
    assert first is not None and first.action["kind"] == "order_status"
    read = view(
        tools, first.agent_state, proposals=1, outcome=TraceOutcome.READ, last_read='{"at":"x"}'
    )
    second = oai_shop.tracker({}).next_step(read)
    assert second is not None and second.action["args"] == {"summary": '{"at":"x"}'}
    assert len(stub.requests) == 1


class Refund(BaseModel):
    order_id: str
    amount_cents: int


def test_an_answer_that_does_not_fit_the_output_type_is_told_to_the_model(play: Play) -> None:
    stub = play({"content": "refunded!"}, {"content": '{"order_id":"A-1","amount_cents":500}'})
    agent = Agent(name="typed", instructions="Refund.", model="stub-typed", output_type=Refund)
    step = RatchetAgent(agent, prompt="Refund A-1.", run_config=oai_shop.RUN_CONFIG)({}).next_step(
        view(ALL)
    )
    assert step is not None and step.action["kind"] == "finish"
    assert json.loads(step.action["args"]["summary"]) == {"order_id": "A-1", "amount_cents": 500}
    first, second = (r.body for r in stub.requests)
    assert first is not None and first["response_format"]["type"] == "json_schema"
    assert (
        AgentOutputSchema(Refund).json_schema() == first["response_format"]["json_schema"]["schema"]
    )
    assert (
        second is not None and "does not fit the output type" in second["messages"][-1]["content"]
    )


def test_the_journal_keeps_the_prompt_and_the_newest_exchanges_within_its_bound(
    play: Play, shop_dir: Any
) -> None:
    play(oai_shop.shop_replies)
    tools = (STATUS, BUILTIN_TOOLS["finish"])
    state: dict[str, Any] = {}
    for n in range(12):
        outcome = TraceOutcome.READ if n else TraceOutcome.STARTED
        step = oai_shop.curious({"max_history_bytes": 4096}).next_step(
            view(tools, state, proposals=n, outcome=outcome, last_read="x" * 300)
        )
        assert step is not None and step.action["kind"] == "order_status"
        state = step.agent_state
    kept = OpenAIAgentsState.load(state)
    assert len(kept.journal.encode()) <= 4096 and kept.dropped > 0
    items = kept.items()
    assert items[0] == {"role": "user", "content": "Where is my order?"}
    assert items[1]["type"] == "function_call" and kept.model_requests == 12


def test_tool_choice_is_dropped_once_a_tool_was_used_as_the_runner_does(play: Play) -> None:
    stub = play(oai_shop.shop_replies)
    forced = oai_shop.curious_agent.clone(model_settings=ModelSettings(tool_choice="required"))
    wrapped = RatchetAgent(forced, prompt="Where?", run_config=oai_shop.RUN_CONFIG)
    tools = (STATUS, BUILTIN_TOOLS["finish"])
    first = wrapped({}).next_step(view(tools))
    assert first is not None
    read = view(tools, first.agent_state, proposals=1, outcome=TraceOutcome.READ, last_read="x")
    assert wrapped({}).next_step(read) is not None
    bodies = [r.body or {} for r in stub.requests]
    assert bodies[0]["tool_choice"] == "required" and "tool_choice" not in bodies[1]


class Recording(Model):
    """A model in the process: answers from a list, records what it was given."""

    def __init__(self, *outputs: Any) -> None:
        self.outputs = list(outputs)
        self.seen: list[dict[str, Any]] = []

    async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
        instructions, _input, _settings, tools = args[:4]
        self.seen.append({"instructions": instructions, "tools": [t.name for t in tools]})
        return ModelResponse(output=[self.outputs.pop(0)], usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


def said(text: str) -> ResponseOutputMessage:
    content = ResponseOutputText(type="output_text", text=text, annotations=[])
    return ResponseOutputMessage(
        id="m", type="message", role="assistant", status="completed", content=[content]
    )


def test_the_context_reaches_dynamic_instructions_and_is_enabled() -> None:
    def instructions(ctx: RunContextWrapper[dict[str, str]], agent: Agent[Any]) -> str:
        return f"Serve {ctx.context['shop']}."

    def enabled(ctx: RunContextWrapper[dict[str, str]], agent: Any) -> bool:
        return ctx.context["shop"] == "north"

    status = oai_shop.order_status.__wrapped__
    hidden = function_tool(status, name_override="order_status", is_enabled=enabled)
    model = Recording(said("Done."))
    agent: Agent[Any] = Agent(name="ctx", instructions=instructions, model=model, tools=[hidden])
    wrapped = RatchetAgent(agent, prompt="p", context={"shop": "south"})
    step = wrapped({}).next_step(view(ALL))
    assert step is not None and step.action["args"] == {"summary": "Done."}
    # Disabled by the context: not offered, and not replaced by its ratchet contract.
    assert model.seen == [
        {"instructions": "Serve south.", "tools": ["create_refund", "run_verifier"]}
    ]


def test_a_model_that_refuses_ends_the_step_with_an_error_that_is_not_retried() -> None:
    refusal = ResponseOutputRefusal(type="refusal", refusal="I will not refund that.")
    message = ResponseOutputMessage(
        id="m", type="message", role="assistant", status="completed", content=[refusal]
    )
    agent: Agent[Any] = Agent(name="no", model=Recording(message))
    with pytest.raises(AdapterError, match="refused the request") as caught:
        RatchetAgent(agent, prompt="p")({}).next_step(view(ALL))
    assert caught.value.retryable is False


def test_a_state_that_is_not_this_agents_is_refused() -> None:
    with pytest.raises(IntegrityError, match="not an OpenAI Agents SDK agent's state"):
        oai_shop.refunds({}).next_step(view(ALL, {"messages": []}))


# -- errors and the key -----------------------------------------------------------------------


@pytest.mark.parametrize(("status", "retryable"), [(429, True), (503, True), (400, False)])
def test_a_model_error_is_an_adapter_error_that_says_whether_to_retry(
    play: Play, status: int, retryable: bool
) -> None:
    stub = play({"content": "unused"})
    stub.fail_next(1, status=status)
    with pytest.raises(AdapterError) as caught:
        oai_shop.refunds({}).next_step(view(ALL))
    assert caught.value.retryable is retryable
    assert f"HTTP {status}" in caught.value.message
    assert "told to fail" not in str(caught.value)  # the provider's error body


def test_the_key_is_in_no_state_error_repr_or_log_line(
    play: Play, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    for name in ("openai", "httpx", "httpcore", "openai.agents"):
        caplog.set_level(logging.DEBUG, logger=name)
    play(oai_shop.shop_replies)
    agent = oai_shop.refunds({})
    step = agent.next_step(view(ALL))
    assert step is not None and step.action["kind"] == "create_refund"
    # A server that refuses the key quotes it in its error body (as OpenAI does).
    play(oai_shop.shop_replies, api_key="sk-another-key")
    with pytest.raises(AdapterError) as caught:
        oai_shop.refunds({}).next_step(view(ALL))
    error = caught.value
    assert caught.value.retryable is False and "HTTP 401" in error.message
    assert error.__context__ is None and error.__cause__ is None
    seen = [
        json.dumps(step.agent_state),
        json.dumps(step.action),
        str(error),
        repr(error),
        repr(agent),
        repr(oai_shop.refunds),
        caplog.text,
        *(str(r.args) for r in caplog.records),
    ]
    assert caplog.records  # the clients did log, at DEBUG
    assert not [text for text in seen if oai_shop.OAI_KEY in text]


def test_a_request_past_its_timeout_is_abandoned_and_retryable(play: Play) -> None:
    release = threading.Event()

    def stalls(body: dict[str, Any]) -> dict[str, Any]:
        release.wait(30)
        return {"content": "late"}

    play(stalls)
    try:
        with pytest.raises(AdapterError, match="request_timeout_s") as caught:
            oai_shop.refunds({"request_timeout_s": 1}).next_step(view(ALL))
        assert caught.value.retryable is True
    finally:
        release.set()
