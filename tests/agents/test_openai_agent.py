"""The tool-calling agent with the OpenAI-compatible client against the local chat stub,
driving a run end to end: what the server was asked, and the API key in no checkpoint,
no agent state and no trace."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from pydantic import SecretStr

from ratchet.agents import AgentPolicy, ToolCallingAgent, load_agent
from ratchet.agents.models import OpenAIChatModel
from ratchet.fleet.credentials import CredentialMap, CredentialSpec
from ratchet.runtime import Phase, TraceOutcome
from ratchet.runtime.canonical import canonical_json
from ratchet.testing.chat_stub import ChatStub
from tests.agents.helpers import SYSTEM_PROMPT, answer, call, calls, drive, offered, permitted_tools
from tests.runtime.world import RIGHT_GREETING, World

KEY_ENV = "CHAT_STUB_TEST_API_KEY"
CANARY = "sk-canary-agent-0123456789abcdefCANARY"

SCRIPT = [
    calls(call("read_file", {"path": "app.py"}, "call-read")),
    calls(call("write_file", {"path": "app.py", "content": RIGHT_GREETING}, "call-write")),
    calls(call("run_verifier", {"target": "unit"}, "call-verify")),
    answer("Fixed the greeting; the unit check passes."),
]


@pytest.fixture
def stub(monkeypatch: pytest.MonkeyPatch) -> Iterator[ChatStub]:
    monkeypatch.setenv(KEY_ENV, CANARY)
    with ChatStub(SCRIPT, api_key=CANARY) as server:
        yield server


def agent_on(stub: ChatStub) -> ToolCallingAgent:
    agent = load_agent(
        "tool_calling",
        {
            "model": {
                "kind": "openai",
                "base_url": stub.base_url,
                "model": "stub-model",
                "credential": "stub",
                "max_retries": 2,
            },
            "system_prompt": SYSTEM_PROMPT,
        },
        # The worker's map: the stub's key, for the stub's URL only.
        policy=AgentPolicy(
            credentials=CredentialMap(
                {"stub": CredentialSpec(env=KEY_ENV, destinations=(stub.base_url,))}
            )
        ),
    )
    assert isinstance(agent, ToolCallingAgent)
    return agent


def test_the_agent_completes_the_task_through_a_chat_server(stub: ChatStub) -> None:
    world = World()
    engine = world.start()
    drive(engine, agent_on(stub))
    assert engine.state.phase is Phase.COMPLETED
    assert world.adapter.write_count == 1
    assert engine.state.trace[-1].outcome is TraceOutcome.COMPLETED
    requests = stub.requests
    assert len(requests) == 4
    assert all(r.authorized for r in requests)
    bodies = [r.body for r in requests]
    assert all(b is not None for b in bodies)
    first, last = bodies[0], bodies[-1]
    assert first is not None and last is not None
    assert first["tools"] == offered(permitted_tools(engine))
    assert first["messages"][0] == {"role": "system", "content": SYSTEM_PROMPT}
    tool_ids = [m["tool_call_id"] for m in last["messages"] if m["role"] == "tool"]
    assert tool_ids == ["call-read", "call-write", "call-verify"]


def test_a_failing_server_is_retried_within_the_step(stub: ChatStub) -> None:
    world = World()
    engine = world.start()
    waited: list[float] = []
    model = OpenAIChatModel(
        stub.base_url, "stub-model", api_key=SecretStr(CANARY), max_retries=2, sleep=waited.append
    )
    stub.fail_next(2, status=503)
    drive(engine, ToolCallingAgent(model, system_prompt=SYSTEM_PROMPT))
    assert engine.state.phase is Phase.COMPLETED
    assert [r.status for r in stub.requests][:3] == [503, 503, 200]
    assert waited == [0.5, 1.0]


def test_the_key_is_in_no_checkpoint_agent_state_or_trace(stub: ChatStub) -> None:
    world = World()
    engine = world.start()
    drive(engine, agent_on(stub))
    assert engine.state.phase is Phase.COMPLETED
    secret = CANARY.encode()
    for stored in world.store.checkpoints.values():
        assert secret not in stored.blob
        assert all(secret not in segment for segment in stored.archive)
    assert secret not in engine.checkpoint
    assert secret not in canonical_json(engine.state.agent_state)
    assert CANARY not in json.dumps([e.model_dump(mode="json") for e in engine.state.trace])
