"""The OpenAI-compatible client against the local chat stub (a real HTTP server on
loopback): replies parsed, retries bounded, typed errors, and the API key nowhere but in
the Authorization header."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator

import pytest
from pydantic import SecretStr

from ratchet.agents.models import (
    ModelReply,
    ModelRequest,
    OpenAIChatModel,
    ScriptedModel,
    ToolCallRequest,
)
from ratchet.errors import AdapterError, ConfigurationError
from ratchet.testing.chat_stub import ChatStub

KEY_ENV = "CHAT_STUB_TEST_API_KEY"  # set per test (never a RATCHET_ name: settings own those)
CANARY = "sk-canary-0123456789abcdefCANARY"

READ = ToolCallRequest(id="call-1", name="read_file", arguments='{"path": "app.py"}')
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the workspace.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]


def env_key() -> SecretStr:
    """The key as a worker's credential reads it: from the environment, at each request."""
    return SecretStr(os.environ.get(KEY_ENV, ""))


REQUEST = ModelRequest(
    messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "go"}],
    tools=TOOLS,
)


class Sleeps:
    """Records the backoff the client asked for instead of waiting it out."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


@pytest.fixture
def stub() -> Iterator[ChatStub]:
    with ChatStub([ModelReply(tool_calls=[READ])], api_key=CANARY) as server:
        yield server


@pytest.fixture
def keyed(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(KEY_ENV, CANARY)
    return KEY_ENV


def client(
    stub: ChatStub,
    sleeps: Sleeps,
    *,
    max_retries: int = 3,
    backoff_s: float = 0.5,
    max_backoff_s: float = 8.0,
) -> OpenAIChatModel:
    return OpenAIChatModel(
        stub.base_url,
        "stub-model",
        api_key=env_key,
        sleep=sleeps,
        max_retries=max_retries,
        backoff_s=backoff_s,
        max_backoff_s=max_backoff_s,
    )


def test_a_reply_with_a_tool_call_is_parsed_and_the_request_carries_messages_and_tools(
    stub: ChatStub, keyed: str
) -> None:
    sleeps = Sleeps()
    reply = client(stub, sleeps)(REQUEST)
    assert reply == ModelReply(content=None, tool_calls=[READ])
    [seen] = stub.requests
    assert seen.authorized is True
    assert seen.body is not None
    assert seen.body["model"] == "stub-model"
    assert seen.body["messages"] == REQUEST.messages
    assert seen.body["tools"] == TOOLS
    assert sleeps.delays == []


def test_a_text_reply_is_parsed(keyed: str) -> None:
    with ChatStub([{"content": "all done"}], api_key=CANARY) as stub:
        assert client(stub, Sleeps())(REQUEST) == ModelReply(content="all done")


def test_a_500_is_retried_and_the_next_answer_is_used(stub: ChatStub, keyed: str) -> None:
    stub.fail_next(1, status=500)
    sleeps = Sleeps()
    reply = client(stub, sleeps)(REQUEST)
    assert reply.tool_calls == [READ]
    assert [r.status for r in stub.requests] == [500, 200]
    assert sleeps.delays == [0.5]


def test_429_backoff_follows_retry_after_but_is_capped_and_the_attempts_are_bounded(
    stub: ChatStub, keyed: str
) -> None:
    stub.fail_next(100, status=429, retry_after=30)
    sleeps = Sleeps()
    model = client(stub, sleeps, max_retries=3, max_backoff_s=2.0)
    with pytest.raises(AdapterError) as raised:
        model(REQUEST)
    assert raised.value.retryable is True
    assert raised.value.context["status"] == 429
    assert [r.status for r in stub.requests] == [429] * 4
    assert sleeps.delays == [2.0, 2.0, 2.0]


def test_without_retry_after_the_backoff_doubles_up_to_its_cap(stub: ChatStub, keyed: str) -> None:
    stub.fail_next(100, status=503)
    sleeps = Sleeps()
    model = client(stub, sleeps, max_retries=5, backoff_s=0.5, max_backoff_s=4.0)
    with pytest.raises(AdapterError):
        model(REQUEST)
    assert sleeps.delays == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert len(stub.requests) == 6


def test_a_400_is_not_retried_and_is_not_retryable(stub: ChatStub, keyed: str) -> None:
    stub.fail_next(1, status=400)
    sleeps = Sleeps()
    with pytest.raises(AdapterError) as raised:
        client(stub, sleeps)(REQUEST)
    assert raised.value.retryable is False
    assert raised.value.context["status"] == 400
    assert len(stub.requests) == 1
    assert sleeps.delays == []


def test_an_unreachable_server_is_a_retryable_adapter_error_after_bounded_retries(
    keyed: str,
) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sleeps = Sleeps()
    model = OpenAIChatModel(
        f"http://127.0.0.1:{port}/v1", "m", api_key=env_key, max_retries=2, sleep=sleeps
    )
    with pytest.raises(AdapterError) as raised:
        model(REQUEST)
    assert raised.value.retryable is True
    assert raised.value.context["status"] is None
    assert "ConnectError" in raised.value.message
    assert len(sleeps.delays) == 2


def test_a_missing_key_is_a_configuration_error_and_nothing_is_sent(
    stub: ChatStub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    model = client(stub, Sleeps())
    with pytest.raises(ConfigurationError) as raised:
        model(REQUEST)
    assert raised.value.field == "model.credential"
    assert "empty" in raised.value.message
    assert stub.requests == []


def test_the_key_is_read_when_a_request_is_made_not_when_the_model_is_built(
    stub: ChatStub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    model = client(stub, Sleeps())  # built without the key: a submit host has none
    monkeypatch.setenv(KEY_ENV, CANARY)
    assert model(REQUEST).tool_calls == [READ]
    assert stub.requests[0].authorized is True


def test_the_key_is_in_no_repr_log_line_or_error_even_when_the_server_quotes_it(
    stub: ChatStub, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)  # httpx and httpcore log requests at DEBUG
    monkeypatch.setenv(KEY_ENV, CANARY + "-wrong")  # the stub quotes a wrong key back
    sleeps = Sleeps()
    model = client(stub, sleeps)
    with pytest.raises(AdapterError) as refused:
        model(REQUEST)
    assert refused.value.context["status"] == 401
    assert "invalid_api_key" in refused.value.message
    monkeypatch.setenv(KEY_ENV, CANARY)
    stub.fail_next(5, status=500)
    with pytest.raises(AdapterError) as failed:
        client(stub, sleeps, max_retries=1)(REQUEST)
    assert model(REQUEST).tool_calls == [READ]
    assert caplog.records, "the client and httpx logged nothing to check"
    for text in (
        repr(model),
        str(model.__dict__),
        str(refused.value),
        repr(refused.value),
        str(failed.value),
        repr(failed.value),
        caplog.text,
        *(str(r.__dict__) for r in caplog.records),
    ):
        assert CANARY not in text


def test_a_scripted_model_serves_its_replies_in_order_and_records_each_request() -> None:
    model = ScriptedModel([{"tool_calls": [READ.model_dump()]}, {"content": "done"}])
    assert model(REQUEST).tool_calls == [READ]
    assert model(REQUEST).content == "done"
    with pytest.raises(AdapterError):
        model(REQUEST)
    assert model.requests == [REQUEST] * 3


def test_a_scripted_model_may_be_a_function_of_the_request() -> None:
    model = ScriptedModel(lambda request: {"content": f"{len(request.messages)} messages"})
    assert model(REQUEST).content == "2 messages"


def test_a_scripted_reply_that_is_not_a_reply_is_refused_naming_it() -> None:
    with pytest.raises(ConfigurationError) as raised:
        ScriptedModel([{"content": "ok"}, {"tool_calls": [{"id": "x"}]}])
    assert raised.value.field == "replies[1]"


@pytest.mark.parametrize(
    ("base_url", "options", "field"),
    [
        ("ftp://example.invalid/v1", {}, "model.base_url"),
        ("https://user:pw@example.invalid/v1", {}, "model.base_url"),
        ("http://127.0.0.1:1/v1", {"max_retries": 11}, "model.max_retries"),
        ("http://127.0.0.1:1/v1", {"timeout": 0}, "model.timeout"),
    ],
)
def test_a_bad_client_setting_is_a_configuration_error_naming_it(
    base_url: str, options: dict[str, object], field: str
) -> None:
    with pytest.raises(ConfigurationError) as raised:
        OpenAIChatModel(base_url, "m", **options)  # type: ignore[arg-type]
    assert raised.value.field == field
    assert "sk-not-a-name" not in raised.value.message
