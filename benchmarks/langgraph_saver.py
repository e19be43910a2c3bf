"""LangGraph checkpointers side by side: ``RatchetSaver`` (signed, fenced, on Redis),
``AsyncSqliteSaver`` and LangGraph's ``InMemorySaver``, in one run.

For each saver, each phase for ``--seconds``, ``--rounds`` times interleaved (best round
kept, the same rule for every contender):

* ``aput``: a chain of checkpoints on one thread, each with a new ~4 KB channel value;
* ``aget_tuple``: the thread's latest checkpoint (with its values and pending writes);
* graph step: one super-step of a compiled ``StateGraph`` (a node that loops on itself,
  appending ~1 KB to its state) run with ``durability="sync"``, i.e. the node's writes and
  the step's checkpoint are stored before the next step starts.

Durability: ``RatchetSaver`` talks to this script's own ``redis-server`` with
``appendonly yes`` and ``appendfsync always`` through a ``redis.asyncio`` client;
``AsyncSqliteSaver`` uses a file database in WAL mode with ``synchronous=FULL``; the
in-memory saver stores nothing durably (the ceiling). Needs the ``langgraph`` and
``bench`` extras.

    python benchmarks/langgraph_saver.py [--seconds 1.0] [--rounds 3] [--json]
"""

from __future__ import annotations

import asyncio
import operator
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any, TypedDict

import redis.asyncio
from harness import emit, keyring, parse_args, parser, random_bytes, temp_redis
from langgraph.checkpoint.base import BaseCheckpointSaver, Checkpoint
from langgraph.checkpoint.base.id import uuid6
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
from langgraph.graph import END, START, StateGraph

from ratchet.langgraph import RatchetSaver
from ratchet.redis_server import RedisServer

VALUE_BYTES = 4096
STEP_BYTES = 1024


_Made = tuple[BaseCheckpointSaver[Any], dict[str, Any]]


class LoopState(TypedDict):
    notes: Annotated[list[str], operator.add]
    steps: int


def _checkpoint(value: str, version: int) -> Checkpoint:
    return Checkpoint(
        v=1,
        id=str(uuid6(clock_seq=-1)),
        ts="2026-01-01T00:00:00+00:00",
        channel_values={"messages": value, "count": version},
        channel_versions={"messages": version, "count": version},
        versions_seen={},
        pending_sends=[],
        updated_channels=None,
    )  # type: ignore[typeddict-unknown-key]


def _graph(saver: BaseCheckpointSaver[Any]) -> Any:
    def work(state: LoopState) -> dict[str, Any]:
        return {"notes": ["x" * STEP_BYTES], "steps": state["steps"] + 1}

    def again(state: LoopState) -> str:
        return "work" if state["steps"] < 10**9 else END

    builder = StateGraph(LoopState)
    builder.add_node("work", work)
    builder.add_edge(START, "work")
    builder.add_conditional_edges("work", again)
    return builder.compile(checkpointer=saver)


async def _timed(seconds: float, op: Callable[[int], Awaitable[None]]) -> float:
    """Run ``op`` back to back for ``seconds``; return operations per second."""
    count, start = 0, time.perf_counter()
    end = start + seconds
    while time.perf_counter() < end:
        await op(count)
        count += 1
    return count / (time.perf_counter() - start)


