"""The tool-calling agent driving a RunEngine on the in-memory ports: read, write, verify,
finish; crashes in every write window with a model that repeats itself (one effect, the
same key); the conversation kept in the signed agent state; the tools offered; malformed
calls answered, not raised; the state bounded."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from ratchet.agents import AgentPolicy, ToolCallingAgent, load_agent, step_key
from ratchet.agents.conversation import ConversationState
from ratchet.agents.models import ModelReply, ModelRequest, ScriptedModel
from ratchet.errors import ConfigurationError, IntegrityError
from ratchet.fleet.credentials import CredentialMap, CredentialSpec
from ratchet.runtime import CrashWindow, Phase, RunEngine, Scenario, TraceOutcome
from ratchet.runtime.canonical import canonical_json
from ratchet.runtime.catalog import BUILTIN_TOOLS
from ratchet.testing.memory import ObserveFailsAfterWrite
from ratchet.tools import FunctionTool, Toolbox, tool
from tests.agents.helpers import (
    SYSTEM_PROMPT,
    answer,
    call,
    calls,
    drive,
    offered,
    view_of,
)
from tests.runtime.world import (
    RIGHT_GREETING,
    SimulatedCrash,
    World,
    crash_at,
    scenario_data,
)

READ = call("read_file", {"path": "app.py"}, "call-read")
WRITE = call("write_file", {"path": "app.py", "content": RIGHT_GREETING}, "call-write")
VERIFY = call("run_verifier", {"target": "unit"}, "call-verify")

SCRIPT = [calls(READ), calls(WRITE), calls(VERIFY), answer("The greeting is fixed.")]

WRITE_WINDOWS = [
    CrashWindow.AFTER_PENDING_BEFORE_ADAPTER,
    CrashWindow.AFTER_ADAPTER_BEFORE_RECEIPT,
    CrashWindow.AFTER_RECEIPT_BEFORE_STATE,
]


def agent_for(replies: Any, **options: Any) -> tuple[ToolCallingAgent, ScriptedModel]:
    model = ScriptedModel(replies)
    return ToolCallingAgent(model, system_prompt=SYSTEM_PROMPT, **options), model


def world_with(**overrides: Any) -> World:
    return World(scenario=Scenario.model_validate(scenario_data(**overrides)))


def outcomes(engine: RunEngine) -> list[TraceOutcome]:
    return [e.outcome for e in engine.state.trace]


def tool_messages(request: ModelRequest) -> list[dict[str, Any]]:
    return [m for m in request.messages if m["role"] == "tool"]


# -- the happy path -----------------------------------------------------------------------------


def test_the_agent_reads_writes_verifies_and_finishes_with_one_write() -> None:
    world = World()
    agent, model = agent_for(SCRIPT)
    engine = world.start()
    drive(engine, agent)
    assert engine.state.phase is Phase.COMPLETED
    assert world.adapter.files["app.py"] == RIGHT_GREETING
    assert world.adapter.write_count == 1
    assert outcomes(engine)[1:] == [
        TraceOutcome.READ,
        TraceOutcome.ACCEPTED_PENDING,
        TraceOutcome.EXECUTED,
        TraceOutcome.VERIFIED,
        TraceOutcome.COMPLETED,
    ]
    # The model saw each outcome before deciding again: the read's content, the write
    # done, the verification passed.
    assert [m["tool_call_id"] for m in tool_messages(model.requests[-1])] == [
        "call-read",
        "call-write",
        "call-verify",
    ]
    read, write, verify = (m["content"] for m in tool_messages(model.requests[-1]))
    assert read == world.scenario.initial_files["app.py"]
    assert json.loads(write)["status"] == "done"
    assert json.loads(verify) == {
        "status": "done",
        "passed": True,
        "outcome": "verified",
        "environment_version": engine.state.environment.version,
    }
    # Every request starts with the system prompt and the task.
    for request in model.requests:
        assert request.messages[0] == {"role": "system", "content": SYSTEM_PROMPT}
        assert request.messages[1]["role"] == "user"


def test_the_write_carries_the_key_of_its_position_in_the_run_never_one_from_the_model() -> None:
    world = World()
    agent, _ = agent_for(SCRIPT)
    engine = world.start()
    drive(engine, agent)
    [write] = [e for e in engine.state.trace if e.outcome is TraceOutcome.EXECUTED]
    # The write was the run's second proposal (position 1): its key is step_key(view, 1).
    view = view_of(engine)
    assert write.idempotency_key == step_key(view, 1)
    assert "call-write" not in (write.idempotency_key or "")


# -- crashes ------------------------------------------------------------------------------------


def start_and_crash(world: World, window: CrashWindow, agent: ToolCallingAgent) -> RunEngine:
    """Run until the write, dying in ``window``; the engine as the dead worker left it."""
    hooks = ObserveFailsAfterWrite() if window is CrashWindow.AFTER_RECEIPT_BEFORE_STATE else None
    engine = RunEngine.start(
        world.run_id,
        **world.ports(probe=crash_at(window), hooks=hooks, store=world.store.leased(1)),
    )
    with pytest.raises(SimulatedCrash):
        drive(engine, agent)
    return engine


@pytest.mark.parametrize("window", WRITE_WINDOWS)
def test_a_crash_in_each_write_window_with_a_model_that_repeats_itself_writes_once(
    window: CrashWindow,
) -> None:
    world = World()
    first, _ = agent_for(SCRIPT)
    start_and_crash(world, window, first)
    # A new owner restores the signed state: the write is what the agent awaits.
    engine = world.resume()
    committed = ConversationState.load(engine.state.agent_state)
    assert committed.awaiting is not None and committed.awaiting.name == "write_file"
    key = committed.awaiting.key
    engine.reconcile()
    # A new process builds the agent again, and its model plays the whole script from
    # the start: it repeats the read and the write it already asked for.
    second, model = agent_for(SCRIPT)
    drive(engine, second)

    assert engine.state.phase is Phase.COMPLETED
    assert world.adapter.write_count == 1
    writes = [e for e in engine.state.trace if e.idempotency_key is not None]
    assert {e.idempotency_key for e in writes} == {key}
    assert TraceOutcome.REPLAYED in outcomes(engine)  # the repeat, answered from the receipt
    # The resumed model was shown the conversation from before the crash.
    first_request = model.requests[0].messages
    assert any(
        m.get("tool_calls", [{}])[0].get("id") == "call-write"
        for m in first_request
        if m["role"] == "assistant"
    )
    assert first_request[-1]["tool_call_id"] == "call-write"
    assert json.loads(first_request[-1]["content"])["status"] == "done"


def test_after_a_crash_the_same_agent_continues_its_conversation_without_a_second_write() -> None:
    world = World()
    agent, model = agent_for(SCRIPT)
    start_and_crash(world, CrashWindow.AFTER_PENDING_BEFORE_ADAPTER, agent)
    before = model.requests[-1].messages
    engine = world.resume()
    assert (
        ConversationState.load(engine.state.agent_state).messages[: len(before) - 2] == (before[2:])
    )
    engine.reconcile()
    drive(engine, agent)
    assert engine.state.phase is Phase.COMPLETED
    assert world.adapter.write_count == 1
    assert TraceOutcome.REPLAYED not in outcomes(engine)  # nothing was repeated


def test_a_crash_before_the_proposal_was_committed_asks_again_and_keeps_the_key() -> None:
    world = World()
    agent, _ = agent_for(SCRIPT)
    engine = world.start()
    drive(engine, agent, max_steps=1)  # the read
    view = view_of(engine)
    step = agent.next_step(view)  # the write is planned, then the worker dies
    assert step is not None
    planned_key = step.action["idempotency_key"]
    engine = world.resume()
    engine.reconcile()
    again, _ = agent_for([calls(WRITE), calls(VERIFY), answer("done")])
    drive(engine, again)
    assert engine.state.phase is Phase.COMPLETED
    assert world.adapter.write_count == 1
    assert [e.idempotency_key for e in engine.state.executed] == [planned_key]


# -- what the model is shown ------------------------------------------------------------------


def file_ticket(title: str, priority: int = 3) -> dict[str, str]:
    """File a ticket in the tracker."""
    return {"ticket": title}


TICKETS: FunctionTool = tool(risk="irreversible_external_write", idempotent=True)(file_ticket)


def test_the_tools_offered_are_exactly_the_permitted_ones_with_their_schemas() -> None:
    catalog = Toolbox([TICKETS]).catalog
    world = world_with(
        permissions=["read_file", "write_file", "finish", "file_ticket"], approval_required=[]
    )
    engine = world.start()
    agent, model = agent_for([calls(READ)])
    assert agent.next_step(view_of(engine, catalog=catalog)) is not None
    [request] = model.requests
    expected = [catalog[n] for n in ("read_file", "write_file", "finish", "file_ticket")]
    assert request.tools == offered(expected)
    ticket = request.tools[-1]["function"]
    assert ticket["parameters"]["properties"]["priority"]["type"] == "integer"
    assert ticket["parameters"]["required"] == ["title"]
    assert {t["function"]["name"] for t in request.tools}.isdisjoint(
        {"delete_file", "external_call", "run_verifier"}
    )
    assert request.tools[0]["function"]["parameters"] == BUILTIN_TOOLS["read_file"].json_schema


def test_a_declared_tool_call_is_proposed_with_its_risk_and_a_key_and_runs_once(
    tmp_path: Any,
) -> None:
    toolbox = Toolbox([TICKETS])
    world = world_with(
        permissions=["read_file", "run_verifier", "finish", "file_ticket"], approval_required=[]
    )
    adapter = toolbox.environment(
        world.scenario, ledger=tmp_path / "ledger.sqlite", files=world.adapter, clock=world.clock
    )
    engine = RunEngine.start(
        world.run_id,
        **world.ports(adapter=adapter, store=world.store.leased(1), tools=toolbox.catalog),
    )
    ticket = call("file_ticket", {"title": "greeting typo"}, "call-ticket")
    agent, model = agent_for([calls(ticket), calls(ticket), answer("filed")])
    drive(engine, agent, catalog=toolbox.catalog, max_steps=3)
    executed = [e for e in engine.state.trace if e.outcome is TraceOutcome.EXECUTED]
    assert len(executed) == 1
    assert executed[0].idempotency_key == step_key(view_of(engine), 0)
    # The model repeated the call: the same key, answered from the receipt.
    assert TraceOutcome.REPLAYED in outcomes(engine)
    assert adapter.tools.effects == 1  # type: ignore[attr-defined]
    assert json.loads(tool_messages(model.requests[-1])[0]["content"])["status"] == "done"


def lookup_ticket(title: str) -> dict[str, str]:
    """Look a ticket up by its title."""
    return {"ticket": title, "state": "open"}


LOOKUP: FunctionTool = tool(risk="read_only")(lookup_ticket)


def test_a_declared_read_only_tool_is_proposed_without_a_key_and_its_output_is_shown(
    tmp_path: Any,
) -> None:
    toolbox = Toolbox([LOOKUP])
    world = world_with(permissions=["read_file", "finish", "lookup_ticket"], approval_required=[])
    adapter = toolbox.environment(
        world.scenario, ledger=tmp_path / "ledger.sqlite", files=world.adapter, clock=world.clock
    )
    engine = RunEngine.start(
        world.run_id,
        **world.ports(adapter=adapter, store=world.store.leased(1), tools=toolbox.catalog),
    )
    lookup = call("lookup_ticket", {"title": "greeting typo"}, "call-lookup")
    agent, model = agent_for([calls(lookup), calls(READ)])
    drive(engine, agent, catalog=toolbox.catalog, max_steps=2)
    read = [e for e in engine.state.trace if e.outcome is TraceOutcome.READ]
    assert len(read) == 2 and read[0].idempotency_key is None
    [shown] = tool_messages(model.requests[1])
    assert json.loads(shown["content"]) == {"state": "open", "ticket": "greeting typo"}


# -- several calls in one reply, refusals, final answers ----------------------------------------


def test_further_calls_of_one_reply_are_queued_and_proposed_without_asking_again() -> None:
    world = World()
    agent, model = agent_for([calls(READ, WRITE, VERIFY), answer("fixed")])
    engine = world.start()
    drive(engine, agent)
    assert engine.state.phase is Phase.COMPLETED
    assert len(model.requests) == 2
    assert [m["tool_call_id"] for m in tool_messages(model.requests[1])] == [
        "call-read",
        "call-write",
        "call-verify",
    ]


def test_a_refused_call_answers_the_rest_of_its_reply_not_run_and_asks_again() -> None:
    world = World()
    outside = call("write_file", {"path": "secret.txt", "content": "x"}, "call-outside")
    agent, model = agent_for([calls(outside, VERIFY), calls(READ)])
    engine = world.start()
    drive(engine, agent, max_steps=2)
    assert outcomes(engine)[1:] == [TraceOutcome.REJECTED_SCOPE, TraceOutcome.READ]
    refused, skipped = tool_messages(model.requests[1])
    assert refused["tool_call_id"] == "call-outside"
    assert json.loads(refused["content"])["status"] == "not done"
    assert json.loads(refused["content"])["outcome"] == "rejected_scope"
    assert skipped["tool_call_id"] == "call-verify"
    assert json.loads(skipped["content"])["status"] == "not run"


def test_a_final_answer_is_proposed_as_finish_and_a_refusal_is_told_to_the_model() -> None:
    world = World()
    agent, model = agent_for([answer("nothing to do"), calls(READ)])
    engine = world.start()
    drive(engine, agent, max_steps=2)
    assert outcomes(engine)[1:] == [TraceOutcome.REJECTED_UNVERIFIED, TraceOutcome.READ]
    told = model.requests[1].messages[-1]
    assert told["role"] == "user"
    assert json.loads(told["content"])["outcome"] == "rejected_unverified"


def test_a_final_answer_when_finish_is_not_permitted_is_no_proposal() -> None:
    world = world_with(permissions=["read_file", "write_file"], approval_required=[])
    agent, _ = agent_for([answer("done")])
    engine = world.start()
    assert agent.next_step(view_of(engine)) is None


# -- malformed calls ---------------------------------------------------------------------------


def test_malformed_calls_are_answered_with_errors_and_count_against_the_budget() -> None:
    world = World()
    bad = [
        calls(call("write_file", "not json", "c-text")),
        calls(call("write_file", "[1, 2]", "c-list")),
        calls(call("read_file", {"path": 5}, "c-schema")),
        calls(call("rm_rf", {}, "c-unknown")),
        ModelReply(),  # neither text nor a call
    ]
    agent, model = agent_for([*bad, calls(READ), calls(VERIFY)])
    engine = world.start()
    step = agent.next_step(view_of(engine))
    assert step is not None and step.action["kind"] == "read_file"
    assert len(model.requests) == 6
    errors = {
        m["tool_call_id"]: json.loads(m["content"])["error"]
        for m in tool_messages(model.requests[-1])
    }
    assert "not JSON" in errors["c-text"]
    assert "JSON object" in errors["c-list"]
    assert "args.path" in errors["c-schema"]
    assert "no tool named 'rm_rf'" in errors["c-unknown"]
    assert model.requests[-1].messages[-1]["role"] == "user"  # the empty reply's nudge
    assert ConversationState.load(step.agent_state).malformed == 5
    # Carried out: the count starts again.
    engine.propose(step.action, agent_state=step.agent_state)
    again = agent.next_step(view_of(engine))
    assert again is not None
    assert ConversationState.load(again.agent_state).malformed == 0


def test_one_malformed_call_in_a_reply_runs_none_of_its_calls_and_keeps_nothing_large() -> None:
    world = World()
    huge = call("write_file", {"path": "app.py", "content": "y" * 200_000}, "c-huge")
    agent, model = agent_for([calls(READ, huge, VERIFY), calls(READ)])
    engine = world.start()
    step = agent.next_step(view_of(engine))
    assert step is not None and step.action["kind"] == "read_file"
    answered = {
        m["tool_call_id"]: json.loads(m["content"]) for m in tool_messages(model.requests[1])
    }
    assert answered["call-read"]["status"] == "not run"
    assert "bytes" in answered["c-huge"]["error"]
    assert answered["call-verify"]["status"] == "not run"
    state = ConversationState.load(step.agent_state)
    assert state.queue == []
    assert len(canonical_json(step.agent_state)) < 40_000  # the huge arguments were cut


def test_calls_beyond_the_per_reply_limit_are_answered_not_run() -> None:
    world = World()
    agent, model = agent_for(
        [calls(READ, VERIFY, WRITE), answer("done")], max_tool_calls_per_turn=2
    )
    engine = world.start()
    drive(engine, agent, max_steps=3)
    assert outcomes(engine)[1:3] == [TraceOutcome.READ, TraceOutcome.VERIFIED]
    [write] = [m for m in tool_messages(model.requests[1]) if m["tool_call_id"] == "call-write"]
    assert json.loads(write["content"])["status"] == "not run"
    assert world.adapter.write_count == 0


def test_past_the_malformed_budget_the_agent_gives_up() -> None:
    world = World()
    agent, model = agent_for(lambda request: calls(call("read_file", "{", "c")), max_malformed=2)
    engine = world.start()
    assert agent.next_step(view_of(engine)) is None
    assert len(model.requests) == 3


def test_a_state_that_is_not_this_agents_is_refused() -> None:
    world = World()
    agent, _ = agent_for(SCRIPT)
    engine = world.start()
    view = view_of(engine)
    with pytest.raises(IntegrityError) as raised:
        agent.next_step(replace(view, agent_state={"cursor": 1}))
    assert raised.value.field == "agent_state"


# -- bounds ------------------------------------------------------------------------------------


def test_the_state_stays_bounded_however_long_the_run() -> None:
    big = "x = 1\n" * 4000  # 24 KB a read: more than a message keeps
    world = world_with(
        initial_files={"app.py": big},
        budgets={"proposals": 200, "steps": 200, "wall_clock_seconds": 3600, "cost_units": 10},
    )
    counter = iter(range(10_000))
    agent, model = agent_for(
        lambda request: calls(call("read_file", {"path": "app.py"}, f"c{next(counter)}")),
        max_messages=12,
        max_message_bytes=4096,
        max_history_bytes=32 * 1024,
    )
    engine = world.start()
    sizes = []
    for _ in range(60):
        drive(engine, agent, max_steps=1)
        state = ConversationState.load(engine.state.agent_state)
        sizes.append(len(canonical_json(engine.state.agent_state)))
        assert len(state.messages) <= 12
        assert state.messages[0]["role"] != "tool"
    assert engine.state.usage.proposals == 60
    assert max(sizes) < 40 * 1024
    assert ConversationState.load(engine.state.agent_state).dropped > 0
    last = model.requests[-1].messages
    assert last[0]["content"] == SYSTEM_PROMPT  # the system prompt is never dropped
    assert all(len(m["content"].encode()) < 4200 for m in last if m["role"] == "tool")


# -- configuration ------------------------------------------------------------------------------


def scripted_config(**extra: Any) -> dict[str, Any]:
    return {
        "model": {"kind": "scripted", "replies": [{"content": "done"}]},
        "system_prompt": SYSTEM_PROMPT,
        **extra,
    }


def test_the_built_in_tool_calling_agent_is_built_from_its_configuration() -> None:
    agent = load_agent("tool_calling", scripted_config(max_messages=10))
    assert isinstance(agent, ToolCallingAgent)
    assert agent.max_messages == 10
    openai = load_agent(
        "tool_calling",
        {
            "model": {
                "kind": "openai",
                "base_url": "http://127.0.0.1:9/v1",
                "model": "gpt-test",
                "credential": "local",
            },
            "system_prompt": SYSTEM_PROMPT,
        },
        policy=AgentPolicy(
            credentials=CredentialMap(
                {"local": CredentialSpec(env="SOME_KEY_VAR", destinations=("http://127.0.0.1:9",))}
            )
        ),
    )
    assert "127.0.0.1:9" in repr(openai) and "api_key=set" in repr(openai)


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (scripted_config(extra=1), "agent_config.extra"),
        ({"model": {"kind": "scripted", "replies": []}}, "agent_config.model.replies"),
        (scripted_config(model={"kind": "magic"}), "agent_config.model"),
        (
            scripted_config(
                model={
                    "kind": "openai",
                    "base_url": "http://127.0.0.1:9/v1",
                    "model": "m",
                    "api_key_env": "sk-live-secret",
                }
            ),
            "agent_config.model.api_key_env",
        ),
        (scripted_config(max_tool_calls_per_turn=0), "agent_config.max_tool_calls_per_turn"),
        (
            {"model": {"kind": "scripted", "replies": [{"content": "x"}]}},
            "agent_config.system_prompt",
        ),
    ],
)
def test_a_bad_configuration_is_one_line_naming_the_field(
    config: dict[str, Any], field: str
) -> None:
    with pytest.raises(ConfigurationError) as raised:
        load_agent("tool_calling", config)
    assert raised.value.field == field
    assert "\n" not in raised.value.message
    assert "sk-live-secret" not in raised.value.message
