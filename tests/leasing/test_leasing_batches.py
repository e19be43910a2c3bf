"""Batched commits (``LeasedRun.commit_batch`` / ``RedisStore.commit_many``): consecutive
fenced commits in one call of the commit script, on a real server, fakeredis[lua] and the
env server."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from ratchet.errors import (
    CommitOutcomeUnknownError,
    ContractError,
    GenerationMismatchError,
    LeaseLostError,
    NonceReplayError,
    RunExistsError,
    StoreProtocolError,
)
from ratchet.leasing import EXPIRY_INDEX, LeasedRun, RedisStore, run_keys
from ratchet.leasing.replies import batch_entries, decode_commit
from ratchet.leasing.scripts import ScriptName
from ratchet.runtime.ports import Advance, Release, RunKey
from tests.leasing.conftest import lose_first_reply

MakeRun = Callable[..., RunKey]
Expire = Callable[[RedisStore, str], None]


def _history(store: RedisStore, run_id: str) -> list[tuple[int, int, str]]:
    """(generation, state_version, commit id) of every history entry, oldest first."""
    entries = [e.decode().split("|") for e in store.client.lrange(run_keys(run_id).history, 0, -1)]
    return [(int(e[0]), int(e[1]), e[4]) for e in reversed(entries)]


def _leased(store: RedisStore, make_run: MakeRun) -> tuple[RunKey, LeasedRun]:
    """A fresh run and w1's lease on it."""
    key = make_run()
    run = store.acquire(key.run_id, owner="w1", ttl_ms=60_000)
    assert run is not None
    return key, run


def test_a_batch_applies_each_commit_at_its_own_generation_in_one_call(
    store: RedisStore, make_run: MakeRun
) -> None:
    key, run = _leased(store, make_run)
    run.commit_batch(key, [Advance(1, b"g2"), Advance(2, b"g3"), Advance(3, b"g4")])
    snap = store.read_run(key.run_id, with_checkpoint=True)
    assert (snap.generation, snap.state_version, snap.checkpoint) == (4, 4, b"g4")
    assert [(g, v) for g, v, _ in _history(store, key.run_id)] == [(1, 1), (2, 2), (3, 3), (4, 4)]
    assert (run.generation, run.state_version) == (4, 4)
    assert run.fence.state_version == 4
    run.commit_batch(
        key, [Advance(expected_generation=4, blob=b"g5")]
    )  # the handle moved with the batch
    assert store.read_run(key.run_id).generation == 5


def test_a_batch_from_a_stale_lease_applies_nothing(
    store: RedisStore, make_run: MakeRun, expire: Expire
) -> None:
    key = make_run()
    old = store.acquire(key.run_id, owner="w1", ttl_ms=150)
    assert old is not None
    expire(store, key.run_id)
    new = store.acquire(key.run_id, owner="w2", ttl_ms=60_000)
    assert new is not None
    with pytest.raises(LeaseLostError):
        old.commit_batch(key, [Advance(1, b"stale-2"), Advance(2, b"stale-3")])
    snap = store.read_run(key.run_id, with_checkpoint=True)
    assert (snap.generation, snap.checkpoint) == (1, b"ckpt-1")
    assert len(_history(store, key.run_id)) == 1


