"""Declared tools through the real engine: every crash window, replay, conflict, stale
worker and approval test the built-in kinds have, for a user's tool in each recovery
shape (lookup, idempotent, review) and in the class form that checks fences itself.

The tool's effects are counted at the refunds service (a SQLite file the tools open
anew, as a new worker process would); the run's checkpoints go through the in-memory
generation store with lease fencing.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from ratchet.adapters import WorkspaceAdapter
from ratchet.errors import ConfigurationError, FenceRejectedError
from ratchet.runtime import (
    Action,
    CrashWindow,
    Phase,
    ReviewReason,
    RunEngine,
    TraceOutcome,
)
from ratchet.testing.memory import ObserveFailsAfterWrite
from ratchet.tools import Toolbox, ToolsAdapter
from tests.adapters.harness import (
    RIGHT_GREETING,
    WRITE_WINDOWS,
    SimulatedCrash,
    crash_at,
    make_workspace,
    scenario,
)
from tests.tools.refunds import (
    Crashes,
    CrashInTool,
    RefundService,
    ToolRun,
    make_tool,
    order_status,
)

RECOVERIES = ["lookup", "idempotent", "review", "fenced"]
PERMITTED = ["read_file", "write_file", "run_verifier", "finish", "create_refund", "order_status"]


@dataclass
class Setup:
    run: ToolRun
    service: RefundService
    hook: Crashes
    adapters: list[ToolsAdapter]


def _setup(tmp_path: Path, recovery: str, **scenario_overrides: Any) -> Setup:
    service = RefundService(tmp_path / "refunds.sqlite")
    box = Toolbox([make_tool(service, recovery), order_status])
    hook = Crashes()
    adapters: list[ToolsAdapter] = []
    sc = scenario(permissions=PERMITTED, **scenario_overrides)

    def open_adapter() -> Any:
        adapter = box.environment(sc, ledger=tmp_path / "ledger.sqlite", hook=hook, clock=run.clock)
        if isinstance(adapter, ToolsAdapter):
            adapters.append(adapter)
        return adapter

    run = ToolRun(
        open_adapter=open_adapter,
        effects=lambda: service.effects,
        scenario=sc,
        catalog=box.catalog,
    )
    return Setup(run, service, hook, adapters)


@pytest.fixture(params=RECOVERIES)
def setup(request: pytest.FixtureRequest, tmp_path: Path) -> Setup:
    return _setup(tmp_path, request.param)


def recovery_of(s: Setup) -> str:
    return s.run.catalog["create_refund"].recovery.value


def test_one_refund_commits_a_receipt_with_the_tools_output(setup: Setup) -> None:
    engine = setup.run.start()
    result = engine.propose(setup.run.refund(engine))
    assert result.outcome is TraceOutcome.EXECUTED
    assert setup.service.effects == 1
    receipt = engine.state.executed[-1].receipt
    assert receipt.result["tool"] == "create_refund"
    assert '"order_id":"o-1"' in str(receipt.result["output"])
    assert engine.state.environment.version == 2  # the ledger moved on by one


@pytest.mark.parametrize("window", WRITE_WINDOWS)
def test_a_crash_in_each_engine_window_leaves_exactly_one_refund(
    setup: Setup, window: CrashWindow
) -> None:
    engine = setup.run.start(probe=crash_at(window))
    if window is CrashWindow.AFTER_RECEIPT_BEFORE_STATE:
        engine.executor.hooks = ObserveFailsAfterWrite(engine.executor.hooks)
    with pytest.raises(SimulatedCrash):
        engine.propose(setup.run.refund(engine))

    resumed = setup.run.resume(lease_version=2)
    assert resumed.reconcile().window is window
    assert setup.service.effects == 1
    assert resumed.state.phase is Phase.RUNNING and resumed.state.pending is None
    assert resumed.state.executed[-1].receipt.result["tool"] == "create_refund"
    # The run goes on: the next refund (the next key) is its own effect.
    assert resumed.propose(setup.run.refund(resumed, order_id="o-2")).outcome is (
        TraceOutcome.EXECUTED
    )
    assert setup.service.effects == 2


def test_a_crash_inside_the_call_is_recovered_as_the_tool_declares(setup: Setup) -> None:
    """The tool returned but the ledger never recorded it: only the tool's own means
    (a lookup, a key the service dedupes) can settle it; without them, review."""
    engine = setup.run.start()
    setup.hook.stage = "after_call"
    with pytest.raises(CrashInTool):
        engine.propose(setup.run.refund(engine))
    assert setup.service.effects == 1

    resumed = setup.run.resume(lease_version=2)
    resumed.reconcile()
    if recovery_of(setup) == "review":
        assert resumed.state.phase is Phase.NEEDS_REVIEW
        case = resumed.state.review
        assert case is not None and case.reason is ReviewReason.OUTCOME_UNKNOWN
        assert case.pending.action.kind == "create_refund"  # the intent is the evidence
        assert setup.service.calls == 1  # never called again
    elif recovery_of(setup) == "idempotent":
        # Called again with the same key: the service's dedupe answers, no new refund.
        assert resumed.state.phase is Phase.RUNNING and resumed.state.pending is None
        assert setup.service.calls == 2
    else:
        assert resumed.state.phase is Phase.RUNNING and resumed.state.pending is None
        assert resumed.state.trace[-1].outcome is TraceOutcome.RECONCILED
        assert setup.service.calls == 1
    assert setup.service.effects == 1


def test_a_crash_before_the_call_is_sent_once_or_reviewed(setup: Setup) -> None:
    """The ledger row was written, the tool never called: a lookup or a deduping key
    shows nothing happened; a tool with neither cannot show it and goes to review."""
    engine = setup.run.start()
    setup.hook.stage = "before_call"
    with pytest.raises(CrashInTool):
        engine.propose(setup.run.refund(engine))
    assert setup.service.calls == 0

    resumed = setup.run.resume(lease_version=2)
    resumed.reconcile()
    if recovery_of(setup) == "review":
        assert resumed.state.phase is Phase.NEEDS_REVIEW
        assert setup.service.effects == 0
    else:
        assert resumed.state.phase is Phase.RUNNING and resumed.state.pending is None
        assert setup.service.effects == 1


def test_the_same_key_and_intent_again_is_a_replay_without_a_second_refund(setup: Setup) -> None:
    engine = setup.run.start()
    first = setup.run.refund(engine, key="refund-1")
    engine.propose(first)
    again = setup.run.refund(engine, key="refund-1")
    result = engine.propose(again)
    assert result.outcome is TraceOutcome.REPLAYED
    assert setup.service.effects == 1 and setup.service.calls == 1


def test_the_same_key_with_another_intent_is_rejected_and_sends_nothing(setup: Setup) -> None:
    engine = setup.run.start()
    engine.propose(setup.run.refund(engine, key="refund-1"))
    result = engine.propose(setup.run.refund(engine, key="refund-1", amount=999))
    assert result.outcome is TraceOutcome.REJECTED_KEY_CONFLICT
    assert setup.service.calls == 1


def test_a_key_the_ledger_holds_for_another_intent_opens_a_review(setup: Setup) -> None:
    """The run's cache does not know the key (another run of the same environment used
    it): the ledger reports the conflict with its receipt, and a reviewer decides."""
    first = setup.run.start()
    first.propose(setup.run.refund(first, key="shared-key"))
    setup.run.run_id = "run-2"
    setup.run.store.checkpoints.clear()
    second = setup.run.start()
    result = second.propose(setup.run.refund(second, key="shared-key", amount=999))
    assert result.phase is Phase.NEEDS_REVIEW
    case = second.state.review
    assert case is not None and case.reason is ReviewReason.INTENT_CONFLICT
    assert case.receipt is not None and case.receipt.idempotency_key == "shared-key"
    assert setup.service.calls == 1


def test_a_stale_owners_late_call_is_refused_and_refunds_once(setup: Setup) -> None:
    new_owner: list[RunEngine] = []

    def paused_then_late(window: CrashWindow) -> None:
        if window is CrashWindow.AFTER_PENDING_BEFORE_ADAPTER and not new_owner:
            resumed = setup.run.resume(lease_version=2)
            resumed.reconcile()
            new_owner.append(resumed)

    old = setup.run.start(probe=paused_then_late)
    with pytest.raises(FenceRejectedError):
        old.propose(setup.run.refund(old))
    assert setup.service.effects == 1
    assert new_owner[0].state.executed[-1].receipt.result["tool"] == "create_refund"
    ledger_refused = sum(a.ledger.counters()[1] for a in setup.adapters)
    assert ledger_refused >= 1
    if recovery_of(setup) == "lookup" and setup.run.catalog["create_refund"].checks_fences:
        assert setup.service.refused == 0  # the ledger refused it before the service saw it


def test_a_fence_checking_tool_refuses_a_stale_call_that_passed_the_ledger(tmp_path: Path) -> None:
    """The difference the docs state: the ledger is checked before the call; a call
    already past it when the new owner takes over is refused by the service itself."""
    s = _setup(tmp_path, "fenced")
    engine = s.run.start()
    action = s.run.refund(engine)

    def take_over(stage: str) -> None:
        if stage == "before_call":
            s.hook.stage = None
            other = s.run.resume(lease_version=2)  # raises the fence at ledger and service
            other.reconcile()

    s.hook.seen.clear()
    adapter = s.adapters[-1]
    adapter._hook = take_over
    with pytest.raises(FenceRejectedError):
        engine.propose(action)
    assert s.service.refused >= 1
    assert s.service.effects == 1  # only the new owner's


def test_a_read_only_tool_reads_without_a_ledger_row(setup: Setup) -> None:
    engine = setup.run.start()
    action = Action.model_validate(
        {
            "action_id": "a-read",
            "kind": "order_status",
            "risk": "read_only",
            "args": {"order_id": "o-1"},
            "expected_env_version": engine.state.environment.version,
            "deadline_at": setup.run.clock.now() + 600,
        }
    )
    result = engine.propose(action)
    assert result.outcome is TraceOutcome.READ
    assert result.read is not None and '"status":"delivered"' in result.read.content
    assert engine.state.environment.version == 1


@pytest.mark.parametrize(
    ("args", "risk", "why"),
    [
        ({"order_id": "o-1"}, "irreversible_external_write", "amount_cents"),
        ({"order_id": "o-1", "amount_cents": "5"}, "irreversible_external_write", "amount_cents"),
        (
            {"order_id": "o-1", "amount_cents": 5, "extra": 1},
            "irreversible_external_write",
            "extra",
        ),
        ({"order_id": "o-1", "amount_cents": 5}, "reversible_write", "risk"),
        ({"order_id": "o-1", "amount_cents": True}, "irreversible_external_write", "amount_cents"),
        ({"order_id": "o-1", "amount_cents": 0}, "irreversible_external_write", "amount_cents"),
        ({"order_id": "", "amount_cents": 5}, "irreversible_external_write", "order_id"),
    ],
)
def test_a_call_that_breaks_the_tools_contract_is_rejected_before_anything_is_sent(
    tmp_path: Path, args: dict[str, Any], risk: str, why: str
) -> None:
    s = _setup(tmp_path, "lookup")
    engine = s.run.start()
    data = {**s.run.refund(engine).model_dump(mode="json"), "args": args, "risk": risk}
    result = engine.propose(Action.model_validate(data))
    assert result.outcome is TraceOutcome.REJECTED_SCHEMA
    assert why in (engine.state.trace[-1].detail.get("reason") or str(engine.state.trace[-1]))
    assert s.service.calls == 0 and engine.state.pending is None


def test_a_tool_not_permitted_by_the_scenario_is_rejected(tmp_path: Path) -> None:
    s = _setup(tmp_path, "lookup")
    s.run.scenario = scenario(permissions=["finish"])
    engine = s.run.start()
    assert engine.propose(s.run.refund(engine)).outcome is TraceOutcome.REJECTED_PERMISSION
    assert s.service.calls == 0


def test_an_approved_refund_runs_once_and_its_receipt_binds_the_approval(tmp_path: Path) -> None:
    s = _setup(tmp_path, "lookup", approval_required=["create_refund"])
    engine = s.run.start()
    action = s.run.refund(engine)
    assert engine.propose(action).phase is Phase.AWAITING_APPROVAL
    assert s.service.calls == 0
    result = engine.refresh_pending_approval(s.run.approve(engine, action))
    assert result.outcome is TraceOutcome.EXECUTED
    receipt = engine.state.executed[-1].receipt
    assert receipt.approval_digest is not None and s.service.effects == 1


def test_a_tool_that_requires_approval_refuses_a_scenario_that_does_not_ask(tmp_path: Path) -> None:
    service = RefundService(tmp_path / "r.sqlite")
    strict = make_tool(service, "review")
    strict.requires_approval = True  # type: ignore[misc]
    strict.__dict__.pop("_spec", None)
    box = Toolbox([strict])
    with pytest.raises(ConfigurationError, match="requires approval"):
        box.environment(scenario(permissions=["create_refund", "finish"]), ledger=tmp_path / "l")


def test_a_scenario_permitting_a_tool_the_worker_lacks_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="no tool for"):
        Toolbox().environment(scenario(permissions=["create_refund"]), ledger=tmp_path / "l")


def test_a_changed_tool_contract_is_a_changed_environment(tmp_path: Path) -> None:
    s = _setup(tmp_path, "lookup")
    engine = s.run.start()
    engine.propose(s.run.refund(engine))
    # The same ledger with the tool now declared idempotent (another recovery).
    other = Toolbox([make_tool(s.service, "idempotent"), order_status])
    before = s.adapters[-1].observe()
    after = other.environment(s.run.scenario, ledger=tmp_path / "ledger.sqlite").observe()
    assert before.instance_id == after.instance_id and before.version == after.version
    assert before.fingerprint != after.fingerprint


def test_tools_beside_a_workspace_fix_a_file_refund_and_finish(tmp_path: Path) -> None:
    root = make_workspace(tmp_path / "ws")
    service = RefundService(tmp_path / "refunds.sqlite")
    box = Toolbox([make_tool(service, "idempotent")])
    sc = scenario(
        permissions=["read_file", "write_file", "run_verifier", "finish", "create_refund"]
    )

    def open_adapter() -> Any:
        files = WorkspaceAdapter(root, sc.allowed_paths)
        return box.environment(sc, ledger=tmp_path / "ledger.sqlite", files=files)

    run = ToolRun(
        open_adapter=open_adapter, effects=lambda: service.effects, scenario=sc, catalog=box.catalog
    )
    engine = run.start(probe=crash_at(CrashWindow.AFTER_ADAPTER_BEFORE_RECEIPT))
    with pytest.raises(SimulatedCrash):
        engine.propose(run.refund(engine))
    resumed = run.resume(lease_version=2)
    assert resumed.reconcile().window is CrashWindow.AFTER_ADAPTER_BEFORE_RECEIPT
    assert resumed.propose(run.write(resumed, RIGHT_GREETING)).outcome is TraceOutcome.EXECUTED
    assert resumed.state.phase is Phase.RUNNING and resumed.state.environment.version == 4
    assert service.effects == 1
    assert (root / "app.py").read_text() == RIGHT_GREETING
    details = resumed.state.environment.details
    assert "tools.fingerprint" in details and "files.instance_id" in details


def test_a_tools_own_failure_reaches_no_error_or_log_with_its_message(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A tool's exception message may quote a secret (a token in a URL): only its type is
    reported, and the call's outcome is left to recovery (the ledger row stays started)."""
    from ratchet import tool
    from ratchet.errors import AdapterError

    @tool(risk="irreversible_external_write", name="create_refund")
    def leaky(order_id: str, amount_cents: int) -> dict[str, str]:
        raise RuntimeError("POST https://user:sk-live-SECRET@pay.example/refunds failed")

    box = Toolbox([leaky])
    sc = scenario(permissions=["finish", "create_refund"])
    adapter = box.environment(sc, ledger=tmp_path / "ledger.sqlite")
    run = ToolRun(open_adapter=lambda: adapter, effects=lambda: 0, scenario=sc, catalog=box.catalog)
    engine = run.start()
    caplog.set_level("DEBUG")
    with pytest.raises(AdapterError) as caught:
        engine.propose(run.refund(engine))
    assert caught.value.retryable is True
    assert "RuntimeError" in str(caught.value)
    assert "SECRET" not in str(caught.value) and "SECRET" not in repr(caught.value)
    assert "SECRET" not in caplog.text
    assert isinstance(adapter, ToolsAdapter)
    row = adapter.ledger.row(engine.state.pending.action.idempotency_key or "")  # type: ignore[union-attr]
    assert row is not None and row.status == "started"


