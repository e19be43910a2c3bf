"""The adapter conformance suite, run against declared tools: the tools environment on
its own (one per recovery shape) and the router with a workspace and tools beside it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from ratchet.adapters import RouterAdapter, WorkspaceAdapter
from ratchet.runtime import Action
from ratchet.testing.conformance import CHECKS, ConformanceCheck, ConformanceSubject, run_check
from ratchet.testing.memory import ManualClock
from ratchet.tools import ToolsAdapter
from tests.adapters.harness import make_workspace
from tests.tools.refunds import RefundService, make_tool


def refund_call(key: str, variant: int, expected: int) -> Action:
    return Action.model_validate(
        {
            "action_id": f"a-{key}-{variant}",
            "kind": "create_refund",
            "risk": "irreversible_external_write",
            "args": {"order_id": f"o-{variant}", "amount_cents": 100 + variant},
            "idempotency_key": key,
            "expected_env_version": expected,
            "deadline_at": 2**40,
        }
    )


def tools_subject(tmp: Path, recovery: str) -> ConformanceSubject:
    service = RefundService(tmp / "refunds.sqlite")
    clock = ManualClock()
    handles: list[ToolsAdapter] = []

    def open_handle() -> ToolsAdapter:
        handles.append(ToolsAdapter([make_tool(service, recovery)], tmp / "ledger", clock=clock))
        return handles[-1]

    def close() -> None:
        for handle in handles:
            handle.close()

    return ConformanceSubject(
        adapter=open_handle(),
        make_write=refund_call,
        effects=lambda: service.effects,
        reopen=open_handle,
        close=close,
    )


def router_subject(tmp: Path) -> ConformanceSubject:
    root = make_workspace(tmp / "ws")
    service = RefundService(tmp / "refunds.sqlite")
    clock = ManualClock()
    opened: list[RouterAdapter] = []

    def open_handle() -> RouterAdapter:
        files = WorkspaceAdapter(root, ["app.py", "tests"], clock=clock)
        tools = ToolsAdapter([make_tool(service, "lookup")], tmp / "ledger", clock=clock)
        opened.append(RouterAdapter(files, tools=tools))
        return opened[-1]

    def close() -> None:
        for router in opened:
            for part in (router.files, router.tools):
                getattr(part, "close", lambda: None)()

    return ConformanceSubject(
        adapter=open_handle(),
        make_write=refund_call,
        effects=lambda: service.effects,
        reopen=open_handle,
        receipt_namespace="tools",
        # The router passes its parts' receipts on unchanged: the version is the part's.
        receipt_version=lambda: opened[-1].tools.observe().version,  # type: ignore[union-attr]
        close=close,
    )


SUBJECTS: dict[str, Callable[[Path], ConformanceSubject]] = {
    "tools-lookup": lambda tmp: tools_subject(tmp, "lookup"),
    "tools-idempotent": lambda tmp: tools_subject(tmp, "idempotent"),
    "tools-review": lambda tmp: tools_subject(tmp, "review"),
    "tools-fenced": lambda tmp: tools_subject(tmp, "fenced"),
    "router-with-tools": router_subject,
}


@pytest.mark.parametrize("subject", sorted(SUBJECTS))
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.name)
def test_declared_tools_conform(subject: str, check: ConformanceCheck, tmp_path: Path) -> None:
    if not run_check(check, lambda: SUBJECTS[subject](tmp_path)):
        pytest.skip(f"the subject cannot {check.needs}")
