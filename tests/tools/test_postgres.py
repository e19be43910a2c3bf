"""The PostgreSQL tool on the machine's real PostgreSQL: one transaction per call that
locks the run's fence row, refuses a stale fence or another store epoch (counting the
refusal), answers a key it has seen, runs the effect and records the key, so a stale
worker that got past the ledger is refused by the database itself.

Effects are counted in the database (the ``refunds`` rows), never by the runtime.
"""

# ruff: noqa: E402 - the driver check comes before the imports that need it

from __future__ import annotations

from tests.tools.pg import require_driver

require_driver()

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from pydantic import BaseModel, Field

from ratchet.errors import (
    AdapterError,
    ConfigurationError,
    FenceRejectedError,
    IdempotencyConflictError,
)
from ratchet.runtime import (
    CrashWindow,
    Fence,
    Phase,
    ReviewReason,
    RunEngine,
    TraceOutcome,
)
from ratchet.runtime.catalog import Recovery
from ratchet.testing.memory import ObserveFailsAfterWrite
from ratchet.tools import Toolbox, ToolCall, ToolsAdapter
from ratchet.tools.declare import Found
from ratchet.tools.postgres import PostgresTool
from tests.adapters.harness import WRITE_WINDOWS, SimulatedCrash, crash_at, scenario
from tests.tools.pg import Db, fresh_database, fresh_schema
from tests.tools.refunds import ToolRun

PERMITTED = ["read_file", "write_file", "run_verifier", "finish", "create_refund"]
INTENT_A = "a" * 64
INTENT_B = "b" * 64


class RefundArgs(BaseModel):
    order_id: str = Field(min_length=1, max_length=64)
    amount_cents: int = Field(ge=1, le=1_000_000)


def refunds_tool(db: Db, **options: Any) -> PostgresTool:
    """``create_refund``: one row in the test's refunds table per effect."""

    def create_refund(cur: psycopg.Cursor[Any], args: RefundArgs, call: ToolCall) -> dict[str, Any]:
        cur.execute(
            f"INSERT INTO {db.schema}.refunds (order_id, amount_cents, idempotency_key) "
            "VALUES (%s, %s, %s) RETURNING id",
            (args.order_id, args.amount_cents, call.idempotency_key),
        )
        row = cur.fetchone()
        assert row is not None
        return {"refund_id": f"rf-{row[0]}", "order_id": args.order_id}

    return PostgresTool(
        db.dsn,
        name="create_refund",
        args=RefundArgs,
        effect=options.pop("effect", create_refund),
        description="Refund part of an order.",
        **{"schema": db.schema, **options},
    )


def call(
    key: str = "refund-1",
    intent: str = INTENT_A,
    *,
    lease: int = 1,
    state: int = 1,
    epoch: str | None = None,
    run_id: str = "run-1",
) -> ToolCall:
    return ToolCall(
        run_id=run_id,
        tool="create_refund",
        idempotency_key=key,
        fence=Fence(run_id=run_id, lease_version=lease, state_version=state, store_epoch=epoch),
        intent_digest=intent,
    )


ARGS = RefundArgs(order_id="o-1", amount_cents=500)


@pytest.fixture(scope="module")
def database() -> Iterator[str]:
    with fresh_database() as dsn:
        yield dsn


@pytest.fixture
def db(database: str) -> Db:
    return fresh_schema(database)


@pytest.fixture
def tool(db: Db) -> Iterator[PostgresTool]:
    made = refunds_tool(db)
    yield made
    made.close()


# -- the tool on its own ---------------------------------------------------------------------


def test_the_tool_is_recovered_by_lookup_and_checks_fences_itself(tool: PostgresTool) -> None:
    assert tool.spec.recovery is Recovery.LOOKUP
    assert tool.spec.checks_fences
    assert tool.spec.name == "create_refund" and tool.spec.is_write


def test_one_call_commits_the_effect_its_key_and_the_fence_together(
    db: Db, tool: PostgresTool
) -> None:
    output = tool.run(ARGS, call())
    assert output == {"refund_id": "rf-1", "order_id": "o-1"}
    assert db.refunds == 1
    assert db.query("SELECT tool, intent_digest, run_id FROM ratchet_idempotency") == [
        ("create_refund", INTENT_A, "run-1")
    ]
    assert db.fences("run-1") == {
        "lease_version": 1,
        "state_version": 1,
        "store_epoch": None,
        "refused_stale": 0,
        "refused_epoch": 0,
    }
    found = tool.lookup("refund-1")
    assert isinstance(found, Found) and found.output == output
    assert found.intent_digest == INTENT_A  # the intent the call was made for
    assert tool.lookup("refund-2") is None


