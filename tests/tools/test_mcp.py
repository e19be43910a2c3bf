"""MCP servers as fenced environments, against the real tickets server: the tools and
their contracts, one run through the engine, every crash window with the server killed
in it, a stale owner refused by the server's fence, streamable HTTP, and secrets."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ratchet.errors import (
    ActionError,
    AdapterError,
    ConfigurationError,
    FenceRejectedError,
    IdempotencyConflictError,
)
from ratchet.runtime import (
    Action,
    Adapter,
    CrashWindow,
    Fence,
    Phase,
    ReviewReason,
    RunEngine,
    TraceOutcome,
)
from ratchet.runtime.actions import Risk, derive_idempotency_key
from ratchet.runtime.catalog import TOOL_NAME_PATTERN, Recovery
from ratchet.runtime.engine import Probe
from ratchet.testing.memory import ObserveFailsAfterWrite
from ratchet.tools import Tool, Toolbox, ToolCall, ToolsAdapter
from ratchet.tools.mcp import (
    KeyRecipe,
    MCPConnection,
    McpDeclaration,
    MCPTool,
    mcp_tools,
    tool_name,
    tool_output,
)
from ratchet.worker.executor import Executor
from tests.adapters.harness import WRITE_WINDOWS, Harness, SimulatedCrash, scenario
from tests.tools.conftest import Tickets

TICKETS_SCENARIO = scenario(permissions=["create_ticket", "list_tickets", "finish"])
SEP3182 = ("--sep3182",)
IDEMPOTENT = ("--idempotent",)
PLAIN: tuple[str, ...] = ()
ENV_SECRET = "env-secret-6f1c0d9a"
HEADER_SECRET = "header-secret-93b2e7c4"


def by_name(tools: list[Tool]) -> dict[str, MCPTool]:
    found = {t.spec.name: t for t in tools}
    assert all(isinstance(t, MCPTool) for t in found.values())
    return {n: t for n, t in found.items() if isinstance(t, MCPTool)}


def write_call(key: str = "key-1", *, run_id: str = "run-k", lease: int = 1) -> ToolCall:
    fence = Fence(run_id=run_id, lease_version=lease, state_version=1)
    return ToolCall(run_id=run_id, tool="create_ticket", idempotency_key=key, fence=fence)


def create(tool: MCPTool, call: ToolCall, title: str = "printer on fire") -> Any:
    return tool.run(tool.parse_args({"title": title, "body": "third floor"}), call)


# -- the engine over the server's tools --------------------------------------------------------


@dataclass
class ToolRun(Harness):
    """The adapter harness, with the run's declared tools handed to the engine."""

    def ports(self, adapter: Adapter, store: Any, probe: Probe | None = None) -> dict[str, Any]:
        ports = super().ports(adapter, store, probe)
        if isinstance(adapter, ToolsAdapter):
            ports["tools"] = adapter.catalog
        return ports


class TicketsEnvironment:
    """Opens the run's environment as a new worker would: a new connection (a new stdio
    server on the same state, unless ``connect`` says otherwise), the server's tools, one
    ledger file. ``next_hook`` is handed to the next adapter opened (ToolsAdapter's crash
    points), then cleared."""

    def __init__(
        self,
        tickets: Tickets,
        ledger: Path,
        flags: tuple[str, ...] = (),
        connect: Callable[[], MCPConnection] | None = None,
        declare: dict[str, McpDeclaration] | None = None,
    ) -> None:
        self.tickets = tickets
        self.declare = declare
        self.ledger = ledger
        self.connect = connect or (lambda: tickets.connect(*flags))
        self.current: MCPConnection | None = None
        self.next_hook: Callable[[str], None] | None = None

    def open(self) -> Adapter:
        self.current = self.connect()
        hook, self.next_hook = self.next_hook, None
        options: dict[str, Any] = {"hook": hook} if hook is not None else {}
        return Toolbox(mcp_tools(self.current, declare=self.declare)).environment(
            TICKETS_SCENARIO, ledger=self.ledger, **options
        )

    def kill_server(self) -> None:
        """The worker's server died with it (the window's crash)."""
        if self.current is not None:
            self.tickets.kill(self.current)


