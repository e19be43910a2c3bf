"""The run's archive in Redis: segments are appended by the same script that stores the
checkpoint, never twice and never by a stale lease; read_run returns them with the
checkpoint in one step (real server, fakeredis[lua] and the env server)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from ratchet.errors import ContractError, LeaseLostError
from ratchet.leasing import LeasedRun, RedisStore, run_keys
from ratchet.runtime import KeyRing, Observation, RunEngine, Scenario, TraceOutcome
from ratchet.runtime import window as window_module
from ratchet.runtime.ports import Advance, RunKey
from ratchet.runtime.window import restore_tail
from ratchet.testing.memory import MemoryWorkspace
from ratchet.worker.executor import Executor
from tests.leasing.conftest import lose_first_reply
from tests.runtime.world import RIGHT_GREETING, scenario_data

MakeRun = Callable[..., RunKey]
Expire = Callable[[RedisStore, str], None]


def _archive(store: RedisStore, run_id: str) -> list[bytes]:
    return list(store.client.lrange(run_keys(run_id).archive, 0, -1))


def test_segments_are_appended_with_their_commits_and_read_back_in_order(
    store: RedisStore, new_run_id: Callable[[], str]
) -> None:
    run_id = new_run_id()
    store.create_run(
        run_id,
        task_id="t",
        env_instance_id="e",
        scenario=b"s",
        checkpoint=b"g1",
        archive_segment=b"s1",
    )
    run = store.acquire(run_id, owner="w1", ttl_ms=60_000)
    assert run is not None
    key = RunKey("t", run_id, "e")
    run.commit_batch(key, [Advance(expected_generation=1, blob=b"g2", segment=b"s2")])
    run.commit_batch(key, [Advance(expected_generation=2, blob=b"g3")])  # nothing new to archive
    run.commit_batch(
        key, [Advance(3, b"g4", segment=b"s4"), Advance(4, b"g5"), Advance(5, b"g6", segment=b"s6")]
    )
    snap = store.read_run(run_id, with_checkpoint=True)
    assert (snap.generation, snap.checkpoint) == (6, b"g6")
    assert snap.archive == (b"s1", b"s2", b"s4", b"s6")
    assert store.read_run(run_id).archive == ()  # only with the checkpoint
    stored = run.load(key)
    assert (stored.blob, stored.archive) == (b"g6", (b"s1", b"s2", b"s4", b"s6"))


def _keys(store: RedisStore, run_id: str) -> bytes | None:
    found: bytes | None = store.client.get(run_keys(run_id).keys)
    return found


def test_key_digests_are_appended_with_their_segments_and_read_with_the_archive_tail(
    store: RedisStore, make_run: MakeRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = make_run()
    run = store.acquire(key.run_id, owner="w1", ttl_ms=60_000)
    assert run is not None
    run.commit_batch(
        key,
        [
            Advance(1, b"g2", segment=b"s2", keys=b"AAAAAAAA"),
            Advance(2, b"g3", segment=b"s3"),
            Advance(3, b"g4", segment=b"s4", keys=b"BBBBBBBBCCCCCCCC"),
        ],
    )
    assert _keys(store, key.run_id) == b"AAAAAAAABBBBBBBBCCCCCCCC"
    tail = store.read_run(key.run_id, with_checkpoint=True, archive_tail=2)
    assert (tail.archive, tail.archive_from, tail.keys) == (
        (b"s3", b"s4"),
        1,
        _keys(store, key.run_id),
    )
    whole = store.read_run(key.run_id, with_checkpoint=True, archive_tail=10)
    assert (whole.archive, whole.archive_from) == ((b"s2", b"s3", b"s4"), 0)
    plain = store.read_run(key.run_id, with_checkpoint=True)
    assert (plain.archive_from, plain.keys) == (0, None)  # the whole archive, no digests
    # The restore's high-water check is answered by the tail read itself; a load (what a
    # recall reads) always hands out the whole archive, so it reads again.
    reads: list[dict[str, object]] = []
    real = store.read_run

    def counted(run_id: str, **options: Any) -> Any:
        reads.append(options)
        return real(run_id, **options)

    monkeypatch.setattr(store, "read_run", counted)
    run.read(archive_tail=1)
    assert run.high_water(key) == 4 and len(reads) == 1
    assert run.load(key).archive == (b"s2", b"s3", b"s4")
    assert len(reads) == 2 and not reads[1].get("archive_tail")
    with pytest.raises(ContractError):
        store.prepare_commit(key.run_id, generation=5, checkpoint=b"g5", keys=b"short")
    with pytest.raises(ContractError):
        store.read_run(key.run_id, with_checkpoint=True, archive_tail=-1)


def test_a_retried_commit_appends_its_segment_once(store: RedisStore, make_run: MakeRun) -> None:
    key = make_run()
    run = store.acquire(key.run_id, owner="w1", ttl_ms=60_000)
    assert run is not None
    dropped = lose_first_reply(store)
    run.commit_batch(
        key,
        [Advance(1, b"g2", segment=b"a", keys=b"11111111"), Advance(2, b"g3", segment=b"b")],
    )
    store.reply_hook = None
    assert dropped and _archive(store, key.run_id) == [b"a", b"b"]
    assert _keys(store, key.run_id) == b"11111111"


def test_a_stale_lease_appends_nothing(
    store: RedisStore, make_run: MakeRun, expire: Expire
) -> None:
    key = make_run()
    old = store.acquire(key.run_id, owner="w1", ttl_ms=150)
    assert old is not None
    expire(store, key.run_id)
    assert store.acquire(key.run_id, owner="w2", ttl_ms=60_000) is not None
    for attempt in (
        lambda: old.commit_batch(key, [Advance(expected_generation=1, blob=b"x", segment=b"z")]),
        lambda: old.commit_batch(key, [Advance(1, b"x", segment=b"z", keys=b"kkkkkkkk")]),
    ):
        try:
            attempt()
        except LeaseLostError:
            pass
        else:
            raise AssertionError("a stale lease committed")
    assert _archive(store, key.run_id) == []
    assert _keys(store, key.run_id) is None


class _Clock:
    def now(self) -> int:
        return int(time.time())


class _ArchivedRun:
    """An archived run created on Redis over an in-memory workspace, resumed under new
    leases as a worker's job would."""

    def __init__(self, store: RedisStore, run_id: str) -> None:
        self.store, self.run_id, self.clock = store, run_id, _Clock()
        self.scenario = Scenario.model_validate(scenario_data(approval_required=[]))
        self.keyring = KeyRing.from_secrets(
            {"k": b"archive-on-redis-key-0123456789abcdef"}, signing_kid="k"
        )
        self.adapter = MemoryWorkspace(
            "ws-redis",
            self.scenario.initial_files,
            clock=self.clock,
            expectations={"unit": self.scenario.verifier.expected_files},
        )
        RunEngine.start(
            run_id,
            scenario=self.scenario,
            keyring=self.keyring,
            executor=Executor(self.adapter, store.creator(b"scenario")),
            clock=self.clock,
            archive_trace=True,
        )

    def resume(self, owner: str, *, tail: int = 0) -> tuple[RunEngine, LeasedRun]:
        """Take the lease and restore (the whole archive, or with ``tail`` its last
        segments and the key digests)."""
        lease = self.store.acquire(self.run_id, owner=owner, ttl_ms=60_000)
        assert lease is not None
        snap = lease.read(archive_tail=tail)
        assert snap.checkpoint is not None
        engine = RunEngine.resume(
            snap.checkpoint,
            archive=snap.archive,
            archive_from=snap.archive_from,
            keys=snap.keys,
            scenario=self.scenario,
            keyring=self.keyring,
            executor=Executor(self.adapter, lease),
            clock=self.clock,
            lease_version=lease.lease_version,
            coalesce=True,
        )
        return engine, lease

    def propose(
        self, engine: RunEngine, kind: str, args: dict[str, str], key: str | None = None
    ) -> TraceOutcome:
        risk = {
            "write_file": "reversible_write",
            "run_verifier": "verification",
            "finish": "control",
        }[kind]
        action = {
            "action_id": f"a-{engine.state.next_seq}",
            "kind": kind,
            "risk": risk,
            "args": args,
            "idempotency_key": key,
            "expected_env_version": engine.state.environment.version,
            "deadline_at": int(time.time()) + 600,
        }
        return engine.propose(action).outcome