def test_a_refused_commit_stops_the_batch_and_keeps_the_ones_before_it(
    store: RedisStore, make_run: MakeRun
) -> None:
    other = make_run()
    holder = store.acquire(other.run_id, owner="w9", ttl_ms=60_000)
    assert holder is not None
    holder.commit_batch(other, [Advance(expected_generation=1, blob=b"o2")])
    key = make_run()
    taken, mine = f"n-taken-{key.run_id}", f"n-mine-{key.run_id}"  # unique per test run
    holder.commit_batch(other, [Advance(expected_generation=2, blob=b"o3", nonces=[taken])])
    run = store.acquire(key.run_id, owner="w1", ttl_ms=60_000)
    assert run is not None
    # The nonce is claimed globally before anything is sent: nothing of the batch lands.
    with pytest.raises(NonceReplayError):
        run.commit_batch(key, [Advance(1, b"g2"), Advance(2, b"g3", (taken,))])
    assert store.read_run(key.run_id).generation == 1
    # A nonce this run already consumed is refused by the script of the second commit:
    # the first commit stays applied and the handle knows it.
    run.commit_batch(key, [Advance(expected_generation=1, blob=b"g2", nonces=[mine])])
    with pytest.raises(NonceReplayError):
        run.commit_batch(key, [Advance(2, b"g3"), Advance(3, b"g4", (mine,))])
    snap = store.read_run(key.run_id, with_checkpoint=True)
    assert (snap.generation, snap.checkpoint) == (3, b"g3")
    assert run.generation == 3
    with pytest.raises(GenerationMismatchError):
        run.commit_batch(key, [Advance(1, b"old-2"), Advance(2, b"old-3")])
    assert store.read_run(key.run_id).generation == 3


def test_a_lost_batch_reply_is_resent_and_reported_applied_once(
    store: RedisStore, make_run: MakeRun
) -> None:
    key, run = _leased(store, make_run)
    dropped = lose_first_reply(store)
    run.commit_batch(key, [Advance(1, b"g2"), Advance(2, b"g3")])
    assert dropped  # the first send's replies were thrown away
    history = _history(store, key.run_id)
    assert [g for g, _, _ in history] == [1, 2, 3]  # each commit applied exactly once
    assert (run.generation, run.state_version) == (3, 3)


def test_a_batch_whose_replies_never_arrive_is_an_unknown_outcome(
    store: RedisStore, make_run: MakeRun
) -> None:
    key, run = _leased(store, make_run)
    store.reply_hook = lambda run_id, commit_id: True
    with pytest.raises(CommitOutcomeUnknownError) as err:
        run.commit_batch(key, [Advance(1, b"g2"), Advance(2, b"g3")])
    assert err.value.generation == 3
    store.reply_hook = None
    assert store.read_run(key.run_id).generation == 3  # applied, only the replies were lost


def test_a_batch_survives_script_flush(store: RedisStore, make_run: MakeRun) -> None:
    key, run = _leased(store, make_run)
    store.client.script_flush()
    run.commit_batch(key, [Advance(1, b"g2"), Advance(2, b"g3")])
    assert store.read_run(key.run_id).generation == 3


def test_bad_batches_are_refused_before_reaching_redis(
    store: RedisStore, make_run: MakeRun
) -> None:
    key, run = _leased(store, make_run)
    prepared = [store.prepare_commit(key.run_id, generation=g, checkpoint=b"x") for g in (2, 4)]
    with pytest.raises(ContractError):
        store.commit_many(run.lease, prepared, expected_state_version=1)
    with pytest.raises(RunExistsError):
        run.commit_batch(key, [Advance(0, b"again")])
    with pytest.raises(ContractError):
        run.commit_batch(
            RunKey(task_id="other", run_id=key.run_id, env_instance_id="env-1"), [Advance(1, b"g2")]
        )
    run.commit_batch(key, [])  # an empty batch sends nothing
    assert store.read_run(key.run_id).generation == 1


def test_the_creator_takes_a_batch_of_one_creation_only(
    store: RedisStore, new_run_id: Callable[[], str]
) -> None:
    key = RunKey(task_id="task-a", run_id=new_run_id(), env_instance_id="env-1")
    creator = store.creator(b"scenario")
    with pytest.raises(LeaseLostError):
        creator.commit_batch(key, [Advance(0, b"g1"), Advance(1, b"g2")])
    creator.commit_batch(key, [Advance(0, b"g1")])
    assert store.read_run(key.run_id).generation == 1