def test_a_refund_committed_after_its_approval_expired_sends_the_run_to_review(
    tmp_path: Path,
) -> None:
    """The receipt's commit time (the ledger's clock: the store's, in a worker) is checked
    against the approval's expiry, exactly as for the built-in kinds."""
    s = _setup(tmp_path, "lookup", approval_required=["create_refund"])
    engine = s.run.start()
    action = s.run.refund(engine)

    def slow_call(stage: str) -> None:
        if stage == "before_call":
            s.run.clock.advance(120)  # the call outlives the approval

    s.adapters[-1]._hook = slow_call
    engine.propose(action, approval=s.run.approve(engine, action, ttl=60))
    assert engine.state.phase is Phase.NEEDS_REVIEW
    assert engine.state.review is not None
    assert engine.state.review.reason is ReviewReason.APPROVAL_UNBOUND
    assert s.service.effects == 1


def test_a_lookup_that_finds_the_key_under_another_intent_opens_a_review(
    tmp_path: Path,
) -> None:
    """A tool that knows which intent its earlier call had says so (``Found``): a key
    found under another intent is a conflict for a reviewer, never this call's receipt."""
    from ratchet.tools import Found

    s = _setup(tmp_path, "fenced")
    tool = s.run.catalog["create_refund"]
    assert tool.recovery.value == "lookup"
    other_intent = "0" * 64
    service = s.service

    def found_elsewhere(key: str) -> Found | None:
        hit = service.find(key)
        return None if hit is None else Found(hit, intent_digest=other_intent)

    engine = s.run.start()
    s.hook.stage = "after_call"
    with pytest.raises(CrashInTool):
        engine.propose(s.run.refund(engine))
    resumed = s.run.resume(lease_version=2)
    adapter = s.adapters[-1]
    adapter.tool("create_refund").lookup = found_elsewhere  # type: ignore[method-assign]
    resumed.reconcile()
    assert resumed.state.phase is Phase.NEEDS_REVIEW
    case = resumed.state.review
    assert case is not None and case.reason is ReviewReason.INTENT_CONFLICT
    assert case.receipt is not None and case.receipt.intent_digest == other_intent
    assert s.service.effects == 1


