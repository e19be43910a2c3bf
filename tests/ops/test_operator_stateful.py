"""A Hypothesis state machine of an operator and a fleet: random operator actions (submit,
cancel, retry, rebaseline, purge, approve, review), human edits and foreign writes,
interleaved with worker jobs that die in a write's crash windows, on a real Redis with real
workspaces.

After every step: no run has a second effect of any write (each workspace's journal holds
at most one effect per key, and no more effects than the run's own writes plus the foreign
ones); no evidence is lost (every run still verifies, its executed writes and trace only
grow, and a purged run's export holds all of them). At the end, every run is driven to an
end using only the operator's commands and workers: none is left in a state no command can
leave.
"""

from __future__ import annotations

import contextlib
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)
from pydantic import SecretStr

from ratchet.adapters.workspace import WorkspaceAdapter
from ratchet.chaos.failpoints import FailpointFired
from ratchet.chaos.hooks import DrillHooks
from ratchet.demo.examples import greeting_document, make_greeting_workspace
from ratchet.errors import ContractError, EvidenceError, RatchetError
from ratchet.fleet.context import Fleet
from ratchet.fleet.settings import Settings
from ratchet.leasing import RedisStore
from ratchet.leasing.keyspace import EPOCH_KEY
from ratchet.ops import approve, cancel, inspect_run, rebaseline, retry, review, submit
from ratchet.ops.retention import purge_finished, verify_export
from ratchet.redis_server import RedisServer
from ratchet.runtime import CrashWindow, Fence, Phase, derive_idempotency_key, parse_action
from ratchet.worker.job import execute_run
from tests.conftest import test_sandbox_mode
from tests.ops.helpers import PLAN, poll, trust_file
from tests.worker.conftest import CHECKPOINT_KEY_HEX

pytestmark = pytest.mark.slow

ALICE = Ed25519PrivateKey.generate()
RITA = Ed25519PrivateKey.generate()
WINDOWS = st.sampled_from(
    [None, None, CrashWindow.AFTER_PENDING_BEFORE_ADAPTER, CrashWindow.AFTER_ADAPTER_BEFORE_RECEIPT]
)


def journal(root: Path) -> list[tuple[str, str]]:
    """The committed writes ``(key, intent digest)`` in the workspace's own journal (opening
    the adapter first settles any write a dead worker left half-done)."""
    with WorkspaceAdapter(root, ["app.py"]):
        pass
    db = sqlite3.connect(f"file:{root / '.ratchet' / 'journal.sqlite3'}?mode=ro", uri=True)
    try:
        return [
            (str(k), str(i))
            for k, i in db.execute(
                "SELECT idempotency_key, intent_digest FROM writes WHERE status = 'committed'"
            )
        ]
    finally:
        db.close()


class Run:
    def __init__(self, run_id: str, root: Path) -> None:
        self.run_id, self.root = run_id, root
        self.foreign: set[str] = set()  # keys another caller wrote under
        self.executed: tuple[str, ...] = ()
        self.trace = 0
        self.purged_to: Path | None = None


