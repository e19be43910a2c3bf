"""Pydantic AI agents of a small shop, as a project would write them, made runnable by
ratchet: a refund agent, an agent that closes an account (its tool asks for approval),
and an agent that keeps asking for an order's status (for budgets).

The models are Pydantic AI's own test models (``FunctionModel``, ``TestModel``): no
network. The payments service is :mod:`tests.integrations.payments`: a refund is a file
named by its idempotency key, created at most once, and every call and every model
request is a line in a log, so a test counts them from outside.
"""

from __future__ import annotations

from typing import Any

from pydantic_ai import Agent
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.models.test import TestModel

from ratchet.integrations.pydantic_ai import RatchetAgent, current_call
from tests.integrations.payments import (
    effect,
    effects,
    log,
    model_requests,
    shop_dir,
    tool_calls,
)

__all__ = ["effects", "model_requests", "shop_dir", "tool_calls"]


def _effect(tool: str, record: dict[str, Any]) -> dict[str, Any]:
    return effect(tool, record, current_call())


# -- the tools, as plain Pydantic AI tools --------------------------------------------------


def create_refund(order_id: str, amount_cents: int) -> dict[str, Any]:
    """Refund part of an order.

    Args:
        order_id: the order's reference.
        amount_cents: how much to refund, in cents.
    """
    return _effect("create_refund", {"order_id": order_id, "amount_cents": amount_cents})


def close_account(customer: str) -> dict[str, Any]:
    """Close a customer's account for good."""
    return _effect("close_account", {"customer": customer})


def cancel_order(order_id: str) -> dict[str, Any]:
    """Cancel an order (the service neither dedupes nor can be asked afterwards)."""
    return _effect("cancel_order", {"order_id": order_id, "cancelled": True})


def order_status(order_id: str) -> dict[str, Any]:
    """Where an order is."""
    log("calls.log", {"tool": "order_status", "key": None})
    return {"order_id": order_id, "status": "shipped"}


# -- the models -----------------------------------------------------------------------------


def _returned(messages: list[ModelMessage]) -> list[ToolReturnPart]:
    last = messages[-1]
    if not isinstance(last, ModelRequest):
        return []
    return [p for p in last.parts if isinstance(p, ToolReturnPart)]


def _asked(agent: str, messages: list[ModelMessage]) -> None:
    log("model.log", {"agent": agent, "messages": len(messages)})


def _refund_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    _asked("refunds", messages)
    if not any(isinstance(m, ModelResponse) for m in messages):
        args = {"order_id": "A-1", "amount_cents": 500}
        return ModelResponse(parts=[ToolCallPart("create_refund", args, tool_call_id="r1")])
    returned = _returned(messages)
    if returned and returned[0].outcome == "success":
        return ModelResponse(parts=[TextPart("Refunded 500 cents on order A-1.")])
    return ModelResponse(parts=[TextPart("The refund did not go through.")])


def _account_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    _asked("accounts", messages)
    if not any(isinstance(m, ModelResponse) for m in messages):
        return ModelResponse(
            parts=[ToolCallPart("close_account", {"customer": "c-7"}, tool_call_id="a1")]
        )
    return ModelResponse(parts=[TextPart("Closed the account of c-7.")])


def _cancel_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    _asked("cancels", messages)
    if not any(isinstance(m, ModelResponse) for m in messages):
        return ModelResponse(
            parts=[ToolCallPart("cancel_order", {"order_id": "A-9"}, tool_call_id="x1")]
        )
    return ModelResponse(parts=[TextPart("Cancelled order A-9.")])


def _curious_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    _asked("curious", messages)
    n = sum(1 for m in messages if isinstance(m, ModelResponse))
    return ModelResponse(
        parts=[ToolCallPart("order_status", {"order_id": f"A-{n}"}, tool_call_id=f"s{n}")]
    )


# -- the agents, and what makes them runnable by ratchet ------------------------------------

refund_agent = Agent(
    FunctionModel(_refund_model),
    name="refunds",
    instructions="Refund the order the user names, then say what you did.",
    tools=[create_refund, order_status],
)
account_agent = Agent(
    FunctionModel(_account_model),
    name="accounts",
    instructions="Close the account the user names.",
)
account_agent.tool_plain(requires_approval=True)(close_account)
cancel_agent = Agent(FunctionModel(_cancel_model), name="cancels", tools=[cancel_order])
curious_agent = Agent(FunctionModel(_curious_model), name="curious", tools=[order_status])
test_model_agent = Agent(
    TestModel(call_tools=["create_refund"]), name="test-model", tools=[create_refund]
)

refunds = RatchetAgent(refund_agent, prompt="Refund order A-1 for 500 cents.")
accounts = RatchetAgent(account_agent, prompt="Close the account of customer c-7.")
cancels = RatchetAgent(cancel_agent, prompt="Cancel order A-9.")
curious = RatchetAgent(curious_agent, prompt="Where is my order?")
test_model_refunds = RatchetAgent(test_model_agent, prompt="Refund an order.")

# Installed under the ratchet.tools entry-point group (the tests' dist-info).
create_refund_tool = refunds.tool("create_refund", idempotent=True)
order_status_tool = refunds.tool("order_status", risk="read_only")
close_account_tool = accounts.tool("close_account")
cancel_order_tool = cancels.tool("cancel_order")  # neither lookup nor dedupe: review
