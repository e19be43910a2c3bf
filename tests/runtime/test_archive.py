"""Archived checkpoints: the trace and executed writes live in a signed, hash-chained archive
beside the checkpoint, so commits stop growing with the run; restore refuses any archive
that is not exactly the one the checkpoint signs."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ratchet.errors import CheckpointError, HighWaterUnavailableError, InvariantViolation
from ratchet.runtime import CrashWindow, Phase, RunEngine, TraceOutcome
from ratchet.runtime.archive import archive_genesis, chain_link, chain_over, empty_archive
from ratchet.runtime.canonical import canonical_json
from ratchet.runtime.checkpoint import run_key, seal_split
from ratchet.runtime.engine import Probe
from ratchet.runtime.ports import StoredCheckpoint
from ratchet.runtime.restore import open_checkpoint, restore_checkpoint
from tests.runtime.world import RIGHT_GREETING, World


class Crash(Exception):
    """The worker died here."""


def crash_at(window: CrashWindow, armed: list[bool]) -> Probe:
    def probe(seen: CrashWindow) -> None:
        if seen is window and armed:
            raise Crash(window.value)

    return probe


def start(world: World, **options: object) -> RunEngine:
    return RunEngine.start(
        world.run_id, **world.ports(store=world.store.leased(1), archive_trace=True, **options)
    )


def stored(world: World) -> StoredCheckpoint:
    return next(iter(world.store.checkpoints.values()))


def resume(world: World, *, lease_version: int = 2, **options: object) -> RunEngine:
    at = stored(world)
    store = world.store.leased(lease_version)
    store.claim(world.run_id)
    return RunEngine.resume(
        at.blob,
        archive=at.archive,
        lease_version=lease_version,
        **world.ports(store=store, **options),
    )


def restore(world: World, blob: bytes, archive: tuple[bytes, ...]) -> object:
    return restore_checkpoint(
        blob,
        scenario=world.scenario,
        keyring=world.keyring,
        high_water=world.store.high_water,
        observe=lambda _s, _g: world.adapter.observe(),
        approvers=world.approvers,
        reviewers=world.reviewers,
        archive=archive,
    )


def reason(world: World, archive: tuple[bytes, ...], blob: bytes | None = None) -> str:
    with pytest.raises(CheckpointError) as err:
        restore(world, blob if blob is not None else stored(world).blob, archive)
    return str(err.value.reason)


def writes(world: World, engine: RunEngine, count: int) -> None:
    for n in range(count):
        engine.propose(world.write(engine, f"print({n})\n", key=f"w-{n}"))


def test_an_archived_checkpoint_stays_small_while_a_plain_one_grows() -> None:
    archived_world, plain_world = World(), World()
    archived = start(archived_world)
    plain = RunEngine.start(
        plain_world.run_id, **plain_world.ports(store=plain_world.store.leased(1))
    )
    sizes: dict[str, list[int]] = {"archived": [], "plain": []}
    for n in range(12):
        for world, engine, name in (
            (archived_world, archived, "archived"),
            (plain_world, plain, "plain"),
        ):
            engine.propose(world.write(engine, f"print({n})\n", key=f"w-{n}"))
            sizes[name].append(len(engine.checkpoint))
    assert sizes["archived"][-1] - sizes["archived"][1] < 64  # constant, give or take
    assert sizes["plain"][-1] - sizes["plain"][1] > 10 * 900  # ~1 KB more per write
    assert archived.state == plain.state  # the same run either way
    assert len(stored(archived_world).archive) == archived.generation  # one per commit


def test_an_archived_run_restores_to_the_same_state_and_finishes(world: World) -> None:
    engine = start(world)
    writes(world, engine, 3)
    before = engine.state
    resumed = resume(world)
    assert resumed.state == before
    assert resumed.reconcile().window is CrashWindow.BEFORE_PROPOSAL
    resumed.propose(world.write(resumed, key="fix"))
    assert resumed.propose(world.verify(resumed)).outcome is TraceOutcome.VERIFIED
    assert resumed.propose(world.finish(resumed)).phase is Phase.COMPLETED
    payload = open_checkpoint(
        stored(world).blob, keyring=world.keyring, archive=stored(world).archive
    )
    assert payload.archive is not None and payload.archive.executed == 4
    assert [e.idempotency_key for e in payload.state.executed] == ["w-0", "w-1", "w-2", "fix"]
    assert payload.state == resumed.state


@pytest.mark.parametrize(
    "window",
    [
        CrashWindow.AFTER_PENDING_BEFORE_ADAPTER,
        CrashWindow.AFTER_ADAPTER_BEFORE_RECEIPT,
    ],
)
@pytest.mark.parametrize("coalesce", [False, True])
def test_a_crash_in_a_write_window_of_an_archived_run_recovers_with_one_write(
    world: World, window: CrashWindow, coalesce: bool
) -> None:
    armed: list[bool] = []
    engine = start(world, probe=crash_at(window, armed), coalesce=coalesce)
    writes(world, engine, 2)
    armed.append(True)
    with pytest.raises(Crash):
        engine.propose(world.write(engine, key="fix"))
    resumed = resume(world)
    assert resumed.reconcile().window is window
    assert resumed.propose(world.verify(resumed)).outcome is TraceOutcome.VERIFIED
    assert resumed.propose(world.finish(resumed)).phase is Phase.COMPLETED
    assert world.adapter.write_count == 3
    assert world.adapter.files["app.py"] == RIGHT_GREETING


def test_a_plain_run_starts_archiving_and_an_archived_one_keeps_archiving(world: World) -> None:
    plain = RunEngine.start(world.run_id, **world.ports(store=world.store.leased(1)))
    writes(world, plain, 2)
    assert stored(world).archive == ()
    converted = resume(world, archive_trace=True)
    converted.reconcile()
    converted.propose(world.action(converted, "read_file", {"path": "app.py"}))
    first = json.loads(stored(world).archive[0])
    assert len(first["trace"]) == len(converted.state.trace)  # all of it, at once
    kept = resume(world, lease_version=3, archive_trace=False)
    kept.propose(world.action(kept, "read_file", {"path": "app.py"}))
    assert len(stored(world).archive) == 2  # the mode follows the checkpoint
    assert resume(world, lease_version=4).state == kept.state


def _edit(segment: bytes, edit: object) -> bytes:
    data = json.loads(segment)
    edit(data)  # type: ignore[operator]
    return canonical_json(data)


def test_every_change_to_the_archive_is_refused(world: World) -> None:
    engine = start(world)
    writes(world, engine, 3)
    archive = stored(world).archive
    assert len(archive) >= 4
    other = World(run_id="run-other")
    elsewhere = start(other)
    for n in range(3):  # another run with other writes: its segments differ
        elsewhere.propose(other.write(elsewhere, f"print('other {n}')\n", key=f"w-{n}"))
    foreign = stored(other).archive
    assert len(foreign) == len(archive) and foreign != archive
    tampered = {
        "dropped": archive[:-1],
        "missing": (),
        "extra": (*archive, archive[-1]),
        "reordered": (archive[1], archive[0], *archive[2:]),
        "edited": (*archive[:-1], _edit(archive[-1], lambda d: d["trace"][0].update(at=1))),
        "not canonical": (*archive[:-1], archive[-1] + b" "),
        "empty segment": (*archive[:-1], b'{"executed":[],"trace":[]}'),
        "not json": (*archive[:-1], b"\x00\x01"),
        "another run's": foreign,
    }
    for name, candidate in tampered.items():
        assert reason(world, candidate) == "archive", name
    restore(world, stored(world).blob, archive)  # the real one still restores


def test_an_archive_beside_a_checkpoint_that_names_none_is_refused(world: World) -> None:
    plain = RunEngine.start(world.run_id, **world.ports(store=world.store.leased(1)))
    writes(world, plain, 1)
    other = World(run_id=world.run_id)
    writes(other, start(other), 1)
    assert reason(world, stored(other).archive) == "archive"


def test_a_state_that_does_not_extend_the_archive_is_not_sealed(world: World) -> None:
    engine = start(world)
    ref = empty_archive(world.run_id).model_copy(update={"trace": len(engine.state.trace) + 1})
    with pytest.raises(InvariantViolation):
        seal_split(engine.state, world.scenario, world.keyring, generation=2, archived=ref)
    assert world.store.high_water(run_key(engine.state)) == 1


def test_a_schema_invalid_head_or_segment_or_a_float_is_not_sealed(world: World) -> None:
    """The split seal checks the schema of exactly the bytes it signs and appends: a value
    set past validation (model_copy, model_construct) is refused, in the head or in the
    new segment, and so is a float in the agent's free-form state."""
    engine = start(world)
    writes(world, engine, 1)
    archived = engine._archive
    assert archived is not None
    seal = lambda state: seal_split(  # noqa: E731 - a one-line helper
        state,
        world.scenario,
        world.keyring,
        generation=engine.generation + 1,
        archived=archived,
        previous=engine.state,
    )
    with pytest.raises(InvariantViolation, match="schema"):
        seal(engine.state.model_copy(update={"plan_cursor": -1}))
    last = engine.state.trace[-1]
    bad_event = type(last).model_construct(**{**dict(last), "seq": last.seq + 1, "at": -5})
    with pytest.raises(InvariantViolation, match="schema"):
        seal(engine.state.model_copy(update={"trace": (*engine.state.trace, bad_event)}))
    with pytest.raises(InvariantViolation, match="serialised"):
        seal(engine.state.model_copy(update={"agent_state": {"score": 0.5}}))
    assert world.store.high_water(run_key(engine.state)) == engine.generation


