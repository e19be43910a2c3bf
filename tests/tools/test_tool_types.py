"""``@ratchet.tool`` keeps the decorated function's signature for a type checker, bare
and with options: the result is a ``FunctionTool[P, R]``, called as the function is."""

from __future__ import annotations

from pathlib import Path

from tests.typecheck import check

SNIPPET = """
from typing import assert_type

import ratchet
from ratchet.tools import ToolCall, tool


@ratchet.tool
def bare(order_id: str, amount_cents: int) -> dict[str, str]:
    return {"order_id": order_id}


@tool(name="refund", risk="reversible_write", idempotent=True)
def with_options(order_id: str, *, call: ToolCall) -> int:
    return len(order_id)


assert_type(bare("o-1", 5), dict[str, str])
assert_type(with_options("o-1", call=ToolCall("r-1", "refund", None, None)), int)
reveal_type(bare)
reveal_type(with_options)
bare(1, 2)
with_options("o-1")
"""


def test_a_declared_tool_keeps_its_functions_signature(tmp_path: Path) -> None:
    report = check(SNIPPET, tmp_path)
    assert report == [
        '19: note: Revealed type is "ratchet.tools.declare.FunctionTool[[order_id: str,'
        ' amount_cents: int], dict[str, str]]"',
        '20: note: Revealed type is "ratchet.tools.declare.FunctionTool[[order_id: str, *,'
        ' call: ratchet.tools.declare.ToolCall], int]"',
        '21: error: Argument 1 to "__call__" of "FunctionTool" has incompatible type "int";'
        ' expected "str"  [arg-type]',
        '22: error: Missing named argument "call" for "__call__" of "FunctionTool"  [call-arg]',
    ]
