"""Windowed run state: a long run's worker holds only the newest entries of its history,
restores from the archive's last segments and the signed key digests, and still never
executes a key twice (``ratchet.runtime.window``, ``docs/windowed-state.md``)."""

from __future__ import annotations

import hashlib
import sys
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError, create_model

from ratchet.errors import CheckpointError, InvariantViolation
from ratchet.runtime import Phase, RunEngine, TraceOutcome
from ratchet.runtime import window as window_module
from ratchet.runtime.archive import ArchiveRef, archive_genesis, chain_over
from ratchet.runtime.checkpoint import _payload
from ratchet.runtime.ports import StoredCheckpoint
from ratchet.runtime.restore import open_checkpoint
from ratchet.runtime.signing import open_envelope, seal_envelope
from ratchet.runtime.state import TERMINAL_PHASES, RunState, check_invariants
from ratchet.runtime.types import Frozen
from ratchet.runtime.window import DIGEST_BYTES, KeySet, NotInWindow, key_digest, key_digests
from tests.runtime.world import World

KEEP = 2  # segments the window keeps in these tests (the default is 32)


@pytest.fixture(autouse=True)
def small_window(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(window_module, "WINDOW_SEGMENTS", KEEP)


def start(world: World) -> RunEngine:
    return RunEngine.start(
        world.run_id, **world.ports(store=world.store.leased(1), archive_trace=True)
    )


def stored(world: World) -> StoredCheckpoint:
    return next(iter(world.store.checkpoints.values()))


def resume(world: World, lease_version: int, **read: object) -> RunEngine:
    at = stored(world)
    store = world.store.leased(lease_version)
    store.claim(world.run_id)
    options: dict[str, object] = {"archive": at.archive, "keys": at.keys, **read}
    return RunEngine.resume(
        at.blob, lease_version=lease_version, **options, **world.ports(store=store)
    )


def writes(world: World, engine: RunEngine, keys: range) -> None:
    for n in keys:
        result = engine.propose(world.write(engine, f"print({n})\n", key=f"w-{n}"))
        assert result.outcome is TraceOutcome.EXECUTED


def full(world: World) -> object:
    at = stored(world)
    return open_checkpoint(at.blob, keyring=world.keyring, archive=at.archive).state


def test_a_long_run_holds_a_bounded_window_and_its_whole_history_stays_readable(
    world: World,
) -> None:
    plain_world = World()
    plain = RunEngine.start(
        plain_world.run_id, **plain_world.ports(store=plain_world.store.leased(1))
    )
    engine = start(world)
    sizes = []
    for n in range(24):
        writes(world, engine, range(n, n + 1))
        writes(plain_world, plain, range(n, n + 1))
        sizes.append(len(engine.state.trace) + len(engine.state.executed))
    state = engine.state
    assert state.trace_base > 0 and state.executed_base > 0
    assert max(sizes[8:]) < 6 * KEEP + 4  # bounded by the window, not by the run
    assert state.next_seq == plain.state.next_seq
    # Every reader of the history gets all of it, checked against the signed chain.
    history = full(world)
    assert history.trace_base == 0 and history.trace == plain.state.trace
    assert history.executed == plain.state.executed
    assert [e.seq for e in history.trace] == list(range(1, len(history.trace) + 1))
    # The store's key digests are exactly the run's, in order.
    assert stored(world).keys == key_digests(plain.state.executed)


def test_a_windowed_run_restores_from_its_last_segments_and_finishes(world: World) -> None:
    engine = start(world)
    writes(world, engine, range(20))
    at = stored(world)
    before = engine.state
    tail = at.archive[-(2 * KEEP + 2) :]
    resumed = resume(world, 2, archive=tail, archive_from=len(at.archive) - len(tail))
    assert resumed.state == before
    assert (resumed.state.trace_base, resumed.state.executed_base) == (
        before.trace_base,
        before.executed_base,
    )
    writes(world, resumed, range(20, 24))
    resumed.propose(world.write(resumed, key="fix"))  # the right greeting
    assert resumed.propose(world.verify(resumed)).outcome is TraceOutcome.VERIFIED
    assert resumed.propose(world.finish(resumed)).phase is Phase.COMPLETED
    done = resume(world, 3)
    assert done.state.phase is Phase.COMPLETED
    assert len(full(world).executed) == 25


def test_a_restore_whose_segments_stop_short_of_the_window_says_so(world: World) -> None:
    engine = start(world)
    writes(world, engine, range(12))
    at = stored(world)
    start_at = engine._archive.window.segments  # type: ignore[union-attr]
    tail = at.archive[start_at + 1 :]
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(
            at.blob,
            keyring=world.keyring,
            archive=tail,
            archive_from=start_at + 1,
            keys=at.keys,
            windowed=True,
        )
    assert err.value.reason == "archive_short"


def altered(segment: bytes) -> bytes:
    """``segment`` with one value changed, still canonical and schema-valid: only the
    hash chain tells."""
    data = orjson.loads(segment)
    if data["trace"]:
        data["trace"][0]["at"] += 1
    else:
        data["executed"][0]["receipt"]["receipt_id"] += "x"
    return orjson.dumps(data, option=orjson.OPT_SORT_KEYS)


def tampered_keys(keys: bytes) -> list[bytes]:
    first, second = keys[:DIGEST_BYTES], keys[DIGEST_BYTES : 2 * DIGEST_BYTES]
    flipped = bytes([keys[3] ^ 1])
    return [
        keys[:-DIGEST_BYTES],  # one hidden
        keys + first,  # one added
        second + first + keys[2 * DIGEST_BYTES :],  # two swapped
        keys[:3] + flipped + keys[4:],  # one changed
        b"",
    ]


def test_key_digests_that_are_not_the_signed_ones_are_refused(world: World) -> None:
    engine = start(world)
    writes(world, engine, range(12))
    at = stored(world)
    assert at.keys is not None
    for keys in tampered_keys(at.keys):
        with pytest.raises(CheckpointError) as err:
            open_checkpoint(
                at.blob, keyring=world.keyring, archive=at.archive, keys=keys, windowed=True
            )
        assert err.value.reason == "archive"


def test_a_changed_segment_in_the_window_is_refused_and_one_before_it_is_not_read(
    world: World,
) -> None:
    engine = start(world)
    writes(world, engine, range(12))
    at = stored(world)
    start_at = engine._archive.window.segments  # type: ignore[union-attr]
    for index in (start_at, len(at.archive) - 1):
        archive = list(at.archive)
        archive[index] = altered(archive[index])
        with pytest.raises(CheckpointError) as err:
            open_checkpoint(
                at.blob, keyring=world.keyring, archive=archive, keys=at.keys, windowed=True
            )
        assert err.value.reason == "archive"
    # Before the window: the worker's restore does not read it (the readers do, and refuse).
    archive = list(at.archive)
    archive[0] = b"garbage"
    opened = open_checkpoint(
        at.blob, keyring=world.keyring, archive=archive, keys=at.keys, windowed=True
    )
    assert opened.state == engine.state
    with pytest.raises(CheckpointError):
        open_checkpoint(at.blob, keyring=world.keyring, archive=archive)


def test_an_old_key_proposed_again_is_recalled_and_never_executed_twice(world: World) -> None:
    engine = start(world)
    writes(world, engine, range(16))
    assert engine.state.executed_base > 3
    with pytest.raises(NotInWindow):
        engine.state.cached("w-1")
    assert engine.state.has_executed("w-1") and not engine.state.has_executed("w-99")
    executed_before = world.adapter.write_count
    # Same key, same intent: a replay of the cached receipt, no second execution.
    same = engine.propose(world.write(engine, "print(1)\n", key="w-1"))
    assert same.outcome is TraceOutcome.REPLAYED
    assert world.adapter.write_count == executed_before
    # Same key, another intent: refused, as for a key in the window.
    other = engine.propose(world.write(engine, "print('other')\n", key="w-2"))
    assert other.outcome is TraceOutcome.REJECTED_KEY_CONFLICT
    # A worker that restored only the window recalls it the same way.
    resumed = resume(world, 2)
    again = resumed.propose(world.write(resumed, "print('again')\n", key="w-0"))
    assert again.outcome is TraceOutcome.REJECTED_KEY_CONFLICT
    assert world.adapter.write_count == executed_before


def test_a_recall_from_a_damaged_archive_fails_closed(world: World) -> None:
    engine = start(world)
    writes(world, engine, range(16))
    key = next(iter(world.store.checkpoints))
    at = stored(world)
    archive = list(at.archive)
    archive[1] = altered(archive[1])
    world.store.checkpoints[key] = StoredCheckpoint(at.generation, at.blob, tuple(archive), at.keys)
    executed_before = world.adapter.write_count
    with pytest.raises(CheckpointError) as err:
        engine.propose(world.write(engine, "print(1)\n", key="w-1"))
    assert err.value.reason == "archive"
    assert world.adapter.write_count == executed_before


def test_a_digest_collision_fails_closed_instead_of_answering(world: World) -> None:
    engine = start(world)
    writes(world, engine, range(16))
    keys = engine.state.keys
    assert keys is not None
    # A key whose digest collides with w-0's: the recall finds w-0 at that ordinal.
    keys.ordinal("w-0")  # the index is built on first use
    keys._index[int.from_bytes(key_digest("collides"), sys.byteorder)] = 0  # type: ignore[index]
    with pytest.raises(CheckpointError) as err:
        engine.propose(world.write(engine, "print('x')\n", key="collides"))
    assert "another key" in err.value.message


def test_a_windowed_state_without_its_key_set_is_refused(world: World) -> None:
    engine = start(world)
    writes(world, engine, range(12))
    bare = engine.state.with_keys(None)
    with pytest.raises(InvariantViolation):
        bare.cached("w-new")
    with pytest.raises(InvariantViolation):
        check_invariants(
            bare.model_copy(update={"executed": (*bare.executed, bare.executed[-1])}),
            world.scenario,
        )


def test_a_key_executed_before_the_window_cannot_be_executed_again_in_it(world: World) -> None:
    engine = start(world)
    writes(world, engine, range(16))
    state = engine.state
    old = state.executed[0].model_copy(update={"idempotency_key": "w-0"})
    with pytest.raises(InvariantViolation, match="executed twice"):
        check_invariants(
            state.model_copy(update={"executed": (*state.executed, old)}), world.scenario
        )


def v1_checkpoint(world: World, engine: RunEngine) -> StoredCheckpoint:
    """``engine``'s run as a checkpoint made before windowed state: its whole history in
    one archive, a reference without window or key set, a head without window fields."""
    state = engine.state
    if state.trace_base:
        raise ValueError("use a run whose window has not moved")
    segment = orjson.dumps(
        {
            "executed": [e.model_dump(mode="json") for e in state.executed],
            "trace": [e.model_dump(mode="json") for e in state.trace],
        },
        option=orjson.OPT_SORT_KEYS,
    )
    ref = ArchiveRef(
        trace=len(state.trace),
        executed=len(state.executed),
        segments=1,
        chain=chain_over(archive_genesis(state.run_id), [segment]),
    )
    head = state.model_dump(
        mode="json", exclude={"trace", "executed", "trace_base", "executed_base"}
    )
    head["trace"], head["executed"] = [], []
    body = orjson.dumps(
        _payload(engine.generation, world.scenario, head, ref), option=orjson.OPT_SORT_KEYS
    )
    return StoredCheckpoint(engine.generation, seal_envelope(world.keyring, body), (segment,))


def test_a_checkpoint_from_before_windows_restores_and_its_next_commit_converts_it(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(window_module, "WINDOW_SEGMENTS", 100)
    engine = start(world)
    writes(world, engine, range(3))
    monkeypatch.setattr(window_module, "WINDOW_SEGMENTS", KEEP)
    key = next(iter(world.store.checkpoints))
    world.store.checkpoints[key] = v1_checkpoint(world, engine)
    resumed = resume(world, 2)
    assert resumed.state == engine.state
    writes(world, resumed, range(3, 14))
    at = stored(world)
    # The first commit sent every digest of the run; later ones only their own.
    assert at.keys == key_digests(full(world).executed)
    assert resumed.state.executed_base > 0
    again = resume(world, 3)
    assert again.state == resumed.state
    assert again.propose(world.write(again, "print(0)\n", key="w-0")).outcome is (
        TraceOutcome.REPLAYED
    )


def test_a_windowed_checkpoint_is_refused_by_a_build_without_windows(world: World) -> None:
    """A build that knows only whole-history states (the same model without the window
    fields, unknown fields forbidden) refuses the head instead of misreading it."""
    engine = start(world)
    writes(world, engine, range(12))
    head = orjson.loads(open_envelope(world.keyring, stored(world).blob))["state"]
    assert head["trace_base"] > 0
    old_fields: dict[str, Any] = {
        name: (info.annotation, info)
        for name, info in RunState.model_fields.items()
        if name not in {"trace_base", "executed_base"}
    }
    old = create_model("OldRunState", __base__=Frozen, **old_fields)
    with pytest.raises(ValidationError, match="trace_base"):
        old.model_validate(head)


def test_a_key_set_hashes_as_the_signed_value_and_answers_only_before_its_base() -> None:
    keys = KeySet()
    keys.extend(key_digests([]))
    for name in ("a", "b", "c"):
        keys.extend(key_digest(name))
    assert keys.count == 3
    assert keys.hexdigest() == hashlib.sha256(keys.blob).hexdigest()
    assert keys.older("b", 2) == 1 and keys.older("c", 2) is None and keys.older("z", 3) is None
    with pytest.raises(ValueError):
        keys.extend(b"short")
    with pytest.raises(ValueError):
        KeySet(b"123")


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ops=st.lists(st.integers(min_value=0, max_value=30), min_size=1, max_size=40),
    keep=st.integers(min_value=1, max_value=4),
)
def test_the_windowed_state_answers_every_key_as_the_whole_history_does(
    monkeypatch: pytest.MonkeyPatch, ops: list[int], keep: int
) -> None:
    """Random writes (some repeating old keys) on a windowed run and on a plain one: the
    same outcome for every proposal, the same executions, the same history."""
    monkeypatch.setattr(window_module, "WINDOW_SEGMENTS", keep)
    windowed_world, plain_world = World(), World()
    windowed = start(windowed_world)
    plain = RunEngine.start(
        plain_world.run_id, **plain_world.ports(store=plain_world.store.leased(1))
    )
    for n in ops:
        if windowed.state.phase in TERMINAL_PHASES:  # the budget ran out: both ended alike
            assert plain.state.phase is windowed.state.phase
            break
        for world, engine in ((windowed_world, windowed), (plain_world, plain)):
            engine.propose(world.write(engine, f"print({n % 7})\n", key=f"k-{n}"))
        assert windowed.state.trace[-1] == plain.state.trace[-1]
        assert windowed.state.next_seq == plain.state.next_seq
    assert windowed_world.adapter.write_count == plain_world.adapter.write_count
    assert full(windowed_world).trace == plain.state.trace


def test_a_resume_given_the_whole_history_opened_holds_the_signed_window(world: World) -> None:
    engine = start(world)
    writes(world, engine, range(12))
    at = stored(world)
    opened = open_checkpoint(at.blob, keyring=world.keyring, archive=at.archive)
    assert opened.state.trace_base == 0
    store = world.store.leased(2)
    store.claim(world.run_id)
    resumed = RunEngine.resume(
        at.blob, archive=at.archive, opened=opened, lease_version=2, **world.ports(store=store)
    )
    assert resumed.state == engine.state and resumed.state.trace_base > 0
    assert resumed.propose(world.write(resumed, "print(0)\n", key="w-0")).outcome is (
        TraceOutcome.REPLAYED
    )


def test_the_window_keeps_the_verifier_event_a_finish_needs_however_many_reads_follow(
    world: World,
) -> None:
    engine = start(world)
    writes(world, engine, range(6))
    engine.propose(world.write(engine, key="fix"))  # the right greeting
    assert engine.propose(world.verify(engine)).outcome is TraceOutcome.VERIFIED
    verified_at = engine.state.next_seq - 1
    for _ in range(10 * KEEP):
        read = world.action(engine, "read_file", {"path": "app.py"})
        assert engine.propose(read).outcome is TraceOutcome.READ
    assert engine.state.trace_base < verified_at  # held back for the verifier event
    resumed = resume(world, 2)
    assert resumed.propose(world.finish(resumed)).phase is Phase.COMPLETED
    assert resume(world, 3).state.phase is Phase.COMPLETED
    # Once a write makes the report stale, the window moves on past it again.
    other = World()
    engine = start(other)
    engine.propose(other.write(engine, key="fix"))
    assert engine.propose(other.verify(engine)).outcome is TraceOutcome.VERIFIED
    verified_at = engine.state.next_seq - 1
    writes(other, engine, range(12))
    assert engine.state.trace_base > verified_at