def test_a_lost_reply_of_an_archived_commit_is_resolved_by_re_reading(world: World) -> None:
    engine = start(world)
    world.store.lose_next_reply = True
    assert engine.propose(world.write(engine, key="w")).outcome is TraceOutcome.EXECUTED
    assert world.store.high_water(engine.key) == engine.generation
    assert resume(world).state == engine.state


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_flipping_any_bit_of_any_archive_segment_is_refused(
    world: World, data: st.DataObject
) -> None:
    if not world.store.checkpoints:
        writes(world, start(world), 2)
    archive = list(stored(world).archive)
    index = data.draw(st.integers(0, len(archive) - 1))
    bit = data.draw(st.integers(0, len(archive[index]) * 8 - 1))
    flipped = bytearray(archive[index])
    flipped[bit // 8] ^= 1 << (bit % 8)
    archive[index] = bytes(flipped)
    with pytest.raises(CheckpointError):
        restore(world, stored(world).blob, tuple(archive))


def test_a_plain_run_whose_first_archived_commit_is_refused_still_starts_its_archive(
    world: World,
) -> None:
    plain = RunEngine.start(world.run_id, **world.ports(store=world.store.leased(1)))
    writes(world, plain, 1)
    converting = resume(world, archive_trace=True)
    world.store.available = False  # the first archived commit cannot be sent
    with pytest.raises(HighWaterUnavailableError):
        converting.propose(world.action(converting, "read_file", {"path": "app.py"}))
    world.store.available = True
    assert converting.generation == converting.durable_generation
    converting.propose(world.action(converting, "read_file", {"path": "app.py"}))
    first = json.loads(stored(world).archive[0])  # the retry starts the archive whole
    assert len(first["trace"]) == len(converting.state.trace)
    assert resume(world, lease_version=3).state == converting.state


@given(st.lists(st.binary(max_size=64), max_size=12), st.text(min_size=1, max_size=20))
def test_the_chain_folded_in_bytes_is_the_chain_appended_segment_by_segment(
    segments: list[bytes], run_id: str
) -> None:
    """Restore folds the chain over the whole archive at once; sealing extends it by one
    segment per commit: both must give the same value."""
    start = archive_genesis(run_id)
    one_by_one = start
    for segment in segments:
        one_by_one = chain_link(one_by_one, segment)
    assert chain_over(start, segments) == one_by_one