def tickets_run(tickets: Tickets, env: TicketsEnvironment) -> ToolRun:
    return ToolRun(
        open_adapter=env.open,
        effects=lambda: tickets.stats().effects,
        scenario=TICKETS_SCENARIO,
    )


def ticket_action(run: Harness, engine: RunEngine, title: str = "crash-proof") -> Action:
    return Action.model_validate(
        {
            "action_id": f"a-{engine.state.next_seq}",
            "kind": "create_ticket",
            "risk": "irreversible_external_write",
            "args": {"title": title, "body": "filed by a run"},
            "idempotency_key": derive_idempotency_key(
                engine.state.run_id, engine.state.plan_cursor
            ),
            "expected_env_version": engine.state.environment.version,
            "deadline_at": run.clock.now() + 600,
        }
    )


def list_action(run: Harness, engine: RunEngine) -> Action:
    return Action.model_validate(
        {
            "action_id": f"a-{engine.state.next_seq}",
            "kind": "list_tickets",
            "risk": "read_only",
            "args": {},
            "expected_env_version": engine.state.environment.version,
            "deadline_at": run.clock.now() + 600,
        }
    )


# -- the tools and their contracts ------------------------------------------------------------


def test_every_server_tool_but_the_extension_tools_becomes_a_tool(tickets: Tickets) -> None:
    conn = tickets.connect("--fences", "--lookup")
    listed = {t.name for t in conn.list_tools()}
    assert {"ratchet_raise_fence", "ratchet_lookup"} <= listed
    names = sorted(t.spec.name for t in mcp_tools(conn))
    assert names == [
        "close_ticket",
        "comment_ticket",
        "create_ticket",
        "list_tickets",
        "tickets_search",
    ]


def test_an_args_model_is_exactly_the_servers_input_schema_and_validates_by_it(
    tickets: Tickets,
) -> None:
    conn = tickets.connect()
    schemas = {t.name: t.input_schema for t in conn.list_tools()}
    tools = by_name(mcp_tools(conn))
    for tool in tools.values():
        assert tool.args_model.model_json_schema() == schemas[tool.remote_name]
    spec = tools["create_ticket"].spec
    given = {"title": "printer on fire", "body": "third floor"}
    assert spec.validate_args(given) == given
    bad_args: list[tuple[dict[str, Any], str]] = [
        ({"title": 7, "body": "x"}, "title"),
        ({"title": "x"}, "body"),
        ({"title": "x", "body": "y", "priority": 1}, "priority"),
        ({"title": "", "body": "y"}, "title"),
    ]
    for bad, where in bad_args:
        with pytest.raises(ActionError) as caught:
            spec.validate_args(bad)
        assert where in caught.value.message


def test_a_schema_that_admits_floats_is_refused_naming_the_tool(tickets: Tickets) -> None:
    conn = tickets.connect("--estimates")
    with pytest.raises(ConfigurationError) as caught:
        mcp_tools(conn)
    assert "estimate_ticket" in caught.value.message
    kept = mcp_tools(conn, include=["create_ticket", "list_tickets"])
    assert sorted(t.spec.name for t in kept) == ["create_ticket", "list_tickets"]


def test_an_included_name_the_server_does_not_list_is_refused(tickets: Tickets) -> None:
    conn = tickets.connect()
    with pytest.raises(ConfigurationError) as caught:
        mcp_tools(conn, include=["create_ticket", "delete_everything"])
    assert "delete_everything" in caught.value.message