def test_arguments_that_are_not_plain_reach_the_tool_as_their_types(tmp_path: Path) -> None:
    """A list argument goes through the model (not the plain path) and reaches the tool
    as the model parsed it; its JSON Schema is what a model is shown."""
    from ratchet import tool

    seen: list[object] = []

    @tool(risk="irreversible_external_write", name="create_refund", idempotent=True)
    def tagged(order_id: str, tags: list[str]) -> dict[str, str]:
        seen.append(tags)
        return {"order_id": order_id}

    assert not tagged.spec.plain_args
    assert tagged.spec.json_schema["properties"]["tags"]["type"] == "array"
    box = Toolbox([tagged])
    sc = scenario(permissions=["finish", "create_refund"])
    adapter = box.environment(sc, ledger=tmp_path / "ledger")
    run = ToolRun(open_adapter=lambda: adapter, effects=lambda: 0, scenario=sc, catalog=box.catalog)
    engine = run.start()
    data = {**run.refund(engine).model_dump(mode="json"), "args": {"order_id": "o", "tags": ["a"]}}
    assert engine.propose(Action.model_validate(data)).outcome is TraceOutcome.EXECUTED
    assert seen == [["a"]]
    bad = {
        **data,
        "action_id": "a-bad",
        "idempotency_key": "k-bad",
        "args": {"order_id": "o", "tags": [1]},
    }
    bad["expected_env_version"] = engine.state.environment.version
    assert engine.propose(Action.model_validate(bad)).outcome is TraceOutcome.REJECTED_SCHEMA


