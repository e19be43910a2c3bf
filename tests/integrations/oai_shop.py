"""OpenAI Agents SDK agents of the same small shop, as a project would write them, made
runnable by ratchet: a refund agent, an agent that closes an account (its tool asks for
approval), an agent that keeps asking for an order's status (for budgets), and one that
stops at its tool's output.

The model is the SDK's ``OpenAIChatCompletionsModel`` with an ``AsyncOpenAI`` client,
talking to a local OpenAI-compatible stub (:class:`ratchet.testing.chat_stub.ChatStub`)
that the test starts and names in ``OAI_STUB_URL`` (the key in ``OAI_STUB_KEY``): the
project's own model provider resolves the agents' model names to it when a request is
made, in whichever process makes it. The stub decides each reply from the request
(:func:`shop_replies`), so every process sees the same model, and the test counts the
requests at the stub. The payments service is :mod:`tests.integrations.payments`.
"""

from __future__ import annotations

import json
import os
from typing import Any

from agents.agent import Agent, StopAtTools
from agents.models.interface import Model, ModelProvider
from agents.models.openai_chatcompletions import OpenAIChatCompletionsModel
from agents.run_config import RunConfig
from agents.tool import function_tool
from openai import AsyncOpenAI

from ratchet.integrations.openai_agents import RatchetAgent, current_call
from tests.integrations.payments import effect, log

STUB_URL_ENV = "OAI_STUB_URL"
STUB_KEY_ENV = "OAI_STUB_KEY"
#: The key the shop's client sends, and the tests' stub expects.
OAI_KEY = "sk-oai-shop-0123456789-secret"

_CLIENTS: dict[tuple[str, str], AsyncOpenAI] = {}


class StubProvider(ModelProvider):
    """Every model name on the chat-completions endpoint ``OAI_STUB_URL`` names, one
    client per endpoint and key for the process (as a service keeps one), no retries."""

    def get_model(self, model_name: str | None) -> Model:
        where = (os.environ[STUB_URL_ENV], os.environ[STUB_KEY_ENV])
        client = _CLIENTS.get(where)
        if client is None:
            client = AsyncOpenAI(base_url=where[0], api_key=where[1], max_retries=0)
            _CLIENTS[where] = client
        return OpenAIChatCompletionsModel(model=model_name or "stub", openai_client=client)


RUN_CONFIG = RunConfig(model_provider=StubProvider())


# -- the tools, as plain Agents SDK function tools ------------------------------------------


@function_tool
def create_refund(order_id: str, amount_cents: int) -> dict[str, Any]:
    """Refund part of an order.

    Args:
        order_id: the order's reference.
        amount_cents: how much to refund, in cents.
    """
    return effect(
        "create_refund", {"order_id": order_id, "amount_cents": amount_cents}, current_call()
    )


@function_tool
def order_status(order_id: str) -> dict[str, Any]:
    """Where an order is."""
    log("calls.log", {"tool": "order_status", "key": None})
    return {"order_id": order_id, "status": "shipped"}


@function_tool(needs_approval=True)
def close_account(customer: str) -> dict[str, Any]:
    """Close a customer's account for good."""
    return effect("close_account", {"customer": customer}, current_call())


# -- the model, as the stub plays it --------------------------------------------------------


def _call(call_id: str, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"tool_calls": [{"id": call_id, "name": name, "arguments": json.dumps(args)}]}


def shop_replies(body: dict[str, Any]) -> dict[str, Any]:
    """The shop's model: the agent is read from the system prompt, the turn from the
    conversation (OpenAI chat messages) the request carries."""
    messages = body["messages"]
    system = next((m["content"] for m in messages if m["role"] == "system"), "")
    returned = [m for m in messages if m["role"] == "tool"]
    if system.startswith("Refund"):
        if not returned:
            return _call("r1", "create_refund", {"order_id": "A-1", "amount_cents": 500})
        done = json.loads(returned[-1]["content"]).get("status") == "done"
        return {"content": "Refunded 500 cents on order A-1." if done else "No refund made."}
    if system.startswith("Close"):
        if not returned:
            return _call("a1", "close_account", {"customer": "c-7"})
        return {"content": "Closed the account of c-7."}
    # The curious agent and the tracker: order_status, again and again.
    n = len(returned)
    return _call(f"s{n}", "order_status", {"order_id": f"A-{n}"})


# -- the agents, and what makes them runnable by ratchet ------------------------------------

refund_agent: Agent[None] = Agent(
    name="oai-refunds",
    instructions="Refund the order the user names, then say what you did.",
    model="stub-refunds",
    tools=[create_refund, order_status],
)
account_agent: Agent[None] = Agent(
    name="oai-accounts",
    instructions="Close the account the user names.",
    model="stub-accounts",
    tools=[close_account],
)
curious_agent: Agent[None] = Agent(
    name="oai-curious",
    instructions="Find out where the order is.",
    model="stub-curious",
    tools=[order_status],
)
tracker_agent: Agent[None] = Agent(
    name="oai-tracker",
    instructions="Track the order.",
    model="stub-tracker",
    tools=[order_status],
    tool_use_behavior=StopAtTools(stop_at_tool_names=["order_status"]),
)

refunds = RatchetAgent(
    refund_agent, prompt="Refund order A-1 for 500 cents.", run_config=RUN_CONFIG
)
accounts = RatchetAgent(account_agent, prompt="Close the account of c-7.", run_config=RUN_CONFIG)
curious = RatchetAgent(curious_agent, prompt="Where is my order?", run_config=RUN_CONFIG)
tracker = RatchetAgent(tracker_agent, prompt="Where is order A-0?", run_config=RUN_CONFIG)

# Installed under the ratchet.tools entry-point group (the tests' dist-info).
create_refund_tool = refunds.tool("create_refund", idempotent=True)
order_status_tool = refunds.tool("order_status", risk="read_only")
close_account_tool = accounts.tool("close_account")