async def _phases(
    saver: BaseCheckpointSaver[Any], config: dict[str, Any], seconds: float
) -> dict[str, float]:
    value = random_bytes(VALUE_BYTES // 2).hex()
    thread = f"bench-{uuid.uuid4().hex[:8]}"
    base = {
        "configurable": {**config.get("configurable", {}), "thread_id": thread, "checkpoint_ns": ""}
    }
    parent: dict[str, Any] = {"id": None}

    async def put(i: int) -> None:
        cfg = {"configurable": {**base["configurable"]}}
        if parent["id"]:
            cfg["configurable"]["checkpoint_id"] = parent["id"]
        cp = _checkpoint(value + str(i), i + 1)
        stored = await saver.aput(
            cfg,
            cp,
            {"source": "loop", "step": i},  # type: ignore[arg-type]
            {"messages": i + 1, "count": i + 1},
        )
        parent["id"] = stored["configurable"]["checkpoint_id"]

    async def get(_: int) -> None:
        if await saver.aget_tuple(base) is None:  # type: ignore[arg-type]
            raise RuntimeError("the benchmark thread has no checkpoint")

    out = {"aput_per_s": await _timed(seconds, put), "aget_tuple_per_s": await _timed(seconds, get)}

    graph = _graph(saver)
    steps = max(20, int(seconds * 400))
    step_thread = {
        "configurable": {
            **config.get("configurable", {}),
            "thread_id": f"graph-{uuid.uuid4().hex[:8]}",
        },
        "recursion_limit": steps + 5,
    }
    start = time.perf_counter()
    done = 0
    async for _ in graph.astream(
        {"notes": [], "steps": 0},
        step_thread,  # type: ignore[arg-type]
        durability="sync",
        stream_mode="updates",
    ):
        done += 1
        if done >= steps or time.perf_counter() - start > seconds:
            break
    out["graph_steps_per_s"] = done / (time.perf_counter() - start)
    return out


@asynccontextmanager
async def _ratchet(server: RedisServer) -> AsyncIterator[_Made]:
    aclient = redis.asyncio.Redis.from_url(server.url, decode_responses=False)
    saver = RatchetSaver(server.client(), aclient=aclient, keyring=keyring("bench"), owner="bench")
    try:
        yield saver, {}
    finally:
        await aclient.aclose()


@asynccontextmanager
async def _sqlite(folder: Path) -> AsyncIterator[_Made]:
    path = folder / f"lg-{uuid.uuid4().hex[:6]}.sqlite"
    async with AsyncSqliteSaver.from_conn_string(str(path)) as saver:
        await saver.conn.execute("PRAGMA journal_mode=WAL")
        await saver.conn.execute("PRAGMA synchronous=FULL")
        yield saver, {}


@asynccontextmanager
async def _memory() -> AsyncIterator[_Made]:
    yield InMemorySaver(), {}


async def _bare_set(server: RedisServer, seconds: float) -> float:
    """The floor on this server: a plain async SET of the same size (one fsync each)."""
    client = redis.asyncio.Redis.from_url(server.url, decode_responses=False)
    value = random_bytes(VALUE_BYTES)
    try:

        async def op(_: int) -> None:
            await client.set("bench:floor", value)

        return await _timed(seconds, op)
    finally:
        await client.aclose()


async def run(seconds: float, rounds: int) -> dict[str, Any]:
    results: dict[str, dict[str, list[float]]] = {}
    with temp_redis() as (server, folder):
        makers: dict[str, Callable[[], Any]] = {
            "RatchetSaver (Redis, AOF always)": lambda: _ratchet(server),
            "AsyncSqliteSaver (file, WAL, FULL)": lambda: _sqlite(folder),
            "InMemorySaver": _memory,
        }
        floor: list[float] = []
        for _ in range(rounds):
            floor.append(await _bare_set(server, seconds))
            for name, make in makers.items():
                async with make() as (saver, config):
                    figures = await _phases(saver, config, seconds)
                for key, value in figures.items():
                    results.setdefault(name, {}).setdefault(key, []).append(value)
    best = {name: {k: round(max(v), 1) for k, v in figs.items()} for name, figs in results.items()}
    return {
        "seconds_per_phase": seconds,
        "rounds": rounds,
        "value_bytes": VALUE_BYTES,
        "python": sys.version.split()[0],
        "bare_redis_set_per_s": round(max(floor), 1),
        "savers": best,
    }


def _print_report(report: dict[str, Any]) -> None:
    print(
        f"bare Redis SET of {VALUE_BYTES} B on the same server: "
        f"{report['bare_redis_set_per_s']:,.0f}/s"
    )
    print(f"{'saver':38} {'aput/s':>9} {'aget_tuple/s':>13} {'graph steps/s':>14}")
    for name, f in report["savers"].items():
        print(
            f"{name:38} {f['aput_per_s']:>9,.0f} {f['aget_tuple_per_s']:>13,.0f} "
            f"{f['graph_steps_per_s']:>14,.0f}"
        )


def main(argv: list[str] | None = None) -> int:
    cli = parser(__doc__)
    cli.add_argument("--seconds", type=float, default=1.0, help="per phase and round")
    cli.add_argument("--rounds", type=int, default=3)
    args = parse_args(cli, argv)
    report = asyncio.run(run(args.seconds, args.rounds))
    # Indented, in the order measured (not sorted like the other scripts' JSON).
    emit(report, as_json=args.json, table=_print_report, indent=2, sort_keys=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