def test_the_same_key_and_intent_returns_the_stored_output_without_a_second_row(
    db: Db, tool: PostgresTool
) -> None:
    first = tool.run(ARGS, call())
    again = tool.run(ARGS, call(lease=2, state=3))
    assert again == first
    assert db.refunds == 1
    assert db.fences("run-1")["lease_version"] == 2  # the replay still raised the fence


def test_the_same_key_with_another_intent_is_a_conflict_and_writes_nothing(
    db: Db, tool: PostgresTool
) -> None:
    tool.run(ARGS, call())
    with pytest.raises(IdempotencyConflictError) as caught:
        tool.run(RefundArgs(order_id="o-1", amount_cents=999), call(intent=INTENT_B))
    assert caught.value.context["source"] == "postgres"
    assert db.refunds == 1


def test_a_stale_fence_is_refused_by_the_database_and_counted(db: Db, tool: PostgresTool) -> None:
    tool.raise_fence(Fence(run_id="run-1", lease_version=2, state_version=1))
    with pytest.raises(FenceRejectedError) as caught:
        tool.run(ARGS, call(lease=1, state=5))
    assert caught.value.context["source"] == "postgres"
    assert caught.value.context["seen"] == (2, 1)
    assert db.refunds == 0 and db.count("ratchet_idempotency") == 0
    assert db.fences("run-1")["refused_stale"] == 1
    with pytest.raises(FenceRejectedError):
        tool.raise_fence(Fence(run_id="run-1", lease_version=1, state_version=9))
    assert db.fences("run-1")["refused_stale"] == 2
    # Another run's fence is its own row.
    tool.run(ARGS, call(key="other-1", run_id="run-2"))
    assert db.refunds == 1


def test_another_store_epoch_is_refused_once_one_is_bound(db: Db, tool: PostgresTool) -> None:
    tool.raise_fence(Fence(run_id="run-1", lease_version=1, state_version=1, store_epoch="ep-1"))
    with pytest.raises(FenceRejectedError) as caught:
        tool.run(ARGS, call(lease=5, epoch="ep-2"))
    assert caught.value.reason == "store_epoch"
    assert db.fences("run-1")["refused_epoch"] == 1
    assert db.refunds == 0
    assert tool.run(ARGS, call(lease=5, epoch="ep-1"))["order_id"] == "o-1"
    assert db.fences("run-1")["store_epoch"] == "ep-1"


def test_an_effect_that_fails_is_rolled_back_whole(db: Db) -> None:
    def half_then_fail(cur: psycopg.Cursor[Any], args: RefundArgs) -> Any:
        cur.execute(
            f"INSERT INTO {db.schema}.refunds (order_id, amount_cents) VALUES (%s, %s)",
            (args.order_id, args.amount_cents),
        )
        raise ValueError("card declined for 4111-secret-pan")

    failing = refunds_tool(db, effect=half_then_fail)
    with pytest.raises(AdapterError) as caught:
        failing.run(ARGS, call())
    assert caught.value.retryable is False
    assert "secret-pan" not in str(caught.value) + repr(caught.value)
    assert db.refunds == 0 and db.count("ratchet_idempotency") == 0
    failing.close()


def test_an_output_that_is_not_canonical_json_is_rolled_back(db: Db) -> None:
    def floats(cur: psycopg.Cursor[Any], args: RefundArgs) -> Any:
        cur.execute(f"INSERT INTO {db.schema}.refunds (order_id, amount_cents) VALUES ('o', 1)")
        return {"amount": 5.0}

    tool = refunds_tool(db, effect=floats)
    with pytest.raises(AdapterError, match="canonical JSON") as caught:
        tool.run(ARGS, call())
    assert caught.value.retryable is False
    assert db.refunds == 0
    tool.close()


