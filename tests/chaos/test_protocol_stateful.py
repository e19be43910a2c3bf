"""The whole protocol as a Hypothesis state machine: three simulated workers share one run
on a real Redis and one workspace (a separate adapter handle each, as separate processes
would have), acquire and lose leases, crash in every window, go stale and try again.
After every step the drill's invariants hold: one effect per intent, the high-water mark
never goes back, no acknowledged checkpoint is lost, no restore below an earlier lease's
ack, no stale commit or write accepted, a terminal run stays terminal."""

from __future__ import annotations

import hashlib
import secrets
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from ratchet.adapters import CommandVerifier, WorkspaceAdapter
from ratchet.adapters.sandbox import Sandbox
from ratchet.adapters.workspace import SystemClock
from ratchet.agents import ScriptedAgent
from ratchet.chaos.drill.services import NOTE, _scenario, make_workspace, plan
from ratchet.errors import (
    AdapterError,
    CheckpointError,
    FenceRejectedError,
    LeaseLostError,
    StoreError,
)
from ratchet.leasing import LeasedRun, RedisStore, run_keys
from ratchet.redis_server import RedisServer
from ratchet.runtime import CrashWindow, Effect, Hooks, KeyRing, Phase, RunEngine
from ratchet.runtime.effects import Commit
from ratchet.runtime.state import TERMINAL_PHASES
from ratchet.worker.executor import Executor, WindowProbe
from ratchet.worker.jobprotocol import agent_view
from tests.conftest import test_sandbox_mode

TTL_MS = 400
WORKERS = 3
# The drill plan without the order (no HTTP service here): read, write, write, verify,
# finish.
STEPS = [s for s in plan(0) if s["kind"] != "external_call"]


class Crash(Exception):
    """The simulated worker died here."""


class Acks(Hooks):
    """Executor hooks that record every commit the worker saw succeed."""

    def __init__(self, lease_version: int, log: list[tuple[int, int, str]]) -> None:
        self.lease_version = lease_version
        self.log = log  # (lease version, generation, digest)

    def around(self, effect: Effect, proceed: Callable[[], Any]) -> Any:
        result = proceed()
        if isinstance(effect, Commit):
            for commit in effect.batch:
                self.log.append(
                    (
                        self.lease_version,
                        commit.expected_generation + 1,
                        hashlib.sha256(commit.blob).hexdigest(),
                    )
                )
        return result


@dataclass
class Worker:
    name: str
    adapter: WorkspaceAdapter
    lease: LeasedRun | None = None
    engine: RunEngine | None = None
    crash: CrashWindow | None = None  # where the next step dies
    stale_attempts: int = 0

    def probe(self, window: CrashWindow) -> None:
        if window is self.crash:
            raise Crash(window.value)


@dataclass
class World:
    server: RedisServer
    keyring: KeyRing = field(
        default_factory=lambda: KeyRing.from_secrets(
            {"k": secrets.token_bytes(32)}, signing_kid="k"
        )
    )


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield World(server)
    finally:
        server.kill()