def test_commit_many_sends_one_script_call(
    store: RedisStore, make_run: MakeRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    key, run = _leased(store, make_run)
    store.load_scripts()  # a fresh server would answer NOSCRIPT first (one more send)
    calls: list[str] = []
    client: Any = store.client
    original_pipeline, original_run = client.pipeline, store._runner.run

    def pipeline(*args: Any, **kwargs: Any) -> Any:
        calls.append("pipeline")
        return original_pipeline(*args, **kwargs)

    def run_script(name: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(name.value)
        return original_run(name, *args, **kwargs)

    monkeypatch.setattr(client, "pipeline", pipeline)
    monkeypatch.setattr(store._runner, "run", run_script)
    run.commit_batch(key, [Advance(1, b"g2"), Advance(2, b"g3"), Advance(3, b"g4")])
    assert calls == ["commit"]
    snap = store.read_run(key.run_id, with_checkpoint=True)
    assert snap.generation == 4 and snap.checkpoint == b"g4"
    # Only the last checkpoint of the batch reaches the checkpoint key; every one of them
    # is in the history, each at its own generation.
    assert [g for g, _, _ in _history(store, key.run_id)] == [1, 2, 3, 4]


def test_a_batch_that_crosses_the_history_limit_trims_history_and_commit_ids_together(
    redis_client: Any, new_run_id: Callable[[], str]
) -> None:
    store = RedisStore(redis_client, history_limit=3)
    run_id = new_run_id()
    store.create_run(run_id, task_id="t", env_instance_id="e", scenario=b"s", checkpoint=b"c")
    key = RunKey("t", run_id, "e")
    run = store.acquire(run_id, owner="w1", ttl_ms=60_000)
    assert run is not None
    run.commit_batch(key, [Advance(g, b"g%d" % (g + 1)) for g in range(1, 6)])
    assert [g for g, _, _ in _history(store, run_id)] == [4, 5, 6]
    ids = {k.decode() for k in redis_client.hkeys(run_keys(run_id).commits)}
    assert ids == {c for _, _, c in _history(store, run_id)}
    assert store.read_run(run_id, with_checkpoint=True).checkpoint == b"g6"


def test_a_long_history_is_trimmed_in_steps_of_an_eighth_of_its_limit(
    redis_client: Any, new_run_id: Callable[[], str]
) -> None:
    store = RedisStore(redis_client, history_limit=16)  # trimmed once over 18 entries
    run_id = new_run_id()
    store.create_run(run_id, task_id="t", env_instance_id="e", scenario=b"s", checkpoint=b"c")
    key = RunKey("t", run_id, "e")
    run = store.acquire(run_id, owner="w1", ttl_ms=60_000)
    assert run is not None
    lengths = []
    for generation in range(1, 30):
        run.commit_batch(
            key, [Advance(expected_generation=generation, blob=b"g%d" % (generation + 1))]
        )
        lengths.append(len(_history(store, run_id)))
    # Generation g leaves g entries until 18; the 19th is trimmed back to 16, and so on.
    assert lengths == [*range(2, 19), 16, 17, 18, 16, 17, 18, 16, 17, 18, 16, 17, 18]
    newest = _history(store, run_id)
    assert newest[-1][0] == 30 and [g for g, _, _ in newest] == list(range(31 - len(newest), 31))
    ids = {k.decode() for k in redis_client.hkeys(run_keys(run_id).commits)}
    assert ids == {c for _, _, c in newest}


@pytest.mark.parametrize(
    "argv",
    [
        ["w1", 1, 1, 64, 0],  # no commits
        ["w1", 1, 1, 64, 1, 2, b"g2", "c-1", "d" * 64, b""],  # nonce count missing
        ["w1", 1, 1, 64, 1, 2, b"g2", "c-1", "d" * 64, b"", 2, "n-1"],  # a nonce short
        ["w1", 1, 1, 64, 1, 2, b"g2", "c-1", "d" * 64, b"", 0, "extra"],  # one argument over
        ["w1", 1, 1, 64, 2, 2, b"g2", "c-1", "d" * 64, b"", 0],  # a commit short
    ],
)
def test_a_batch_whose_arguments_do_not_add_up_is_refused_before_anything_is_read(
    store: RedisStore, make_run: MakeRun, argv: list[Any]
) -> None:
    key, run = _leased(store, make_run)
    keys = run_keys(key.run_id)
    reply = store._runner.run(  # the raw script, past the store's own checks
        ScriptName.COMMIT,
        [keys.lease, keys.state, keys.ckpt, keys.history, keys.commits, keys.nonces, keys.archive],
        argv,
    )
    assert reply == [[b"bad_batch"]]
    with pytest.raises(StoreProtocolError):
        decode_commit(reply[0], run.lease, commit_id="c-1", generation=2, expected_state_version=1)
    snap = store.read_run(key.run_id, with_checkpoint=True)
    assert (snap.generation, snap.state_version) == (1, 1)
    assert len(_history(store, key.run_id)) == 1


@pytest.mark.parametrize("reply", [[], [[b"committed", 2, 2, 1, 1]] * 3, b"committed", None])
def test_a_batch_reply_of_the_wrong_shape_is_a_protocol_error(reply: Any) -> None:
    with pytest.raises(StoreProtocolError):
        batch_entries(reply, 2)


def test_a_reply_that_stops_short_without_a_refusal_is_a_protocol_error(
    store: RedisStore, make_run: MakeRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    key, run = _leased(store, make_run)
    monkeypatch.setattr(
        store._runner, "run", lambda *_, **__: [[b"committed", 2, 2, 10**13, 10**12]]
    )
    with pytest.raises(StoreProtocolError):
        run.commit_batch(key, [Advance(1, b"g2"), Advance(2, b"g3")])


@pytest.mark.parametrize("reap", [False, True])
def test_the_last_commit_can_carry_the_release_in_the_same_call(
    store: RedisStore, make_run: MakeRun, reap: bool
) -> None:
    key, run = _leased(store, make_run)
    run.commit_batch(key, [Advance(1, b"g2"), Advance(2, b"g3")], release=Release(reap=reap))
    snap = store.read_run(key.run_id, with_checkpoint=True)
    assert (snap.generation, snap.checkpoint, snap.owner) == (3, b"g3", None)
    assert not snap.lease_live and snap.lease_version == run.lease_version
    scored = store.client.zscore(EXPIRY_INDEX, key.run_id)
    assert (scored is not None) is reap  # reap: handed on at once; drop: off the index
    released = run.release()  # reports the release the commit carried: no second call
    assert released.lease_version == run.lease_version
    # The next holder gets a higher version, as after any release.
    again = store.acquire(key.run_id, owner="w2", ttl_ms=60_000)
    assert again is not None and again.lease_version > run.lease_version


def test_a_refused_commit_carries_no_release(store: RedisStore, make_run: MakeRun) -> None:
    key, run = _leased(store, make_run)
    with pytest.raises(GenerationMismatchError):
        run.commit_batch(key, [Advance(expected_generation=5, blob=b"g6")], release=Release())
    snap = store.read_run(key.run_id)
    assert snap.generation == 1 and snap.is_held_by("w1", run.lease_version)
    run.release()  # nothing was carried: an ordinary release
    assert store.read_run(key.run_id).owner is None


def test_a_release_carried_by_a_retried_commit_is_applied_once(
    store: RedisStore, make_run: MakeRun
) -> None:
    key, run = _leased(store, make_run)
    dropped = lose_first_reply(store)
    run.commit_batch(key, [Advance(expected_generation=1, blob=b"g2")], release=Release())
    assert dropped
    snap = store.read_run(key.run_id)
    assert snap.generation == 2 and snap.owner is None
    assert [g for g, _, _ in _history(store, key.run_id)] == [1, 2]


def test_a_release_that_travelled_with_the_commit_is_not_sent_again(
    store: RedisStore, make_run: MakeRun
) -> None:
    key, run = _leased(store, make_run)
    run.commit_batch(key, [Advance(expected_generation=1, blob=b"g2")], release=Release(reap=True))
    released = run.release()  # the commit's outcome, no call of its own
    assert store.read_run(key.run_id).owner is None
    assert store.client.zscore(EXPIRY_INDEX, key.run_id) is not None  # reaped as asked
    assert released is not None
    with pytest.raises(LeaseLostError):
        run.release()  # now it would be a call, for a lease no longer held