def test_a_serialization_failure_is_retried_with_each_attempt_rolled_back(db: Db) -> None:
    attempts: list[int] = []

    def contended(cur: psycopg.Cursor[Any], args: RefundArgs) -> Any:
        cur.execute(
            f"INSERT INTO {db.schema}.refunds (order_id, amount_cents) VALUES (%s, %s)",
            (args.order_id, args.amount_cents),
        )
        attempts.append(1)
        if len(attempts) < 3:
            raise psycopg.errors.SerializationFailure("could not serialize access")
        return {"attempt": len(attempts)}

    tool = refunds_tool(db, effect=contended, isolation=psycopg.IsolationLevel.SERIALIZABLE)
    assert tool.run(ARGS, call()) == {"attempt": 3}
    assert db.refunds == 1  # the two failed attempts left nothing

    def always(cur: psycopg.Cursor[Any], args: RefundArgs) -> Any:
        cur.execute(f"INSERT INTO {db.schema}.refunds (order_id, amount_cents) VALUES ('o', 1)")
        raise psycopg.errors.DeadlockDetected("deadlock detected")

    stuck = refunds_tool(db, effect=always, retries=2)
    with pytest.raises(AdapterError, match="2 attempts") as caught:
        stuck.run(ARGS, call(key="refund-2"))
    assert caught.value.retryable is True
    assert db.refunds == 1
    tool.close()
    stuck.close()


def test_a_connection_lost_inside_the_transaction_is_tried_again_with_nothing_left_behind(
    db: Db,
) -> None:
    attempts: list[int] = []

    def dies_once(cur: psycopg.Cursor[Any], args: RefundArgs) -> Any:
        cur.execute(
            f"INSERT INTO {db.schema}.refunds (order_id, amount_cents) VALUES (%s, %s)",
            (args.order_id, args.amount_cents),
        )
        attempts.append(1)
        if len(attempts) == 1:
            cur.execute("SELECT pg_terminate_backend(pg_backend_pid())")  # the server drops us
        return {"attempt": len(attempts)}

    tool = refunds_tool(db, effect=dies_once)
    assert tool.run(ARGS, call()) == {"attempt": 2}
    assert db.refunds == 1  # the first attempt died before COMMIT: rolled back
    tool.close()


def test_an_idle_connection_the_server_dropped_is_replaced(db: Db, tool: PostgresTool) -> None:
    tool.run(ARGS, call())
    db.query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        "WHERE datname = current_database() AND pid <> pg_backend_pid()"
    )
    assert tool.run(RefundArgs(order_id="o-2", amount_cents=1), call(key="refund-2"))
    assert db.refunds == 2


def test_an_unreachable_database_is_retryable_and_no_password_is_shown() -> None:
    secret = "hunter2-not-shown"
    tool = PostgresTool(
        f"postgresql://postgres:{secret}@127.0.0.1:1/nowhere?connect_timeout=2",
        name="create_refund",
        args=RefundArgs,
        effect=lambda cur, args: None,
    )
    with pytest.raises(AdapterError) as caught:
        tool.run(ARGS, call())
    assert caught.value.retryable is True
    shown = str(caught.value) + repr(caught.value) + repr(tool)
    assert secret not in shown
    assert "127.0.0.1:1/nowhere" in repr(tool)


def test_a_connection_string_that_does_not_parse_is_refused_without_quoting_it() -> None:
    with pytest.raises(ConfigurationError) as caught:
        PostgresTool(
            "postgresql://u:hunter2-not-shown@[broken",
            name="create_refund",
            args=RefundArgs,
            effect=lambda cur, args: None,
        )
    assert caught.value.field == "dsn"
    assert "hunter2" not in str(caught.value) + repr(caught.value)


@pytest.mark.parametrize(
    ("options", "where"),
    [
        ({"prefix": "bad-prefix"}, "prefix"),
        ({"schema": "x; drop"}, "schema"),
        ({"retries": 0}, "retries"),
    ],
)
def test_bad_table_names_and_retry_counts_are_refused(
    db: Db, options: dict[str, Any], where: str
) -> None:
    with pytest.raises(ConfigurationError) as caught:
        refunds_tool(db, **options)
    assert caught.value.field == where


def test_a_tool_without_an_effect_is_refused(db: Db) -> None:
    with pytest.raises(ConfigurationError, match="needs an effect"):
        PostgresTool(db.dsn, name="create_refund", args=RefundArgs)