class Protocol(RuleBasedStateMachine):
    world: World

    def __init__(self) -> None:
        super().__init__()
        self.folder = Path(tempfile.mkdtemp(prefix="ratchet-stateful-"))
        root = make_workspace(self.folder / "ws")
        self.store = RedisStore(self.world.server.client())
        self.scenario = _scenario(0)
        grep = shutil.which("grep", path="/usr/bin:/bin") or "grep"
        verifier = CommandVerifier(
            {"check": [grep, "-qx", "run 0: done", NOTE]},
            sandbox=Sandbox.resolve(test_sandbox_mode()),
        )
        self.workers = [
            Worker(f"w{i}", WorkspaceAdapter(root, [NOTE], verifier=verifier))
            for i in range(WORKERS)
        ]
        self.run_id = f"st-{secrets.token_hex(6)}"
        RunEngine.start(
            self.run_id,
            scenario=self.scenario,
            keyring=self.world.keyring,
            executor=Executor(self.workers[0].adapter, self.store.creator(b"{}")),
            clock=SystemClock(),
        )
        self.journal = root / ".ratchet" / "journal.sqlite3"
        self.agent = ScriptedAgent(STEPS)
        self.acks: list[tuple[int, int, str]] = []
        self.restores: list[tuple[int, int]] = []  # (lease version, generation)
        self.high_water = 1
        self.terminal_at: int | None = None

    def teardown(self) -> None:
        for worker in self.workers:
            worker.adapter.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    # -- rules ------------------------------------------------------------------------

    @rule(k=st.integers(0, WORKERS - 1), coalesce=st.booleans(), archive=st.booleans())
    def acquire(self, k: int, coalesce: bool, archive: bool) -> None:
        worker = self.workers[k]
        lease = self.store.acquire(self.run_id, owner=worker.name, ttl_ms=TTL_MS)
        if lease is None:
            return
        snap = self.store.read_run(self.run_id, with_checkpoint=True)
        assert snap.checkpoint is not None
        worker.crash = None  # a new incarnation: the crash point of the one that died is gone
        try:
            engine = RunEngine.resume(
                snap.checkpoint,
                scenario=self.scenario,
                keyring=self.world.keyring,
                executor=Executor(
                    worker.adapter,
                    lease,
                    hooks=WindowProbe(worker.probe, Acks(lease.lease_version, self.acks)),
                ),
                clock=SystemClock(),
                lease_version=lease.lease_version,
                coalesce=coalesce,
                archive=snap.archive,
                archive_trace=archive,
            )
            self.restores.append((lease.lease_version, engine.generation))
            engine.reconcile()
        except (LeaseLostError, StoreError, FenceRejectedError, CheckpointError):
            return  # lost it again before restoring: nothing ran
        worker.lease, worker.engine = lease, engine

    @rule(k=st.integers(0, WORKERS - 1), crash=st.sampled_from([None, *CrashWindow]))
    def step(self, k: int, crash: CrashWindow | None) -> None:
        worker = self.workers[k]
        engine, lease = worker.engine, worker.lease
        if engine is None or lease is None or engine.state.phase is not Phase.RUNNING:
            return
        stale = not self.store.read_run(self.run_id).is_held_by(worker.name, lease.lease_version)
        worker.crash = crash
        step = self.agent.next_step(agent_view(engine, None))
        if step is None:
            return
        before = len(self.acks)
        try:
            engine.propose(step.action, agent_state=step.agent_state)
        except Crash:
            worker.engine = None  # died there; its lease expires
            return
        except (LeaseLostError, FenceRejectedError, StoreError, AdapterError):
            worker.engine = None
            if stale:
                worker.stale_attempts += 1
            return
        if stale:
            # A worker whose lease was gone got a commit through: never allowed.
            assert len(self.acks) == before, "a stale commit was accepted"

    @rule()
    def let_the_lease_expire(self) -> None:
        deadline = time.monotonic() + 5
        while self.store.read_run(self.run_id).lease_live:
            assert time.monotonic() < deadline, "the lease never expired"
            time.sleep(0.02)

    # -- invariants -------------------------------------------------------------------

    @invariant()
    def one_effect_per_intent(self) -> None:
        db = sqlite3.connect(f"file:{self.journal}?mode=ro", uri=True)
        try:
            rows = db.execute(
                "SELECT intent_digest, count(*) FROM writes "
                "WHERE status = 'committed' GROUP BY intent_digest"
            ).fetchall()
        finally:
            db.close()
        assert all(n == 1 for _, n in rows), rows

    @invariant()
    def acknowledged_checkpoints_stay(self) -> None:
        snap = self.store.read_run(self.run_id)
        assert snap.generation >= self.high_water, "the high-water mark went back"
        self.high_water = snap.generation
        history = {
            int(e.split(b"|")[0]): e.split(b"|")[5].decode()
            for e in self.store.client.lrange(run_keys(self.run_id).history, 0, -1)
        }
        for _, generation, digest in self.acks:
            assert history.get(generation, digest) == digest, "an acked checkpoint was lost"

    @invariant()
    def no_restore_below_an_earlier_leases_ack(self) -> None:
        for version, generation in self.restores:
            assert all(g <= generation for v, g, _ in self.acks if v < version)

    @invariant()
    def no_stale_commit_in_the_history(self) -> None:
        versions = [
            int(e.split(b"|")[2])
            for e in self.store.client.lrange(run_keys(self.run_id).history, 0, -1)
        ]
        assert versions == sorted(versions, reverse=True), versions

    @invariant()
    def terminal_stays_terminal(self) -> None:
        phases = [w.engine.state.phase for w in self.workers if w.engine is not None]
        generation = self.store.read_run(self.run_id).generation
        if any(p in TERMINAL_PHASES for p in phases) and self.terminal_at is None:
            self.terminal_at = generation
        if self.terminal_at is not None:
            assert generation == self.terminal_at, "a terminal run committed again"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_protocol_keeps_its_invariants_under_crashes_pauses_and_takeovers(world: World) -> None:
    Protocol.world = world
    run_state_machine_as_test(
        Protocol,
        settings=settings(
            max_examples=12,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