def test_a_tool_whose_arguments_admit_floats_is_refused_at_declaration() -> None:
    from ratchet import tool

    with pytest.raises(ConfigurationError, match="admit floats"):

        @tool(risk="irreversible_external_write")
        def priced(order_id: str, amount: Decimal) -> None:  # JSON Schema: number or string
            """A Decimal is shown to a model as a number: use int cents or a string."""


def test_an_output_past_the_receipt_bound_is_kept_as_a_prefix_and_its_digest() -> None:
    import hashlib

    from ratchet.runtime.canonical import Domain
    from ratchet.tools import output_result
    from ratchet.tools.adapter import MAX_OUTPUT_CHARS

    small = output_result("t", {"ok": 1})
    assert small == {"tool": "t", "output": '{"ok":1}'}
    big = output_result("t", {"blob": "x" * MAX_OUTPUT_CHARS})
    whole = '{"blob":"' + "x" * MAX_OUTPUT_CHARS + '"}'
    assert big["output"] == whole[:MAX_OUTPUT_CHARS] and big["output_truncated"] == 1
    expected = hashlib.sha256(Domain.TOOL_OUTPUT + b"\x00" + whole.encode()).hexdigest()
    assert big["output_sha256"] == expected


def test_a_check_holds_its_expected_values_and_the_texts_it_must_contain() -> None:
    from ratchet.fleet.runs import ToolCheckSpec
    from ratchet.tools.adapter import ToolCheck

    prose = ToolCheck(tool="t", arguments={}, expect={}, contains=("Message: fix",))
    assert prose.holds("Commit history:\nMessage: fix\n")
    assert not prose.holds("Commit history:\nMessage: other\n")
    assert prose.holds({"log": ["Message: fix"]})  # in the output's canonical JSON
    both = ToolCheck(tool="t", arguments={}, expect={"status": "ok"}, contains=("a-1",))
    assert both.holds({"status": "ok", "id": "a-1"})
    assert not both.holds({"status": "ok", "id": "a-2"})
    assert not both.holds({"status": "no", "id": "a-1"})
    with pytest.raises(ValueError, match="expect, contains, or both"):
        ToolCheckSpec(tool="t")
    assert "contains" not in ToolCheckSpec(tool="t", expect={"a": 1}).model_dump(mode="json")


def test_a_lookup_that_takes_the_call_is_told_the_recorded_call(tmp_path: Path) -> None:
    """``lookup(key, call)``: recovery hands it the tool, the arguments as proposed and
    the intent digest the key was committed with (one-argument lookups keep working:
    every other lookup test here)."""
    from ratchet.tools import RecordedCall

    s = _setup(tmp_path, "lookup")
    service = s.service
    told: list[RecordedCall] = []

    def find_by_call(key: str, call: RecordedCall) -> dict[str, Any] | None:
        told.append(call)
        return service.find(key)

    engine = s.run.start()
    s.hook.stage = "after_call"
    action = s.run.refund(engine)
    with pytest.raises(CrashInTool):
        engine.propose(action)
    resumed = s.run.resume(lease_version=2)
    s.adapters[-1].tool("create_refund").lookup(find_by_call)  # registered as the lookup
    resumed.reconcile()
    assert resumed.state.phase is Phase.RUNNING and resumed.state.pending is None
    assert told == [RecordedCall("create_refund", action.args, action.intent_digest)]
    assert s.service.effects == 1
