"""A real LangGraph graph on the saver: a stale worker stops at its next checkpoint with
``durability="sync"``, and runs on (its writes refused) with the default ``"async"``."""

from __future__ import annotations

import operator
import uuid
from collections.abc import Callable
from typing import Annotated, Any, TypedDict

import pytest
from langgraph.graph import END, START, StateGraph

from ratchet.errors import LeaseLostError
from ratchet.langgraph import RatchetSaver

from .conftest import wait_until_free
from .helpers import config

Make = Callable[..., RatchetSaver]


class State(TypedDict):
    log: Annotated[list[str], operator.add]


def _graph(saver: RatchetSaver, ran: list[str], during_first: Callable[[], None]) -> Any:
    def first(state: State) -> dict[str, Any]:
        ran.append("first")
        during_first()
        return {"log": ["first"]}

    def second(state: State) -> dict[str, Any]:
        ran.append("second")
        return {"log": ["second"]}

    def third(state: State) -> dict[str, Any]:
        ran.append("third")
        return {"log": ["third"]}

    builder = StateGraph(State)
    for name, fn in (("first", first), ("second", second), ("third", third)):
        builder.add_node(name, fn)
    builder.add_edge(START, "first")
    builder.add_edge("first", "second")
    builder.add_edge("second", "third")
    builder.add_edge("third", END)
    return builder.compile(checkpointer=saver)


def _takeover(stale: RatchetSaver, successor: RatchetSaver, t: str) -> Callable[[], None]:
    def run() -> None:
        # The stale worker's lease lapses while its node runs (a long call, a pause) and
        # another worker takes the thread over.
        wait_until_free(successor, t)
        successor.claim(t)

    return run


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_a_stale_workers_graph_is_fenced(make_saver: Make, durability: str) -> None:
    stale, successor = make_saver("worker-a", lease_ttl_ms=60), make_saver("worker-b")
    t = f"graph-{uuid.uuid4().hex[:10]}"
    ran: list[str] = []
    graph = _graph(stale, ran, _takeover(stale, successor, t))
    lease = stale.claim(t)
    with pytest.raises(LeaseLostError):
        graph.invoke({"log": []}, lease.config(), durability=durability)
    stored = [tup.metadata.get("step") for tup in successor.list(config(t))]
    assert stored == [0, -1]  # nothing the stale worker did after the takeover was stored
    if durability == "sync":
        assert ran == ["first"]  # stopped at its next checkpoint
    else:
        assert ran == ["first", "second", "third"]  # ran on; only its writes were refused


def test_a_graph_resumes_on_another_worker_from_the_stored_head(make_saver: Make) -> None:
    a, b = make_saver("worker-a"), make_saver("worker-b")
    t = f"graph-{uuid.uuid4().hex[:10]}"
    ran: list[str] = []
    graph_a = _graph(a, ran, lambda: None)
    lease = a.claim(t)
    graph_a.invoke({"log": []}, lease.config(), durability="sync", interrupt_before=["third"])
    a.release(lease)
    graph_b = _graph(b, ran, lambda: None)
    result = graph_b.invoke(None, b.claim(t).config(), durability="sync")
    assert result["log"] == ["first", "second", "third"]
    assert ran == ["first", "second", "third"]
