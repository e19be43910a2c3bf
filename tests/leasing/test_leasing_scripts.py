"""The script suite: every script's protocol, on a real server, fakeredis[lua], and the
server at RATCHET_TEST_REDIS_URL when set (the ``redis_client`` fixture parametrises it)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from ratchet.errors import (
    CheckpointTooLargeError,
    ConfigurationError,
    ContractError,
    GenerationMismatchError,
    HighWaterUnavailableError,
    LeaseHeldElsewhereError,
    LeaseLostError,
    NonceReplayError,
    RunExistsError,
    RunNotFoundError,
    StaleStateError,
)
from ratchet.leasing import RedisStore, run_keys
from ratchet.runtime.ports import Advance, GenerationStore, RunKey
from tests.leasing.conftest import commit_one

MakeRun = Callable[..., RunKey]
Expire = Callable[[RedisStore, str], None]


def test_create_run_stores_scenario_and_first_checkpoint_at_generation_one(
    store: RedisStore, make_run: MakeRun
) -> None:
    key = make_run(checkpoint=b"first", scenario=b"the-task")
    snap = store.read_run(key.run_id, with_checkpoint=True, with_scenario=True)
    assert (snap.generation, snap.state_version) == (1, 1)
    assert (snap.checkpoint, snap.scenario) == (b"first", b"the-task")
    assert (snap.task_id, snap.env_instance_id) == (key.task_id, key.env_instance_id)
    assert snap.owner is None and snap.lease_version == 0 and not snap.lease_live
    assert key.run_id in store.run_ids(limit=100_000)


def test_create_run_refuses_an_existing_run_id(store: RedisStore, make_run: MakeRun) -> None:
    key = make_run()
    with pytest.raises(RunExistsError) as err:
        store.create_run(
            key.run_id, task_id="x", env_instance_id="y", scenario=b"s", checkpoint=b"other"
        )
    assert err.value.run_id == key.run_id and err.value.generation == 1
    assert store.read_run(key.run_id, with_checkpoint=True).checkpoint == b"ckpt-1"


def test_create_run_retried_with_the_same_commit_id_reports_already_applied(
    store: RedisStore, new_run_id: Callable[[], str]
) -> None:
    run_id = new_run_id()
    args: dict[str, Any] = dict(
        task_id="t", env_instance_id="e", scenario=b"s", checkpoint=b"c1", commit_id="create-1"
    )
    first = store.create_run(run_id, **args)
    again = store.create_run(run_id, **args)
    assert not first.already_applied and again.already_applied
    assert again.created_at_ms == first.created_at_ms


def test_acquire_on_a_free_run_grants_the_store_time_as_lease_version_with_redis_time_expiry(
    store: RedisStore, make_run: MakeRun
) -> None:
    # A never-leased run's version is 0, so max(0 + 1, now_ms) is the store's time.
    key = make_run()
    run = store.acquire(key.run_id, owner="w1", ttl_ms=60_000)
    assert run is not None
    assert run.lease_version == run.lease.now_ms
    assert run.generation == 1 and run.state_version == 1
    assert run.previous == ("", 0) and not run.took_over
    assert run.lease.expires_at_ms == run.lease.now_ms + 60_000
    snap = store.read_run(key.run_id)
    assert snap.is_held_by("w1", run.lease_version)


def test_acquire_while_another_worker_holds_the_lease_returns_none(
    store: RedisStore, make_run: MakeRun
) -> None:
    key = make_run()
    held = store.acquire(key.run_id, owner="w1", ttl_ms=60_000)
    assert held is not None
    assert store.acquire(key.run_id, owner="w2", ttl_ms=60_000) is None
    with pytest.raises(LeaseHeldElsewhereError) as err:
        store.acquire_or_raise(key.run_id, owner="w2", ttl_ms=60_000)
    assert err.value.owner == "w1" and err.value.lease_version == held.lease_version
    assert err.value.expires_at_ms == held.lease.expires_at_ms


def test_acquire_of_an_unknown_run_raises_run_not_found(
    store: RedisStore, new_run_id: Callable[[], str]
) -> None:
    with pytest.raises(RunNotFoundError):
        store.acquire(new_run_id(), owner="w1", ttl_ms=1000)


def test_the_same_owner_reacquiring_gets_a_new_version_that_fences_its_old_one(
    store: RedisStore, make_run: MakeRun
) -> None:
    key = make_run()
    old = store.acquire(key.run_id, owner="w1", ttl_ms=60_000)
    new = store.acquire(key.run_id, owner="w1", ttl_ms=60_000)
    assert old is not None and new is not None and new.lease_version > old.lease_version
    assert new.previous == ("w1", old.lease_version)
    with pytest.raises(LeaseLostError):
        old.commit(b"late")
    new.commit(b"ok")


def test_expired_lease_is_taken_over_with_a_higher_version_and_the_late_owner_is_fenced(
    store: RedisStore, make_run: MakeRun, expire: Expire
) -> None:
    key = make_run()
    first = store.acquire(key.run_id, owner="w1", ttl_ms=50)
    assert first is not None
    expire(store, key.run_id)
    with pytest.raises(LeaseLostError) as renew_err:
        first.renew()
    assert renew_err.value.reason == "lease_expired"
    second = store.acquire(key.run_id, owner="w2", ttl_ms=60_000)
    assert second is not None and second.lease_version > first.lease_version
    assert not first.took_over and second.took_over  # free at first, then expired
    assert second.previous == ("w1", first.lease_version)  # the lease it took over
    with pytest.raises(LeaseLostError) as late:
        first.commit(b"late")
    assert late.value.current_owner == "w2"
    assert late.value.current_lease_version == second.lease_version
    with pytest.raises(LeaseLostError):
        first.renew()
    with pytest.raises(LeaseLostError):
        first.release()
    snap = store.read_run(key.run_id, with_checkpoint=True)
    assert snap.generation == 1 and snap.checkpoint == b"ckpt-1"
    second.commit(b"second")
    assert store.read_run(key.run_id).generation == 2
    # A live lease re-acquired by its own owner (a higher version) is no takeover.
    again = store.acquire(key.run_id, owner="w2", ttl_ms=60_000)
    assert again is not None and not again.took_over
    assert again.lease_version > second.lease_version


def test_commit_after_expiry_is_refused_even_before_anyone_takes_over(
    store: RedisStore, make_run: MakeRun, expire: Expire
) -> None:
    key = make_run()
    run = store.acquire(key.run_id, owner="w1", ttl_ms=50)
    assert run is not None
    expire(store, key.run_id)
    with pytest.raises(LeaseLostError) as err:
        run.commit(b"late")
    assert err.value.reason == "lease_expired"
    assert store.read_run(key.run_id).generation == 1


def test_renew_extends_the_expiry_from_redis_now(store: RedisStore, make_run: MakeRun) -> None:
    key = make_run()
    run = store.acquire(key.run_id, owner="w1", ttl_ms=1_000)
    assert run is not None
    renewed = run.renew(120_000)
    assert renewed.expires_at_ms == renewed.now_ms + 120_000
    assert store.read_run(key.run_id).expires_at_ms == renewed.expires_at_ms


def test_a_worker_clock_hours_off_changes_nothing(
    store: RedisStore, make_run: MakeRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = make_run()
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 6 * 3600)
    run = store.acquire(key.run_id, owner="w1", ttl_ms=60_000)
    assert run is not None
    assert store.acquire(key.run_id, owner="w2", ttl_ms=60_000) is None
    run.commit(b"g2")
    lease = run.renew()
    assert lease.expires_at_ms - lease.now_ms == 60_000
    monkeypatch.setattr(time, "time", lambda: real_time() - 6 * 3600)
    assert store.acquire(key.run_id, owner="w2", ttl_ms=60_000) is None
    assert store.read_run(key.run_id).is_held_by("w1", run.lease_version)


def test_release_frees_the_lease_but_keeps_its_version_growing(
    store: RedisStore, make_run: MakeRun
) -> None:
    key = make_run()
    run = store.acquire(key.run_id, owner="w1", ttl_ms=60_000)
    assert run is not None
    released = run.release()
    assert released.lease_version == run.lease_version
    assert not store.read_run(key.run_id).lease_live
    with pytest.raises(LeaseLostError):
        run.commit(b"after-release")
    nxt = store.acquire(key.run_id, owner="w2", ttl_ms=60_000)
    assert nxt is not None and nxt.lease_version > run.lease_version
    assert nxt.previous == ("", run.lease_version) and not nxt.took_over  # free, not expired


def test_commit_advances_generation_and_state_version_together_with_the_content(
    store: RedisStore, make_run: MakeRun
) -> None:
    key = make_run()
    run = store.acquire(key.run_id, owner="w1", ttl_ms=60_000)
    assert run is not None
    for gen in range(2, 6):
        result = run.commit(f"ckpt-{gen}".encode())
        assert (result.generation, result.state_version) == (gen, gen)
        snap = store.read_run(key.run_id, with_checkpoint=True)
        assert (snap.generation, snap.state_version, snap.checkpoint) == (
            gen,
            gen,
            f"ckpt-{gen}".encode(),
        )
    assert run.fence.lease_version == run.lease_version and run.fence.state_version == 5


def test_commit_of_a_generation_other_than_high_water_plus_one_is_refused(
    store: RedisStore, make_run: MakeRun
) -> None:
    key = make_run()
    run = store.acquire(key.run_id, owner="w1", ttl_ms=60_000)
    assert run is not None
    for wrong in (3, 7):
        with pytest.raises(GenerationMismatchError) as err:
            run.commit(b"x", generation=wrong)
        assert err.value.high_water == 1
    with pytest.raises(GenerationMismatchError):
        run.commit_batch(key, [Advance(expected_generation=2, blob=b"x")])
    with pytest.raises(ContractError):
        run.commit(b"x", generation=1)
    assert store.read_run(key.run_id, with_checkpoint=True).checkpoint == b"ckpt-1"


def test_commit_with_a_stale_expected_state_version_is_refused(
    store: RedisStore, make_run: MakeRun
) -> None:
    key = make_run()
    run = store.acquire(key.run_id, owner="w1", ttl_ms=60_000)
    assert run is not None
    with pytest.raises(StaleStateError) as err:
        commit_one(store, run.lease, generation=2, expected_state_version=7, checkpoint=b"x")
    assert err.value.state_version == 1 and err.value.expected_state_version == 7
    assert store.read_run(key.run_id).generation == 1


def test_commit_retried_with_the_same_commit_id_is_reported_applied_once(
    store: RedisStore, make_run: MakeRun
) -> None:
    key = make_run()
    run = store.acquire(key.run_id, owner="w1", ttl_ms=60_000)
    assert run is not None
    first = commit_one(
        store,
        run.lease,
        generation=2,
        expected_state_version=1,
        checkpoint=b"g2",
        commit_id="c-retry",
    )
    again = commit_one(
        store,
        run.lease,
        generation=2,
        expected_state_version=1,
        checkpoint=b"g2",
        commit_id="c-retry",
    )
    assert not first.already_applied and again.already_applied
    assert again.generation == 2 and again.current_generation == 2
    history = store.client.lrange(run_keys(key.run_id).history, 0, -1)
    assert len(history) == 2  # creation + one commit


def test_a_commit_id_reused_for_another_checkpoint_is_a_contract_error(
    store: RedisStore, make_run: MakeRun
) -> None:
    key = make_run()
    run = store.acquire(key.run_id, owner="w1", ttl_ms=60_000)
    assert run is not None
    run.commit(b"g2", commit_id="c-1")
    with pytest.raises(ContractError):
        run.commit(b"g3", commit_id="c-1")
    assert store.read_run(key.run_id).generation == 2


def test_history_stays_bounded_and_forgets_old_commit_ids_with_it(
    redis_client: Any, new_run_id: Callable[[], str]
) -> None:
    store = RedisStore(redis_client, history_limit=3)
    run_id = new_run_id()
    store.create_run(run_id, task_id="t", env_instance_id="e", scenario=b"s", checkpoint=b"c")
    run = store.acquire(run_id, owner="w1", ttl_ms=60_000)
    assert run is not None
    for gen in range(2, 10):
        run.commit(b"g%d" % gen, commit_id=f"c-{gen}")
    keys = run_keys(run_id)
    entries = [e.decode() for e in redis_client.lrange(keys.history, 0, -1)]
    assert [e.split("|")[0] for e in entries] == ["9", "8", "7"]
    assert sorted(k.decode() for k in redis_client.hkeys(keys.commits)) == ["c-7", "c-8", "c-9"]


def test_a_nonce_is_consumed_once_per_run_atomically_with_its_commit(
    store: RedisStore, make_run: MakeRun, new_run_id: Callable[[], str]
) -> None:
    nonce = f"approval-{new_run_id()}"
    key = make_run()
    run = store.acquire(key.run_id, owner="w1", ttl_ms=60_000)
    assert run is not None
    run.commit_batch(key, [Advance(expected_generation=1, blob=b"g2", nonces=[nonce])])
    with pytest.raises(NonceReplayError) as err:
        run.commit_batch(key, [Advance(expected_generation=2, blob=b"g3", nonces=[nonce])])
    assert err.value.nonce == nonce
    assert store.read_run(key.run_id).generation == 2
    assert store.nonce_claimed_by(nonce) == key.run_id


def test_a_nonce_consumed_by_one_run_is_refused_on_another_run(
    store: RedisStore, make_run: MakeRun, new_run_id: Callable[[], str]
) -> None:
    nonce = f"n-{new_run_id()}"
    a, b = make_run(), make_run()
    run_a = store.acquire(a.run_id, owner="w1", ttl_ms=60_000)
    run_b = store.acquire(b.run_id, owner="w2", ttl_ms=60_000)
    assert run_a is not None and run_b is not None
    run_a.commit_batch(a, [Advance(expected_generation=1, blob=b"a2", nonces=[nonce])])
    with pytest.raises(NonceReplayError) as err:
        run_b.commit_batch(b, [Advance(expected_generation=1, blob=b"b2", nonces=[nonce])])
    assert err.value.claimed_by == a.run_id
    assert store.read_run(b.run_id).generation == 1


def test_a_nonce_claimed_by_a_refused_commit_stays_usable_by_the_same_run_only(
    store: RedisStore, make_run: MakeRun, new_run_id: Callable[[], str]
) -> None:
    nonce = f"n-{new_run_id()}"
    key, other = make_run(), make_run()
    run = store.acquire(key.run_id, owner="w1", ttl_ms=60_000)
    assert run is not None
    with pytest.raises(GenerationMismatchError):
        run.commit(b"x", generation=5, nonces=[nonce])
    run.commit(b"g2", nonces=[nonce])
    with pytest.raises(NonceReplayError):
        store.claim_nonces(other.run_id, [nonce])


def test_a_checkpoint_over_the_cap_is_refused_before_it_reaches_redis(
    redis_client: Any, new_run_id: Callable[[], str]
) -> None:
    store = RedisStore(redis_client, max_checkpoint_bytes=1024)
    run_id = new_run_id()
    with pytest.raises(CheckpointTooLargeError):
        store.create_run(
            run_id, task_id="t", env_instance_id="e", scenario=b"s", checkpoint=b"x" * 1025
        )
    assert not redis_client.exists(run_keys(run_id).state)
    store.create_run(
        run_id, task_id="t", env_instance_id="e", scenario=b"s", checkpoint=b"x" * 1024
    )
    run = store.acquire(run_id, owner="w1", ttl_ms=60_000)
    assert run is not None
    with pytest.raises(CheckpointTooLargeError) as err:
        run.commit(b"y" * 1025)
    assert err.value.size == 1025 and err.value.limit == 1024
    assert store.read_run(run_id).generation == 1


def test_the_default_cap_is_one_mebibyte(store: RedisStore, make_run: MakeRun) -> None:
    key = make_run()
    run = store.acquire(key.run_id, owner="w1", ttl_ms=60_000)
    assert run is not None
    run.commit(b"z" * (1 << 20))
    with pytest.raises(CheckpointTooLargeError):
        run.commit(b"z" * ((1 << 20) + 1))


@pytest.mark.parametrize("bad", ["", "has space", "{tag}", "a|b", "-lead", "x" * 201])
def test_ids_that_would_break_key_names_or_history_entries_are_refused(
    store: RedisStore, bad: str
) -> None:
    with pytest.raises(ContractError):
        store.create_run(bad, task_id="t", env_instance_id="e", scenario=b"s", checkpoint=b"c")
    with pytest.raises(ContractError):
        store.create_run("ok-run", task_id=bad, env_instance_id="e", scenario=b"s", checkpoint=b"c")


def test_scripts_are_reloaded_after_script_flush(store: RedisStore, make_run: MakeRun) -> None:
    key = make_run()
    run = store.acquire(key.run_id, owner="w1", ttl_ms=60_000)
    assert run is not None
    store.client.script_flush()
    run.commit(b"after-flush")
    assert store.read_run(key.run_id).generation == 2


def test_a_client_that_decodes_responses_is_refused() -> None:
    import fakeredis

    with pytest.raises(ConfigurationError):
        RedisStore(fakeredis.FakeRedis(decode_responses=True))


def test_the_lease_handle_is_the_runtime_generation_store_port(
    store: RedisStore, make_run: MakeRun
) -> None:
    key = make_run(checkpoint=b"g1")
    run = store.acquire(key.run_id, owner="w1", ttl_ms=60_000)
    assert run is not None
    assert isinstance(run, GenerationStore)
    assert run.high_water(key) == 1
    assert run.load(key).blob == b"g1"
    run.commit_batch(key, [Advance(expected_generation=1, blob=b"g2")])
    stored = run.load(key)
    assert (stored.generation, stored.blob) == (2, b"g2")
    with pytest.raises(RunExistsError):
        run.commit_batch(key, [Advance(expected_generation=0, blob=b"again")])


def test_the_port_refuses_a_key_for_another_task_or_environment(
    store: RedisStore, make_run: MakeRun
) -> None:
    key = make_run()
    run = store.acquire(key.run_id, owner="w1", ttl_ms=60_000)
    assert run is not None
    for wrong in (
        RunKey("other-task", key.run_id, key.env_instance_id),
        RunKey(key.task_id, key.run_id, "other-env"),
        RunKey(key.task_id, "other-run", key.env_instance_id),
    ):
        with pytest.raises(HighWaterUnavailableError):
            run.high_water(wrong)
        with pytest.raises(ContractError):
            run.commit_batch(wrong, [Advance(expected_generation=1, blob=b"x")])


def test_the_port_reports_a_lost_lease_on_restore(
    store: RedisStore, make_run: MakeRun, expire: Expire
) -> None:
    key = make_run()
    run = store.acquire(key.run_id, owner="w1", ttl_ms=50)
    assert run is not None
    expire(store, key.run_id)
    with pytest.raises(LeaseLostError):
        run.high_water(key)


def test_the_creator_port_creates_a_run_at_generation_zero_and_nothing_later(
    store: RedisStore, new_run_id: Callable[[], str]
) -> None:
    key = RunKey("task-a", new_run_id(), "env-1")
    creator = store.creator(b"scenario")
    assert isinstance(creator, GenerationStore)
    with pytest.raises(HighWaterUnavailableError):
        creator.high_water(key)
    creator.commit_batch(key, [Advance(expected_generation=0, blob=b"g1")])
    creator.commit_batch(
        key, [Advance(expected_generation=0, blob=b"g1")]
    )  # a retry: already applied
    assert creator.high_water(key) == 1 and creator.load(key).blob == b"g1"
    with pytest.raises(RunExistsError):
        store.creator(b"scenario").commit_batch(key, [Advance(expected_generation=0, blob=b"g1")])
    with pytest.raises(LeaseLostError):
        creator.commit_batch(key, [Advance(expected_generation=1, blob=b"g2")])


def test_the_expiry_index_follows_acquire_renew_release_and_finish(
    store: RedisStore, make_run: MakeRun, expire: Expire
) -> None:
    key = make_run()
    run = store.acquire(key.run_id, owner="w1", ttl_ms=30)
    assert run is not None
    expire(store, key.run_id)
    assert key.run_id in store.expiry.expired_runs(limit=100_000)
    again = store.acquire(key.run_id, owner="w2", ttl_ms=60_000)
    assert again is not None
    assert key.run_id not in store.expiry.expired_runs(limit=100_000)
    again.release(reap=True)
    assert key.run_id in store.expiry.expired_runs(limit=100_000)
    third = store.acquire(key.run_id, owner="w3", ttl_ms=60_000)
    assert third is not None
    third.commit(b"done")
    third.release()
    assert key.run_id not in store.expiry.expired_runs(limit=100_000)