def test_names_are_prefixed_and_sanitised_to_the_tool_name_pattern(tickets: Tickets) -> None:
    conn = tickets.connect()
    tools = by_name(mcp_tools(conn, prefix="helpdesk."))
    assert tools["helpdesk_tickets_search"].remote_name == "tickets.search"
    assert tools["helpdesk_create_ticket"].remote_name == "create_ticket"


@pytest.mark.parametrize("prefix, name", [("", "9lives"), ("", "héllo"), ("x" * 60, "create")])
def test_a_name_that_cannot_be_made_a_tool_name_is_refused(prefix: str, name: str) -> None:
    if name == "héllo":
        assert tool_name(prefix, name) == "h_llo"  # sanitised, and valid
        return
    with pytest.raises(ConfigurationError) as caught:
        tool_name(prefix, name)
    assert TOOL_NAME_PATTERN in caught.value.message


def test_a_read_only_hint_makes_a_read(tickets: Tickets) -> None:
    tools = by_name(mcp_tools(tickets.connect("--fences", "--lookup")))
    spec = tools["list_tickets"].spec
    assert spec.risk is Risk.READ_ONLY
    assert not spec.checks_fences and spec.contract["recovery"] == ""


def test_a_destructive_hint_makes_an_irreversible_external_write(tickets: Tickets) -> None:
    spec = by_name(mcp_tools(tickets.connect()))["create_ticket"].spec
    assert spec.risk is Risk.IRREVERSIBLE_EXTERNAL_WRITE
    assert spec.recovery is Recovery.REVIEW


def test_a_tool_without_hints_is_an_irreversible_external_write(tickets: Tickets) -> None:
    conn = tickets.connect()
    assert next(t for t in conn.list_tools() if t.name == "comment_ticket").annotations is None
    spec = by_name(mcp_tools(conn))["comment_ticket"].spec
    assert spec.risk is Risk.IRREVERSIBLE_EXTERNAL_WRITE


def test_read_only_false_and_destructive_false_make_a_reversible_write(tickets: Tickets) -> None:
    spec = by_name(mcp_tools(tickets.connect()))["close_ticket"].spec
    assert spec.risk is Risk.REVERSIBLE_WRITE


def test_an_idempotent_hint_makes_the_tool_idempotent(tickets: Tickets) -> None:
    tools = by_name(mcp_tools(tickets.connect(*IDEMPOTENT)))
    assert tools["create_ticket"].spec.recovery is Recovery.IDEMPOTENT
    assert tools["comment_ticket"].spec.recovery is Recovery.REVIEW  # no hint, no SEP-3182


def test_a_server_with_sep3182_makes_every_write_idempotent(tickets: Tickets) -> None:
    tools = by_name(mcp_tools(tickets.connect(*SEP3182)))
    for name in ("create_ticket", "close_ticket", "comment_ticket"):
        assert tools[name].spec.recovery is Recovery.IDEMPOTENT


def test_the_extensions_make_writes_check_fences_and_recover_by_lookup(tickets: Tickets) -> None:
    tools = by_name(mcp_tools(tickets.connect("--fences", "--lookup", *SEP3182)))
    spec = tools["create_ticket"].spec
    assert spec.checks_fences and spec.recovery is Recovery.LOOKUP
    plain = by_name(mcp_tools(tickets.connect()))["create_ticket"].spec
    assert not plain.checks_fences


# -- key, fence and error transport -----------------------------------------------------------


@pytest.mark.parametrize("flags, beside, in_meta", [(SEP3182, 2, 0), (IDEMPOTENT, 0, 2)])
def test_the_key_goes_beside_arguments_for_sep3182_and_in_meta_otherwise(
    tickets: Tickets, flags: tuple[str, ...], beside: int, in_meta: int
) -> None:
    create_ticket = by_name(mcp_tools(tickets.connect(*flags)))["create_ticket"]
    first = create(create_ticket, write_call())
    assert create(create_ticket, write_call()) == first
    seen = tickets.stats()
    assert (seen.effects, seen.replays) == (1, 1)
    assert (seen.keys_beside_arguments, seen.keys_in_meta) == (beside, in_meta)