def test_an_archived_engine_runs_and_restores_on_redis(
    store: RedisStore, new_run_id: Callable[[], str]
) -> None:
    run = _ArchivedRun(store, new_run_id())
    first, lease = run.resume("w1")
    for n in range(3):
        run.propose(first, "write_file", {"path": "app.py", "content": f"print({n})\n"}, f"k{n}")
    run.propose(first, "write_file", {"path": "app.py", "content": RIGHT_GREETING}, "fix")
    first.flush()
    before = first.state
    store.release(lease)
    second, _ = run.resume("w2")
    assert second.state == before
    run.propose(second, "run_verifier", {"target": "unit"})
    run.propose(second, "finish", {"summary": "done"})
    assert second.state.phase.value == "completed"
    assert len(store.read_run(run.run_id, with_checkpoint=True).archive) == second.generation
    assert isinstance(second.state.environment, Observation)


def test_a_long_run_restores_its_window_from_the_archive_tail_on_redis(
    store: RedisStore, new_run_id: Callable[[], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run whose window moved restores from the last segments and the key digests (one
    read), recalls an old key through the store, and never writes a key twice."""
    monkeypatch.setattr(window_module, "WINDOW_SEGMENTS", 2)
    run = _ArchivedRun(store, new_run_id())

    def write(engine: RunEngine, n: int, key: str) -> TraceOutcome:
        return run.propose(
            engine, "write_file", {"path": "app.py", "content": f"print({n})\n"}, key
        )

    first, lease = run.resume("w0")
    for n in range(12):
        assert write(first, n, f"k{n}") is TraceOutcome.EXECUTED
    first.flush()
    before = first.state
    assert before.executed_base > 0
    store.release(lease)
    tail = store.read_run(run.run_id, with_checkpoint=True, archive_tail=restore_tail())
    assert tail.archive_from > 0  # the restore below reads only the archive's last segments
    second, _ = run.resume("w1", tail=restore_tail())
    assert second.state == before and second.state.executed_base == before.executed_base
    writes = run.adapter.write_count
    assert write(second, 0, "k0") is TraceOutcome.REPLAYED  # recalled from the archive
    assert write(second, 5, "k1") is TraceOutcome.REJECTED_KEY_CONFLICT
    assert run.adapter.write_count == writes
    second.flush()
    assert len(_keys(store, run.run_id) or b"") == 8 * 12