def test_the_subclass_form_and_a_table_prefix_work_alike(db: Db) -> None:
    class Refunds(PostgresTool):
        name = "create_refund"
        Args = RefundArgs

        def effect(self, cursor: psycopg.Cursor[Any], args: RefundArgs) -> dict[str, str]:
            cursor.execute(
                f"INSERT INTO {db.schema}.refunds (order_id, amount_cents) VALUES (%s, %s)",
                (args.order_id, args.amount_cents),
            )
            return {"order_id": args.order_id}

    tool = Refunds(db.dsn, schema=db.schema, prefix="shop_")
    assert tool.run(ARGS, call()) == {"order_id": "o-1"}
    assert tool.fence_table == f"{db.schema}.shop_fences"
    assert db.count("shop_idempotency") == 1 and db.refunds == 1
    assert tool.fence_row("run-1") is not None
    tool.close()


def test_first_use_from_many_threads_creates_the_tables_once(db: Db) -> None:
    tools = [refunds_tool(db) for _ in range(6)]
    barrier = threading.Barrier(len(tools))
    errors: list[BaseException] = []

    def first_call(i: int) -> None:
        barrier.wait()
        try:
            tools[i].run(ARGS, call(key=f"k-{i}", run_id=f"run-{i}"))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=first_call, args=(i,)) for i in range(len(tools))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    assert db.refunds == len(tools)
    for t in tools:
        t.close()


def test_a_read_only_tool_reads_in_a_read_only_transaction(db: Db, tool: PostgresTool) -> None:
    tool.run(ARGS, call())

    class Query(BaseModel):
        order_id: str

    def count_refunds(cur: psycopg.Cursor[Any], args: Query) -> int:
        cur.execute(
            f"SELECT count(*) FROM {db.schema}.refunds WHERE order_id = %s", (args.order_id,)
        )
        row = cur.fetchone()
        return int(row[0]) if row else 0

    def sneaky_write(cur: psycopg.Cursor[Any], args: Query) -> int:
        cur.execute(f"DELETE FROM {db.schema}.refunds")
        return 0

    reader = PostgresTool(
        db.dsn, name="refund_count", args=Query, risk="read_only", effect=count_refunds
    )
    writer = PostgresTool(
        db.dsn, name="refund_purge", args=Query, risk="read_only", effect=sneaky_write
    )
    read_call = ToolCall(run_id="", tool="refund_count", idempotency_key=None, fence=None)
    assert reader.run(Query(order_id="o-1"), read_call) == 1
    with pytest.raises(AdapterError) as caught:
        writer.run(Query(order_id="o-1"), read_call)
    assert caught.value.retryable is False
    assert db.refunds == 1
    reader.close()
    writer.close()


def test_a_new_owners_fence_waits_for_a_call_inside_its_transaction_then_finds_its_key(
    db: Db,
) -> None:
    """The zombie is inside its transaction (row locked) when the new owner raises its
    fence: the raise waits for the COMMIT, so the zombie's write is whole and the new
    owner's lookup finds it; nothing lands behind the new fence."""
    inside = threading.Event()
    release = threading.Event()

    def slow_refund(cur: psycopg.Cursor[Any], args: RefundArgs) -> dict[str, str]:
        cur.execute(
            f"INSERT INTO {db.schema}.refunds (order_id, amount_cents) VALUES (%s, %s)",
            (args.order_id, args.amount_cents),
        )
        inside.set()
        assert release.wait(timeout=60)
        return {"order_id": args.order_id}

    zombie = refunds_tool(db, effect=slow_refund)
    owner = refunds_tool(db)
    results: dict[str, Any] = {}

    def zombie_call() -> None:
        results["zombie"] = zombie.run(ARGS, call(lease=1))

    def owner_fence() -> None:
        owner.raise_fence(Fence(run_id="run-1", lease_version=2, state_version=1))
        results["raised"] = True

    z = threading.Thread(target=zombie_call)
    z.start()
    assert inside.wait(timeout=60)
    o = threading.Thread(target=owner_fence)
    o.start()
    wait_for_lock_waiter(db)  # the owner's raise blocks on the zombie's row lock
    assert "raised" not in results
    release.set()
    z.join(timeout=60)
    o.join(timeout=60)
    assert results == {"zombie": {"order_id": "o-1"}, "raised": True}
    assert owner.lookup("refund-1").output == {"order_id": "o-1"}
    assert db.fences("run-1")["lease_version"] == 2
    with pytest.raises(FenceRejectedError):
        zombie.run(RefundArgs(order_id="o-2", amount_cents=1), call(key="refund-2", lease=1))
    assert db.refunds == 1
    zombie.close()
    owner.close()