@pytest.mark.parametrize("flags", [SEP3182, IDEMPOTENT], ids=["json-rpc-error", "is-error"])
def test_a_key_reused_for_other_arguments_is_an_idempotency_conflict(
    tickets: Tickets, flags: tuple[str, ...]
) -> None:
    create_ticket = by_name(mcp_tools(tickets.connect(*flags)))["create_ticket"]
    create(create_ticket, write_call())
    with pytest.raises(IdempotencyConflictError):
        create(create_ticket, write_call(), title="another ticket")
    assert (tickets.stats().effects, tickets.stats().conflicts) == (1, 1)


def test_a_tool_error_result_is_a_refusal_with_no_effect(tickets: Tickets) -> None:
    close_ticket = by_name(mcp_tools(tickets.connect()))["close_ticket"]
    with pytest.raises(AdapterError) as caught:
        close_ticket.run(close_ticket.parse_args({"ticket_id": 999}), write_call())
    assert type(caught.value) is AdapterError and caught.value.retryable is False
    assert "no ticket 999" in caught.value.message


def test_a_fence_older_than_one_raised_is_refused_at_the_server(tickets: Tickets) -> None:
    create_ticket = by_name(mcp_tools(tickets.connect("--fences")))["create_ticket"]
    create_ticket.raise_fence(Fence(run_id="run-k", lease_version=2, state_version=1))
    with pytest.raises(FenceRejectedError):
        create(create_ticket, write_call(lease=1))
    assert create(create_ticket, write_call("key-2", lease=2))["ticket_id"] == 1
    with pytest.raises(FenceRejectedError):
        create_ticket.raise_fence(Fence(run_id="run-k", lease_version=1, state_version=9))
    seen = tickets.stats()
    assert (seen.effects, seen.refused_stale) == (1, 2)


def test_a_dead_server_is_a_retryable_adapter_error(tickets: Tickets) -> None:
    conn = tickets.connect()
    create_ticket = by_name(mcp_tools(conn))["create_ticket"]
    tickets.kill(conn, close=False)
    with pytest.raises(AdapterError) as caught:
        create(create_ticket, write_call())
    assert caught.value.retryable is True
    assert tickets.stats().effects == 0


def test_a_server_that_cannot_start_is_reported_with_what_it_said_in_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Not "could not be connected (ExceptionGroup)" alone: the tail of the server's
    stderr, on one line, scrubbed of the connection's secrets; each line also logged."""
    said = (
        "import sys; print('Traceback (most recent call last):', file=sys.stderr); "
        "print('ModuleNotFoundError: No module named mcp_server_x tok-s3cr3t', file=sys.stderr); "
        "sys.exit(3)"
    )
    conn = MCPConnection.stdio(
        [sys.executable, "-c", said], env={"TOKEN": "tok-s3cr3t"}, connect_timeout_s=20
    )
    with (
        caplog.at_level(logging.INFO, logger="ratchet.tools.mcp.stderr"),
        pytest.raises(AdapterError) as caught,
    ):
        conn.start()
    message = str(caught.value)
    assert caught.value.retryable is True
    assert "No module named mcp_server_x" in message and "\n" not in message
    assert "tok-s3cr3t" not in message and "***" in message
    logged = [r.getMessage() for r in caplog.records]
    assert any("No module named mcp_server_x" in m for m in logged)
    assert not any("tok-s3cr3t" in m for m in logged)


def test_a_server_that_stops_answering_is_a_retryable_error_not_a_hang(tickets: Tickets) -> None:
    conn = tickets.connect(timeout_s=1.0)
    list_tickets = by_name(mcp_tools(conn))["list_tickets"]
    pid = tickets.pause(conn)
    try:
        with pytest.raises(AdapterError) as caught:
            list_tickets.run(list_tickets.parse_args({}), write_call())
        assert caught.value.retryable is True
    finally:
        os.kill(pid, signal.SIGCONT)


