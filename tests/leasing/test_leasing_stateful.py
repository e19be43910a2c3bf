"""A Hypothesis state machine of three simulated workers against a real server.

Workers acquire, renew, commit, release and crash; time passes through short TTLs (the
``let_the_lease_expire`` rule polls Redis until the lease reads as expired). After every
step: at most one worker holds the live lease, the generation grew by exactly one per
accepted commit, and no commit was accepted from a stale lease version.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from ratchet.errors import GenerationMismatchError, LeaseLostError, StaleStateError
from ratchet.leasing import LeasedRun, LeaseHolder, RedisStore, run_keys
from ratchet.runtime.ports import RunKey

TTL_MS = 40
WORKERS = 3
workers = st.integers(min_value=0, max_value=WORKERS - 1)


@dataclass
class Worker:
    name: str
    handle: LeasedRun | None = None


class LeaseMachine(RuleBasedStateMachine):
    def __init__(self, store: RedisStore) -> None:
        super().__init__()
        self.store = store
        self.run_id = f"sm-{uuid.uuid4().hex[:16]}"
        store.create_run(
            self.run_id, task_id="t", env_instance_id="e", scenario=b"s", checkpoint=b"g1"
        )
        self.workers = [Worker(f"w{i}") for i in range(WORKERS)]
        self.generation = 1  # the model: 1 + accepted commits
        self.granted_version = 0  # the highest lease version ever granted
        self.accepted: list[tuple[int, int]] = []  # (generation, lease version)

    @rule(i=workers)
    def acquire(self, i: int) -> None:
        worker = self.workers[i]
        outcome = self.store.try_acquire(self.run_id, owner=worker.name, ttl_ms=TTL_MS)
        if isinstance(outcome, LeaseHolder):
            assert outcome.owner != worker.name
            assert outcome.lease_version == self.granted_version
            assert outcome.now_ms < outcome.expires_at_ms
            return
        # The rule: max(the last version + 1, the store's time in ms).
        assert outcome.lease_version == max(self.granted_version + 1, outcome.lease.now_ms)
        assert outcome.previous[1] == self.granted_version
        assert outcome.generation == self.generation
        self.granted_version = outcome.lease_version
        worker.handle = outcome

    @rule(i=workers)
    def renew(self, i: int) -> None:
        worker = self.workers[i]
        if worker.handle is None:
            return
        try:
            worker.handle.renew()
        except LeaseLostError:
            worker.handle = None
            return
        assert worker.handle.lease_version == self.granted_version

    @rule(i=workers, payload=st.binary(min_size=1, max_size=64))
    def commit(self, i: int, payload: bytes) -> None:
        worker = self.workers[i]
        if worker.handle is None:
            return
        stale = worker.handle.lease_version != self.granted_version
        try:
            result = worker.handle.commit(payload)
        except LeaseLostError:
            worker.handle = None
            return
        except (GenerationMismatchError, StaleStateError):
            assert worker.handle.generation != self.generation
            return
        assert not stale, "a commit was accepted from a stale lease version"
        assert result.generation == self.generation + 1
        self.generation = result.generation
        self.accepted.append((result.generation, worker.handle.lease_version))

    @rule(i=workers)
    def refresh(self, i: int) -> None:
        """A worker re-reads the run after a refusal, as the engine does."""
        worker = self.workers[i]
        if worker.handle is None:
            return
        try:
            worker.handle.high_water(RunKey("t", self.run_id, "e"))
        except LeaseLostError:
            worker.handle = None

    @rule(i=workers)
    def release(self, i: int) -> None:
        worker = self.workers[i]
        if worker.handle is None:
            return
        with contextlib.suppress(LeaseLostError):
            worker.handle.release()
        worker.handle = None

    @rule(i=workers)
    def crash(self, i: int) -> None:
        self.workers[i].handle = None  # dies holding the lease; it expires on its own

    @rule()
    def let_the_lease_expire(self) -> None:
        deadline = time.monotonic() + 5
        while self.store.read_run(self.run_id).lease_live:
            assert time.monotonic() < deadline, "lease did not expire"
            time.sleep(0.002)

    @invariant()
    def at_most_one_live_owner(self) -> None:
        snap = self.store.read_run(self.run_id)
        holders = [
            w
            for w in self.workers
            if w.handle is not None and snap.is_held_by(w.name, w.handle.lease_version)
        ]
        assert len(holders) <= 1
        current = [
            w
            for w in self.workers
            if w.handle is not None and w.handle.lease_version == snap.lease_version
        ]
        assert len(current) <= 1
        assert snap.lease_version == self.granted_version

    @invariant()
    def generation_grows_by_one_per_accepted_commit(self) -> None:
        snap = self.store.read_run(self.run_id)
        assert snap.generation == snap.state_version == 1 + len(self.accepted)
        assert snap.generation == self.generation
        entries = self.store.client.lrange(run_keys(self.run_id).history, 0, -1)
        recorded = [(int(e.split(b"|")[0]), int(e.split(b"|")[2])) for e in entries]
        expected = list(reversed(self.accepted))[: len(recorded) - 1]
        assert recorded[: len(expected)] == expected


def test_leases_and_commits_keep_their_invariants_under_random_worker_schedules(
    real_redis_url: str,
) -> None:
    store = RedisStore.from_url(real_redis_url)
    try:
        run_state_machine_as_test(
            lambda: LeaseMachine(store),
            settings=settings(
                max_examples=60,
                stateful_step_count=40,
                deadline=None,
                database=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
    finally:
        store.client.close()