def wait_for_lock_waiter(db: Db, deadline_s: float = 30.0) -> None:
    """Poll pg_stat_activity until a session of the database waits on a lock."""
    import time

    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        rows = db.query(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock'"
        )
        if rows[0][0] >= 1:
            return
        time.sleep(0.02)
    raise AssertionError("no session waited on the fence row's lock")


# -- through the engine ------------------------------------------------------------------------


@dataclass
class Setup:
    run: ToolRun
    adapters: list[ToolsAdapter]
    tools: list[PostgresTool]
    hook: list[Any]  # the current ToolsAdapter hook (tests replace it)

    def close(self) -> None:
        for a in self.adapters:
            a.close()


def _setup(tmp_path: Path, db: Db) -> Setup:
    adapters: list[ToolsAdapter] = []
    tools: list[PostgresTool] = []
    hook: list[Any] = [lambda stage: None]
    sc = scenario(permissions=PERMITTED)

    def current_hook(stage: str) -> None:
        hook[0](stage)

    def open_adapter() -> Any:
        # A new worker process: its own tool (own connections) over the shared ledger.
        made = refunds_tool(db)
        tools.append(made)
        adapter = Toolbox([made]).environment(
            sc,
            ledger=tmp_path / "ledger.sqlite",
            hook=current_hook,
            clock=run.clock,
        )
        assert isinstance(adapter, ToolsAdapter)
        adapters.append(adapter)
        return adapter

    catalog = Toolbox([refunds_tool(db)]).catalog
    run = ToolRun(
        open_adapter=open_adapter, effects=lambda: db.refunds, scenario=sc, catalog=catalog
    )
    return Setup(run, adapters, tools, hook)


@pytest.fixture
def setup(tmp_path: Path, db: Db) -> Iterator[Setup]:
    made = _setup(tmp_path, db)
    yield made
    made.close()


def test_one_refund_through_the_engine_is_one_row_and_its_receipt(setup: Setup, db: Db) -> None:
    engine = setup.run.start()
    result = engine.propose(setup.run.refund(engine))
    assert result.outcome is TraceOutcome.EXECUTED
    assert db.refunds == 1
    receipt = engine.state.executed[-1].receipt
    assert receipt.result["tool"] == "create_refund"
    assert receipt.result["output"] == '{"order_id":"o-1","refund_id":"rf-1"}'
    key = engine.state.executed[-1].idempotency_key
    assert db.query("SELECT idempotency_key FROM refunds") == [(key,)]
    assert db.fences("run-1")["lease_version"] == 1


def test_a_replayed_proposal_returns_the_stored_receipt_and_adds_no_row(
    setup: Setup, db: Db
) -> None:
    engine = setup.run.start()
    engine.propose(setup.run.refund(engine, key="refund-1"))
    result = engine.propose(setup.run.refund(engine, key="refund-1"))
    assert result.outcome is TraceOutcome.REPLAYED
    assert db.refunds == 1


def test_the_same_key_with_another_intent_is_rejected_and_adds_no_row(setup: Setup, db: Db) -> None:
    engine = setup.run.start()
    engine.propose(setup.run.refund(engine, key="refund-1"))
    result = engine.propose(setup.run.refund(engine, key="refund-1", amount=999))
    assert result.outcome is TraceOutcome.REJECTED_KEY_CONFLICT
    assert db.refunds == 1