# -- through the engine -----------------------------------------------------------------------


def test_a_ticket_created_through_the_engine_is_one_effect_with_its_receipt(
    tickets: Tickets, tmp_path: Path
) -> None:
    env = TicketsEnvironment(tickets, tmp_path / "ledger.sqlite3", SEP3182)
    run = tickets_run(tickets, env)
    engine = run.start()
    assert engine.propose(ticket_action(run, engine)).outcome is TraceOutcome.EXECUTED
    receipt = engine.state.executed[-1].receipt
    assert receipt.result["tool"] == "create_ticket"
    assert json.loads(str(receipt.result["output"])) == {"ticket_id": 1, "title": "crash-proof"}
    assert tickets.stats().effects == 1
    read = engine.propose(list_action(run, engine)).read
    assert read is not None and json.loads(read.content)["tickets"][0]["ticket_id"] == 1
    assert tickets.stats().effects == 1


ADAPTER_WINDOW = "after_call"  # ToolsAdapter's own: the tool returned, the ledger not committed


def crash_run(
    tickets: Tickets,
    tmp_path: Path,
    flags: tuple[str, ...],
    window: CrashWindow | str,
    declare: dict[str, McpDeclaration] | None = None,
) -> tuple[ToolRun, RunEngine]:
    """Start a run, crash it in ``window`` with its server killed there, and resume it
    with a new owner (lease 2) over a new server on the same state."""
    env = TicketsEnvironment(tickets, tmp_path / "ledger.sqlite3", flags, declare=declare)
    run = tickets_run(tickets, env)

    def crash() -> None:
        env.kill_server()
        raise SimulatedCrash(str(window))

    if window == ADAPTER_WINDOW:
        env.next_hook = lambda stage: crash() if stage == ADAPTER_WINDOW else None
        engine = run.start()
    else:
        engine = run.start(probe=lambda seen: crash() if seen is window else None)
        if window is CrashWindow.AFTER_RECEIPT_BEFORE_STATE:
            # Receipt and state are one commit unless the environment cannot be observed
            # right after the write: only then is the receipt committed alone.
            executor = engine.executor
            assert isinstance(executor, Executor)
            executor.hooks = ObserveFailsAfterWrite(executor.hooks)
    with pytest.raises(SimulatedCrash):
        engine.propose(ticket_action(run, engine))
    resumed = run.resume(lease_version=2)
    resumed.reconcile()
    return run, resumed


@pytest.mark.parametrize(
    "flags", [SEP3182, IDEMPOTENT, PLAIN], ids=["sep3182", "idempotent-hint", "plain"]
)
@pytest.mark.parametrize("window", WRITE_WINDOWS, ids=[w.value for w in WRITE_WINDOWS])
def test_a_crash_in_each_engine_window_with_the_server_killed_is_one_effect(
    tickets: Tickets, tmp_path: Path, flags: tuple[str, ...], window: CrashWindow
) -> None:
    _, resumed = crash_run(tickets, tmp_path, flags, window)
    assert tickets.stats().effects == 1
    assert resumed.state.phase is Phase.RUNNING and resumed.state.pending is None
    output = json.loads(str(resumed.state.executed[-1].receipt.result["output"]))
    assert output == {"ticket_id": 1, "title": "crash-proof"}


@pytest.mark.parametrize(
    "flags", [SEP3182, IDEMPOTENT, ("--lookup",)], ids=["sep3182", "idempotent-hint", "lookup"]
)
def test_a_crash_after_the_tool_returned_is_one_effect_for_a_server_that_can_tell(
    tickets: Tickets, tmp_path: Path, flags: tuple[str, ...]
) -> None:
    _, resumed = crash_run(tickets, tmp_path, flags, ADAPTER_WINDOW)
    seen = tickets.stats()
    assert seen.effects == 1
    assert seen.calls == (1 if flags == ("--lookup",) else 2)  # found, or replayed by key
    assert resumed.state.phase is Phase.RUNNING and resumed.state.pending is None
    output = json.loads(str(resumed.state.executed[-1].receipt.result["output"]))
    assert output == {"ticket_id": 1, "title": "crash-proof"}


