"""Leases fence every write: a stale writer is refused and the chain never forks."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest

from ratchet.errors import LeaseHeldElsewhereError, LeaseLostError
from ratchet.langgraph import RatchetSaver

from .conftest import wait_until_free
from .helpers import checkpoint, config, ids

Make = Callable[..., RatchetSaver]


def _thread() -> str:
    return f"thread-{uuid.uuid4().hex[:12]}"


def test_a_stale_writer_is_refused_and_the_chain_never_forks(make_saver: Make) -> None:
    a, b = make_saver("worker-a", lease_ttl_ms=40), make_saver("worker-b")
    t = _thread()
    lease_a = a.claim(t)
    c1 = checkpoint({"x": 1})
    a.put(config(t, lease=lease_a), c1, {"step": 1}, {"x": 1})
    wait_until_free(b, t)
    lease_b = b.claim(t)
    assert lease_b.lease_version > lease_a.lease_version
    c2 = checkpoint({"x": 2}, versions={"x": 2})
    b.put(config(t, parent=c1["id"], lease=lease_b), c2, {"step": 2}, {"x": 2})

    stale = checkpoint({"x": 99}, versions={"x": 3})
    with pytest.raises(LeaseLostError) as refused:
        a.put(config(t, parent=c1["id"], lease=lease_a), stale, {"step": 2}, {"x": 3})
    assert refused.value.current_owner == "worker-b"
    with pytest.raises(LeaseLostError):
        a.put_writes(config(t, parent=c1["id"], lease=lease_a) | {}, [("x", 5)], "task-1")

    assert ids(b, t) == [c2["id"], c1["id"]]
    head = b.get_tuple(config(t))
    assert head is not None and head.checkpoint["id"] == c2["id"]
    assert head.parent_config is not None
    assert head.parent_config["configurable"]["checkpoint_id"] == c1["id"]


def test_a_write_without_a_lease_claims_the_thread_and_is_refused_while_another_holds_it(
    make_saver: Make,
) -> None:
    a, b = make_saver("worker-a"), make_saver("worker-b")
    t = _thread()
    stored = a.put(config(t), checkpoint(), {}, {})
    lease = stored["configurable"]["ratchet_lease"]
    assert lease["owner"] == "worker-a" and lease["version"] > 1  # max(0 + 1, store ms)
    again = a.put(config(t, parent=stored["configurable"]["checkpoint_id"]), checkpoint(), {}, {})
    assert again["configurable"]["ratchet_lease"] == lease  # our live lease keeps its version
    with pytest.raises(LeaseHeldElsewhereError) as held:
        b.put(config(t), checkpoint(), {}, {})
    assert held.value.owner == "worker-a"
    assert len(ids(a, t)) == 2


def test_a_fork_from_an_older_checkpoint_is_a_legal_new_head(make_saver: Make) -> None:
    a = make_saver()
    t = _thread()
    lease = a.claim(t)
    c1, c2, fork = checkpoint(), checkpoint(), checkpoint()
    a.put(config(t, lease=lease), c1, {}, {})
    a.put(config(t, parent=c1["id"], lease=lease), c2, {}, {})
    a.put(config(t, parent=c1["id"], lease=lease), fork, {"source": "fork"}, {})
    head = a.get_tuple(config(t))
    assert head is not None and head.checkpoint["id"] == fork["id"]
    assert ids(a, t) == [fork["id"], c2["id"], c1["id"]]


def test_a_takeover_by_a_worker_a_minute_behind_keeps_the_new_owners_state_latest(
    make_saver: Make,
) -> None:
    a, b = make_saver("worker-a", lease_ttl_ms=40), make_saver("worker-b")
    t = _thread()
    lease_a = a.claim(t)
    c1, c2 = checkpoint({"s": "a1"}), checkpoint({"s": "a2"}, versions={"s": 2})
    a.put(config(t, lease=lease_a), c1, {}, {"s": 1})
    a.put(config(t, parent=c1["id"], lease=lease_a), c2, {}, {"s": 2})
    wait_until_free(b, t)
    lease_b = b.claim(t)
    behind = checkpoint({"s": "b1"}, versions={"s": 3}, clock_offset_s=-60)
    assert behind["id"] < c1["id"]  # its clock makes it look oldest
    b.put(config(t, parent=c2["id"], lease=lease_b), behind, {}, {"s": 3})

    for reader in (a, b, make_saver("reader")):
        latest = reader.get_tuple(config(t))
        assert latest is not None
        assert latest.checkpoint["id"] == behind["id"]
        assert latest.checkpoint["channel_values"] == {"s": "b1"}
        assert ids(reader, t) == [behind["id"], c2["id"], c1["id"]]


def test_an_expired_lease_is_refused_even_when_nobody_took_over(make_saver: Make) -> None:
    a = make_saver(lease_ttl_ms=40)
    t = _thread()
    lease = a.claim(t)
    wait_until_free(a, t)
    with pytest.raises(LeaseLostError) as refused:
        a.put(config(t, lease=lease), checkpoint(), {}, {})
    assert refused.value.reason == "lease_expired"


def test_renew_and_release_work_only_for_the_current_lease(make_saver: Make) -> None:
    a, b = make_saver("worker-a"), make_saver("worker-b")
    t = _thread()
    lease = a.claim(t)
    renewed = a.renew(lease)
    assert renewed.lease_version == lease.lease_version
    a.release(renewed)
    assert not a.lease_info(t).live
    taken = b.claim(t)
    assert taken.lease_version > lease.lease_version
    with pytest.raises(LeaseLostError):
        a.renew(lease)
    with pytest.raises(LeaseLostError):
        a.release(lease)


def test_delete_thread_ends_the_lease_so_a_running_worker_cannot_resurrect_it(
    make_saver: Make,
) -> None:
    a, admin = make_saver("worker-a"), make_saver("admin")
    t = _thread()
    lease = a.claim(t)
    c1 = checkpoint()
    a.put(config(t, lease=lease), c1, {}, {})
    before = admin.lease_info(t).generation
    admin.delete_thread(t)
    info = admin.lease_info(t)
    assert info.generation == before + 1 and info.owner is None
    assert info.lease_version > lease.lease_version
    with pytest.raises(LeaseLostError):
        a.put(config(t, parent=c1["id"], lease=lease), checkpoint(), {}, {})
    assert admin.get_tuple(config(t)) is None