def test_a_key_the_database_holds_for_another_intent_freezes_the_run(
    tmp_path: Path, setup: Setup, db: Db
) -> None:
    """Another environment (its own ledger) over the same database used the key: only
    the database knows it, refuses the call in its transaction, and the run waits for a
    reviewer with nothing sent."""
    first = setup.run.start()
    first.propose(setup.run.refund(first, key="shared-key"))
    other = _setup(tmp_path / "other", db)
    other.run.run_id = "run-2"
    second = other.run.start()
    result = second.propose(other.run.refund(second, key="shared-key", amount=999))
    assert result.phase is Phase.NEEDS_REVIEW
    # The ledger holds no receipt for the key (the database refused the call), so the
    # case says the adapter reported a conflict it cannot show a receipt for.
    assert second.state.review is not None
    assert second.state.review.reason is ReviewReason.RECEIPT_MISSING
    assert db.refunds == 1
    row = other.adapters[0].ledger.row("shared-key")
    assert row is not None and row.status == "aborted"  # sent, refused, no effect
    other.close()


def test_a_late_call_from_the_old_owner_is_refused_by_the_database(setup: Setup, db: Db) -> None:
    """Worker A (lease 1) committed its intent and passed the ledger's fence check, then
    paused before the call. Worker B (lease 2) takes the run over: it raises the fence at
    the ledger and at the database, finds the key never committed, and makes the refund.
    A wakes up and sends its call: the ledger is behind it, so only the database can
    refuse it, in the call's own transaction."""
    new_owner: list[RunEngine] = []

    def paused_then_late(stage: str) -> None:
        if stage == "before_call" and not new_owner:
            setup.hook[0] = lambda stage: None  # B's own call does not pause
            resumed = setup.run.resume(lease_version=2)
            resumed.reconcile()
            new_owner.append(resumed)

    worker_a = setup.run.start()
    setup.hook[0] = paused_then_late
    with pytest.raises(FenceRejectedError) as caught:
        worker_a.propose(setup.run.refund(worker_a))

    assert caught.value.context["source"] == "postgres"
    assert caught.value.context["table"] == f"{db.schema}.ratchet_fences"
    assert caught.value.context["fence"][0] == 1 and caught.value.context["seen"][0] == 2
    fences = db.fences("run-1")
    assert fences["refused_stale"] == 1 and fences["lease_version"] == 2
    assert setup.adapters[0].ledger.counters()[1] == 0  # the ledger refused nothing
    assert db.refunds == 1
    worker_b = new_owner[0]
    assert worker_b.state.phase is Phase.RUNNING and worker_b.state.pending is None
    assert worker_b.state.executed[-1].receipt.result["tool"] == "create_refund"


@pytest.mark.parametrize("window", WRITE_WINDOWS)
def test_a_crash_in_each_engine_window_leaves_exactly_one_row(
    setup: Setup, db: Db, window: CrashWindow
) -> None:
    engine = setup.run.start(probe=crash_at(window))
    if window is CrashWindow.AFTER_RECEIPT_BEFORE_STATE:
        engine.executor.hooks = ObserveFailsAfterWrite(engine.executor.hooks)
    with pytest.raises(SimulatedCrash):
        engine.propose(setup.run.refund(engine))

    resumed = setup.run.resume(lease_version=2)
    assert resumed.reconcile().window is window
    assert db.refunds == 1
    assert resumed.state.phase is Phase.RUNNING and resumed.state.pending is None
    assert resumed.propose(setup.run.refund(resumed, order_id="o-2")).outcome is (
        TraceOutcome.EXECUTED
    )
    assert db.refunds == 2


class CrashInTool(Exception):
    """The worker died inside the tool adapter."""


@pytest.mark.parametrize("stage", ["before_call", "after_call"])
def test_a_crash_inside_the_call_is_settled_by_the_databases_key(
    setup: Setup, db: Db, stage: str
) -> None:
    """before_call: the ledger row is started, the database never saw the call;
    after_call: the database committed, the ledger never heard. Either way the lookup
    by key at the database settles it, with exactly one row."""

    def crash(seen: str) -> None:
        if seen == stage:
            setup.hook[0] = lambda stage: None
            raise CrashInTool(stage)

    engine = setup.run.start()
    setup.hook[0] = crash
    with pytest.raises(CrashInTool):
        engine.propose(setup.run.refund(engine))
    assert db.refunds == (0 if stage == "before_call" else 1)

    resumed = setup.run.resume(lease_version=2)
    resumed.reconcile()
    assert resumed.state.phase is Phase.RUNNING and resumed.state.pending is None
    assert resumed.state.trace[-1].outcome in (TraceOutcome.RECONCILED, TraceOutcome.EXECUTED)
    assert db.refunds == 1