def test_a_crash_after_the_tool_returned_goes_to_review_when_the_server_cannot_tell(
    tickets: Tickets, tmp_path: Path
) -> None:
    _, resumed = crash_run(tickets, tmp_path, PLAIN, ADAPTER_WINDOW)
    assert resumed.state.phase is Phase.NEEDS_REVIEW
    assert resumed.state.review is not None
    assert resumed.state.review.reason is ReviewReason.OUTCOME_UNKNOWN
    seen = tickets.stats()
    assert seen.effects <= 1 and seen.calls == 1  # never sent a second time


#: The operator's declaration for a server that knows no keys: the key rides in the
#: ticket's body, and a lookup finds it in list_tickets' answer.
RECIPE = {"create_ticket": McpDeclaration(keys=KeyRecipe(carry="body", tool="list_tickets"))}


@pytest.mark.parametrize(
    "window",
    [*WRITE_WINDOWS, ADAPTER_WINDOW],
    ids=[*(w.value for w in WRITE_WINDOWS), "after_call"],
)
def test_a_key_recipe_recovers_a_server_that_knows_no_keys_without_a_review(
    tickets: Tickets, tmp_path: Path, window: CrashWindow | str
) -> None:
    """A plain server (no key, no lookup, no fence): cut off anywhere, the run finds the
    call by the recipe's read (the key in the ticket's body) or knows it was never made,
    and the ticket exists once, with no person asked."""
    _, resumed = crash_run(tickets, tmp_path, PLAIN, window, declare=RECIPE)
    assert tickets.stats().effects == 1
    assert resumed.state.phase is Phase.RUNNING and resumed.state.pending is None
    key = resumed.state.executed[-1].idempotency_key
    listed = tickets.connect().call_tool("list_tickets", {})
    bodies = [t["body"] for t in tool_output(listed)["tickets"]]
    assert bodies == [f"filed by a run\n\nRatchet-Key: {key}"]


def test_declarations_make_a_tool_stricter_and_loosen_only_when_told(tickets: Tickets) -> None:
    conn = tickets.connect()
    stricter = by_name(
        mcp_tools(conn, declare={"list_tickets": McpDeclaration(risk=Risk.REVERSIBLE_WRITE)})
    )
    assert stricter["list_tickets"].spec.risk is Risk.REVERSIBLE_WRITE
    read_only = {"create_ticket": McpDeclaration(risk=Risk.READ_ONLY)}
    with pytest.raises(ConfigurationError, match="loosens"):
        mcp_tools(conn, declare=read_only)
    assert by_name(mcp_tools(conn, declare=read_only, loosen=True))["create_ticket"].spec.risk is (
        Risk.READ_ONLY
    )
    with pytest.raises(ConfigurationError, match="loosens"):
        mcp_tools(conn, declare={"create_ticket": McpDeclaration(idempotent=True)})
    with pytest.raises(ConfigurationError, match="does not list"):
        mcp_tools(conn, declare={"no_such_tool": McpDeclaration()})
    bad = McpDeclaration(keys=KeyRecipe(carry="no_such_argument", tool="list_tickets"))
    with pytest.raises(ConfigurationError, match="not a string argument"):
        mcp_tools(conn, declare={"create_ticket": bad})


