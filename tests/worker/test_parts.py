"""Worker parts on their own: settings rules, agents, heartbeat guards, the reaper."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from ratchet.agents import (
    AgentPolicy,
    AgentView,
    GreetingAgent,
    ScriptedAgent,
    load_agent,
)
from ratchet.errors import ConfigurationError, LeaseLostError, StoreUnavailableError
from ratchet.fleet.context import Fleet
from ratchet.fleet.runs import RunDocument
from ratchet.fleet.settings import Settings
from ratchet.ops import submit
from ratchet.runtime import Action, Advance, Fence, Observation, Phase, RunKey, TraceOutcome
from ratchet.runtime.effects import Commit, Execute, Lookup, Observe, RaiseFence, Verify
from ratchet.runtime.ports import Release
from ratchet.runtime.state import Usage
from ratchet.worker.executor import Executor
from ratchet.worker.heartbeat import Heartbeat
from ratchet.worker.reaper import reap_once


def _action() -> Action:
    return Action.model_validate(
        {
            "action_id": "a-1",
            "kind": "write_file",
            "risk": "reversible_write",
            "args": {"path": "app.py", "content": "x"},
            "idempotency_key": "k",
            "expected_env_version": 0,
            "deadline_at": 10**12,
        }
    )


def poll(predicate: Callable[[], bool], deadline_s: float = 10.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.005)
    raise AssertionError("condition not reached before the deadline")


# --- settings -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        {"lease_ttl_ms": 1000, "renew_interval_ms": 1000},
        {"lease_ttl_ms": 1000, "renew_interval_ms": 300, "stall_timeout_ms": 300},
        {"lease_ttl_ms": 60_000, "job_timeout_s": 60},
        {"lease_ttl_ms": 10},
        # Waiting for replicas as long as a lease lasts would outlive the lease.
        {"lease_ttl_ms": 1000, "min_replicas_ack": 1, "replicas_ack_timeout_ms": 1000},
        {"min_replicas_ack": -1},
    ],
)
def test_settings_refuse_timings_that_would_undermine_the_lease(bad: dict[str, int]) -> None:
    with pytest.raises(ValidationError):
        Settings(**bad)  # type: ignore[arg-type]


def test_settings_default_the_renew_interval_to_a_third_of_the_ttl_and_hide_secrets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RATCHET_LEASE_TTL_MS", "9000")
    monkeypatch.setenv("RATCHET_REDIS_URL", "redis://:hunter2-secret@example.invalid:6379/0")
    monkeypatch.setenv("RATCHET_CHECKPOINT_KEY", "ab" * 32)
    settings = Settings()
    assert settings.renew_interval == 3000
    text = repr(settings) + str(settings)
    assert "hunter2" not in text and "ab" * 32 not in text


# --- agents ---------------------------------------------------------------------------------


def view(**kw: Any) -> AgentView:
    base: dict[str, Any] = {
        "run_id": "r-1",
        "phase": Phase.RUNNING,
        "observation": Observation(instance_id="ws", version=3, fingerprint="0" * 64),
        "plan_cursor": 0,
        "usage": Usage(),
        "last_outcome": TraceOutcome.STARTED,
        "quarantined_keys": (),
        "agent_state": {},
        "now": 1000,
    }
    base.update(kw)
    return AgentView(**base)


def test_the_scripted_agent_plays_its_plan_with_stable_keys() -> None:
    agent = ScriptedAgent(
        [
            {"kind": "write_file", "args": {"path": "a", "content": "x"}},
            {"kind": "finish", "args": {"summary": "done"}},
        ]
    )
    first = agent.next_step(view())
    again = agent.next_step(view())
    assert first is not None and again is not None
    assert first.action["idempotency_key"] == again.action["idempotency_key"]
    assert first.action["expected_env_version"] == 3
    replanned = agent.next_step(view(quarantined_keys=(first.action["idempotency_key"],)))
    assert replanned is not None
    assert replanned.action["idempotency_key"] != first.action["idempotency_key"]
    done = agent.next_step(view(plan_cursor=1))
    assert done is not None and done.action["idempotency_key"] is None
    assert agent.next_step(view(plan_cursor=2)) is None


def test_the_greeting_agent_proposes_the_same_fix_after_a_crash() -> None:
    agent = GreetingAgent()
    read = agent.next_step(view())
    assert read is not None and read.action["kind"] == "read_file"
    write = agent.next_step(view(last_read='print("Hello, wrold")\n'))
    assert write is not None and write.action["args"]["content"] == 'print("Hello, world")\n'
    resumed = agent.next_step(view(agent_state=write.agent_state))  # no read after resume
    assert resumed is not None and resumed.action == {
        **write.action,
        "action_id": resumed.action["action_id"],
    }


def test_agents_load_by_name_and_dotted_path_and_refuse_anything_else() -> None:
    allowed = AgentPolicy(prefixes=("ratchet.agents",))
    assert isinstance(load_agent("greeting"), GreetingAgent)
    assert isinstance(
        load_agent("ratchet.agents:GreetingAgent.from_config", policy=allowed), GreetingAgent
    )
    for bad in ("nope", "no.such.module:factory", "ratchet.agents:missing"):
        with pytest.raises(ConfigurationError):
            load_agent(bad, policy=allowed)
    with pytest.raises(ConfigurationError):
        load_agent("greeting", {"think_ms": True})


# --- heartbeat ------------------------------------------------------------------------------


def test_a_refused_renewal_loses_the_lease_and_stops_commits() -> None:
    calls = []

    def renew() -> int:
        calls.append(1)
        raise LeaseLostError("taken over", run_id="r")

    beat = Heartbeat(
        renew, run_id="r", interval_ms=10, stall_timeout_ms=5000, lease_ttl_ms=60_000
    ).start()
    try:
        poll(lambda: beat.lost)
        assert beat.reason is not None and "LeaseLostError" in beat.reason
        committed: list[object] = []
        adapter_calls: list[str] = []

        class Store:
            def commit_batch(self, *a: object, **k: object) -> None:
                committed.append(1)

        class Adapter:
            def __getattr__(self, name: str) -> Any:
                return lambda *a, **k: adapter_calls.append(name)

        executor = Executor(Adapter(), Store(), guard=beat)  # type: ignore[arg-type]
        key = RunKey("t", "r", "e")
        fence = Fence(run_id="r", lease_version=1, state_version=1)
        refused = [
            Commit(key, (Advance(expected_generation=1, blob=b""),)),
            Execute(_action(), "0" * 64, fence, None),
            RaiseFence(fence),
            Verify("unit"),
        ]
        for effect in refused:
            with pytest.raises(LeaseLostError):
                executor.perform(effect)
        assert committed == [] and adapter_calls == []
        # Reading is still allowed: a lost lease needs no guard to observe or look up.
        executor.perform(Observe())
        executor.perform(Lookup("k"))
        assert adapter_calls == ["observe", "lookup"]
    finally:
        beat.stop()


def test_an_unknown_renewal_outcome_counts_as_lost() -> None:
    def renew() -> int:
        raise StoreUnavailableError("no reply")

    beat = Heartbeat(
        renew, run_id="r", interval_ms=10, stall_timeout_ms=5000, lease_ttl_ms=60_000
    ).start()
    try:
        poll(lambda: beat.lost)
    finally:
        beat.stop()


def test_a_stalled_executor_stops_renewing() -> None:
    renewals = []
    beat = Heartbeat(
        lambda: renewals.append(1) or 0,
        run_id="r",
        interval_ms=10,
        stall_timeout_ms=60,
        lease_ttl_ms=60_000,
    ).start()
    try:
        poll(lambda: beat.lost)
        assert beat.reason == "executor stalled; renewal withheld"
        count = len(renewals)
        time.sleep(0.05)  # nothing to synchronise with: we check that nothing happens
        assert len(renewals) == count
    finally:
        beat.stop()


def test_a_renewal_that_never_lands_in_time_is_lost_by_the_local_clock() -> None:
    release = threading.Event()
    now = [0.0]

    def renew() -> int:
        release.wait(5)  # a renewal stuck in flight
        return 0

    beat = Heartbeat(
        renew,
        run_id="r",
        interval_ms=10,
        stall_timeout_ms=60_000,
        lease_ttl_ms=1000,
        monotonic=lambda: now[0],
    ).start()
    try:
        assert not beat.lost
        now[0] = 1.5  # past the TTL with no confirmed renewal
        assert beat.lost
    finally:
        release.set()
        beat.stop()


# --- reaper ---------------------------------------------------------------------------------


def test_the_reaper_re_enqueues_an_expired_run_exactly_once_across_racing_workers(
    fleet: Fleet, workspace: Callable[..., tuple[Path, RunDocument]]
) -> None:
    _, document = workspace()
    run_id = submit(fleet, document)
    lease = fleet.store.acquire(run_id, owner="dead-worker", ttl_ms=50)
    assert lease is not None
    poll(lambda: not fleet.store.read_run(run_id).lease_live)
    enqueued: list[str] = []
    lock = threading.Lock()

    def enqueue(rid: str) -> None:
        with lock:
            enqueued.append(rid)

    barrier = threading.Barrier(4)

    def reaper() -> None:
        barrier.wait(5)
        reap_once(fleet.store, enqueue, limit=10_000)

    threads = [threading.Thread(target=reaper) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert enqueued.count(run_id) == 1
    reap_once(fleet.store, enqueue, limit=10_000)
    assert enqueued.count(run_id) == 1  # off the index now


def test_the_reaper_leaves_live_and_waiting_runs_alone(
    fleet: Fleet, workspace: Callable[..., tuple[Path, RunDocument]]
) -> None:
    _, document = workspace()
    live = submit(fleet, document)
    fleet.store.acquire(live, owner="busy-worker", ttl_ms=60_000)
    _, other = workspace()
    waiting = submit(fleet, other)
    held = fleet.store.acquire(waiting, owner="w", ttl_ms=60_000)
    assert held is not None
    held.release()  # released off the index, as a waiting run is
    enqueued: list[str] = []
    reap_once(fleet.store, enqueued.append, limit=10_000)
    assert live not in enqueued and waiting not in enqueued


def test_a_run_whose_job_was_lost_before_any_worker_took_it_is_re_enqueued(
    settings: Settings, workspace: Callable[..., tuple[Path, RunDocument]]
) -> None:
    fleet = Fleet.connect(settings.model_copy(update={"pickup_timeout_ms": 100}))
    _, document = workspace()
    run_id = submit(fleet, document)
    for queue in fleet.served_queues():
        queue.empty()  # the job is gone (a worker popped it and died, or Redis lost it)
    enqueued: list[str] = []

    def reaped() -> bool:
        reap_once(fleet.store, enqueued.append, limit=10_000)
        return run_id in enqueued

    poll(reaped)
    assert enqueued.count(run_id) == 1


def test_the_executor_passes_a_single_commits_deadline_and_phase_through() -> None:
    """A single commit with an approval deadline (or a phase) must reach the store whole:
    sent through a call without them it lost both, so Redis never enforced the deadline
    for workers."""
    sent: list[list[Advance]] = []
    releases: list[Release | None] = []

    class Store:
        def commit_batch(
            self, key: object, commits: list[Advance], *, release: Release | None = None
        ) -> None:
            sent.append(list(commits))
            releases.append(release)

    beat = Heartbeat(
        lambda: 0, run_id="r", interval_ms=10_000, stall_timeout_ms=50_000, lease_ttl_ms=60_000
    )
    executor = Executor(None, Store(), guard=beat, measure=True)  # type: ignore[arg-type]
    commit = Advance(1, b"blob", (), b"", 123_456, "awaiting_approval")
    executor.perform(Commit(RunKey("t", "r", "e"), (commit,)))
    assert sent == [[commit]] and releases == [None]
    # A release travels with its commit to the store, as data.
    executor.perform(Commit(RunKey("t", "r", "e"), (commit,), Release(reap=True)))
    assert releases == [None, Release(reap=True)]