class Operations(RuleBasedStateMachine):
    runs = Bundle("runs")

    def __init__(self, fleet: Fleet, folder: Path) -> None:
        super().__init__()
        self.fleet, self.folder = fleet, folder
        self.known: dict[str, Run] = {}
        # Each example starts on an empty store (the same store: its epoch is kept), so
        # nothing an earlier example left is seen by this one.
        client = fleet.store.client
        epoch = client.get(EPOCH_KEY)
        client.flushall()
        client.set(EPOCH_KEY, epoch)

    # -- the operator -------------------------------------------------------------------------

    @rule(target=runs)
    def submit(self) -> Run:
        run_id = f"op-{uuid.uuid4().hex[:10]}"
        root = make_greeting_workspace(self.folder / run_id)
        submit(
            self.fleet,
            greeting_document(root, approval_required=("write_file",), runner="python"),
            run_id=run_id,
        )
        run = Run(run_id, root)
        self.known[run_id] = run
        self._react(run)
        return run

    @rule(target=runs)
    def submit_conflicted(self) -> Run:
        """A run whose first write's key another caller already used for another intent:
        its first job opens a review case."""
        run_id = f"op-{uuid.uuid4().hex[:10]}"
        root = make_greeting_workspace(self.folder / run_id)
        document = greeting_document(root, runner="python").model_copy(
            update={"agent": "scripted", "agent_config": {"steps": PLAN}}
        )
        run = Run(run_id, root)
        self.known[run_id] = run
        self._foreign(run, derive_idempotency_key(run_id, 0, salt="0"))
        submit(self.fleet, document, run_id=run_id)
        self._react(run)
        return run

    def _react(self, run: Run) -> None:
        """The fleet picks the run up after an operator's action (a worker's job)."""
        execute_run(self.fleet, run.run_id, owner="w")

    @rule(run=runs)
    def approve(self, run: Run) -> None:
        with contextlib.suppress(RatchetError):
            view = inspect_run(self.fleet, run.run_id)
            if view.state.phase is Phase.AWAITING_APPROVAL and view.state.pending:
                approve(
                    self.fleet,
                    run.run_id,
                    view.state.pending.action.action_id,
                    key=ALICE,
                    approver_id="alice",
                )
                self._react(run)

    @rule(run=runs)
    def cancel(self, run: Run) -> None:
        with contextlib.suppress(ContractError, RatchetError):
            cancel(self.fleet, run.run_id, reason="operator ends it", operator="olga")
            self._react(run)

    @rule(run=runs)
    def retry(self, run: Run) -> None:
        with contextlib.suppress(ContractError, RatchetError):
            retry(self.fleet, run.run_id, reason="cause fixed", operator="olga")
            self._react(run)

    @rule(run=runs)
    def rebaseline(self, run: Run) -> None:
        with contextlib.suppress(ContractError, EvidenceError, RatchetError):
            rebaseline(self.fleet, run.run_id, key=RITA, reviewer_id="rita")
            self._react(run)

    @rule(run=runs, verdict=st.sampled_from(["replan", "abort"]))
    def review(self, run: Run, verdict: str) -> None:
        with contextlib.suppress(ContractError, EvidenceError, RatchetError):
            review(self.fleet, run.run_id, verdict, key=RITA, reviewer_id="rita")
            self._react(run)

    @rule()
    def purge(self) -> None:
        report = purge_finished(self.fleet, older_than_ms=0, export_dir=self.folder / "x")
        for run_id in report.purged:
            self.known[run_id].purged_to = Path(report.exported[run_id])

    # -- the world ----------------------------------------------------------------------------

    @rule(run=runs)
    def human_edit(self, run: Run) -> None:
        app = run.root / "app.py"
        app.write_text(app.read_text() + "# edited by a person\n")

    @rule(run=runs)
    def foreign_write(self, run: Run) -> None:
        """Another caller writes under the key the run's write will use next."""
        self._foreign(run, derive_idempotency_key(run.run_id, 1, salt="0"))

    def _foreign(self, run: Run, key: str) -> None:
        if key in run.foreign:
            return
        with WorkspaceAdapter(run.root, ["app.py"]) as other:
            action = parse_action(
                {
                    "action_id": "x",
                    "kind": "write_file",
                    "risk": "reversible_write",
                    "args": {"path": "app.py", "content": "print('other')\n"},
                    "idempotency_key": key,
                    "expected_env_version": other.observe().version,
                    "deadline_at": 2**40,
                }
            )
            try:
                other.execute(
                    action,
                    action.intent_digest,
                    Fence(run_id="someone-else", lease_version=1, state_version=1),
                    None,
                )
            except RatchetError:
                return  # the run wrote under the key first: the other caller is refused
        run.foreign.add(key)

    # -- the fleet ----------------------------------------------------------------------------

    @rule(run=runs, window=WINDOWS)
    def work(self, run: Run, window: CrashWindow | None) -> None:
        def die(seen: CrashWindow) -> None:
            if seen is window:
                raise FailpointFired(seen.value)

        try:
            hooks = DrillHooks(probe=die) if window else None
            execute_run(self.fleet, run.run_id, owner="w", hooks=hooks)
        except FailpointFired:  # the worker died here, holding the lease: it expires
            poll(
                lambda: not self.fleet.store.read_run(run.run_id).lease_live,
                deadline_s=30,
                what="the dead worker's lease to expire",
            )

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def no_second_effect_and_no_evidence_lost(self) -> None:
        for run in self.known.values():
            writes = journal(run.root)
            intents = [intent for key, intent in writes if key not in run.foreign]
            assert len(intents) == len(set(intents)), f"{run.run_id}: an intent written twice"
            if run.purged_to is not None:
                summary = verify_export(self.fleet.keyring, run.purged_to.read_bytes())
                assert summary.executed >= len(run.executed)
                continue
            state = inspect_run(self.fleet, run.run_id).state  # it always verifies
            executed = tuple(e.idempotency_key for e in state.executed)
            assert executed[: len(run.executed)] == run.executed, "an executed write was lost"
            assert len(state.trace) >= run.trace, "trace events were lost"
            run.executed, run.trace = executed, len(state.trace)

    def teardown(self) -> None:
        """Every run can be ended with the operator's commands and the workers alone."""
        for run in self.known.values():
            if run.purged_to is not None:
                continue
            for _ in range(8):
                phase = inspect_run(self.fleet, run.run_id).state.phase
                if phase in (Phase.COMPLETED, Phase.FAILED, Phase.CANCELLED):
                    break
                if phase is Phase.NEEDS_REVIEW:
                    review(self.fleet, run.run_id, "abort", key=RITA, reviewer_id="rita")
                else:
                    with contextlib.suppress(ContractError):
                        cancel(self.fleet, run.run_id, reason="closing", operator="olga")
                execute_run(self.fleet, run.run_id, owner="w-final")
            state = inspect_run(self.fleet, run.run_id).state
            assert state.phase in (Phase.COMPLETED, Phase.FAILED, Phase.CANCELLED), (
                f"{run.run_id} left {state.phase.value}"
            )
            # Settled: every effect in the workspace is the run's own recorded write or a
            # foreign one; nothing was done that the run does not account for.
            recorded = {e.idempotency_key for e in state.executed} | run.foreign
            assert {key for key, _intent in journal(run.root)} <= recorded


@pytest.fixture
def operated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, Path]]:
    folder = tmp_path_factory.mktemp("operated")
    server = RedisServer(folder / "redis").start()
    RedisStore(server.client()).identity.init_epoch()
    settings = Settings(
        redis_url=SecretStr(server.url),
        state_dir=folder / "state",
        queue=f"q-{uuid.uuid4().hex[:8]}",
        lease_ttl_ms=400,
        renew_interval_ms=100,
        stall_timeout_ms=20_000,
        reaper_interval_ms=200,
        job_timeout_s=600,
        checkpoint_key=SecretStr(CHECKPOINT_KEY_HEX),
        verifier_sandbox=test_sandbox_mode(),
        approvers_file=trust_file(folder / "approvers.json", {"alice": ALICE}),
        reviewers_file=trust_file(folder / "reviewers.json", {"rita": RITA}),
    )
    try:
        yield Fleet.connect(settings), folder
    finally:
        server.kill()


def test_random_operator_actions_and_worker_deaths_keep_every_guarantee(
    operated: tuple[Fleet, Path],
) -> None:
    fleet, folder = operated
    run_state_machine_as_test(
        lambda: Operations(fleet, folder),
        settings=settings(
            max_examples=15,
            stateful_step_count=20,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