def test_a_declared_refusal_text_is_a_refusal_not_an_output(tickets: Tickets) -> None:
    """For a server that answers a failed write with ordinary text."""
    conn = tickets.connect()
    declared = {"create_ticket": McpDeclaration(refusal=r'"title": ?"nope"')}
    create_ticket = by_name(mcp_tools(conn, declare=declared))["create_ticket"]
    with pytest.raises(AdapterError) as refused:
        create_ticket.run(create_ticket.parse_args({"title": "nope", "body": "b"}), write_call())
    assert refused.value.retryable is False and "refused" in str(refused.value)
    made = create_ticket.run(create_ticket.parse_args({"title": "fine", "body": "b"}), write_call())
    assert made["title"] == "fine"


def test_the_old_owners_late_call_is_refused_by_the_servers_fence(
    tickets: Tickets, tmp_path: Path
) -> None:
    """The old owner passed the ledger's fence check and paused before its call; a new
    owner took over, raised its fence at the ledger and the server, found no call by
    lookup and made it. The old owner's late call reaches its own server, which refuses
    it: without the server's fence it would have been a second ticket."""
    env = TicketsEnvironment(tickets, tmp_path / "ledger.sqlite3", ("--fences", "--lookup"))
    run = tickets_run(tickets, env)
    new_owner: list[RunEngine] = []

    def paused_then_late(stage: str) -> None:
        if stage == "before_call" and not new_owner:
            resumed = run.resume(lease_version=2)
            resumed.reconcile()
            new_owner.append(resumed)

    env.next_hook = paused_then_late
    old = run.start()
    action = ticket_action(run, old)
    with pytest.raises(FenceRejectedError):
        old.propose(action)
    seen = tickets.stats()
    assert (seen.effects, seen.refused_stale, seen.calls) == (1, 1, 2)
    assert new_owner[0].state.executed[-1].idempotency_key == action.idempotency_key


# -- streamable HTTP and secrets ----------------------------------------------------------------


def test_over_streamable_http_a_ticket_is_one_effect_and_the_header_is_sent(
    tickets: Tickets, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    url = tickets.serve_http(*SEP3182, env={"TICKETS_TOKEN": HEADER_SECRET})
    headers = {"Authorization": f"Bearer {HEADER_SECRET}"}
    env = TicketsEnvironment(
        tickets,
        tmp_path / "ledger.sqlite3",
        connect=lambda: tickets.adopt(MCPConnection.http(url, headers=headers)).start(),
    )
    run = tickets_run(tickets, env)
    engine = run.start()
    assert engine.propose(ticket_action(run, engine)).outcome is TraceOutcome.EXECUTED
    assert tickets.stats().effects == 1
    refused = tickets.adopt(MCPConnection.http(url, headers={"Authorization": "Bearer wrong"}))
    with pytest.raises(AdapterError) as caught:
        refused.start()
    assert caught.value.retryable is True
    executor = engine.executor
    assert isinstance(executor, Executor)
    seen = [repr(env.current), repr(executor.adapter), str(caught.value)]
    seen += [repr(caught.value), *(r.getMessage() for r in caplog.records)]
    assert not [text for text in seen if HEADER_SECRET in text]


def test_a_secret_header_or_env_value_is_in_no_repr_error_or_log_record(
    tickets: Tickets, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    conn = tickets.connect(env={"TICKETS_API_KEY": ENV_SECRET})
    tools = mcp_tools(conn)
    create_ticket = by_name(tools)["create_ticket"]
    tickets.kill(conn, close=False)
    with pytest.raises(AdapterError) as dead:
        create(create_ticket, write_call())
    nowhere = MCPConnection.http(
        "http://127.0.0.1:9/mcp", headers={"X-Api-Key": HEADER_SECRET}, connect_timeout_s=5
    )
    with pytest.raises(AdapterError) as unreachable:
        nowhere.start()
    seen = [repr(conn), repr(nowhere), *(repr(t) for t in tools)]
    seen += [str(e.value) + repr(e.value) for e in (dead, unreachable)]
    seen += [r.getMessage() for r in caplog.records]
    assert not [text for text in seen if ENV_SECRET in text or HEADER_SECRET in text]
    assert dead.value.retryable and unreachable.value.retryable
