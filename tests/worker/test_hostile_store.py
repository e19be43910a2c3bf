"""A hostile store: every Redis key a worker reads for a run is mutated (bytes flipped,
fields rewritten, replaced by another run's value, deleted, given the wrong type), and the
worker either refuses (an incident, or a job that ends without touching anything) or does
only what the signed state already authorised. It never writes to the workspace outside
the signed intent, never starts a process the signed document did not name, and never
crashes the job with an unexpected error."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ratchet.adapters.workspace import WorkspaceAdapter
from ratchet.demo.examples import RIGHT_GREETING, WRONG_GREETING
from ratchet.fleet.context import Fleet
from ratchet.fleet.runs import RunDocument
from ratchet.leasing import EXPIRY_INDEX, RUNS_INDEX, run_keys
from ratchet.ops import submit
from ratchet.worker.job import execute_run

MakeWorkspace = Callable[..., tuple[Path, RunDocument]]
Mutation = Callable[[Any, str, str], None]  # (client, key, other run's same key)

# What a job may end as when its store was tampered with: refused, or nothing done.
REFUSED = {
    "restore_refused",
    "lease_lost",
    "held_elsewhere",
    "environment_changed",
    "store_refused",
    "no_run",
}


def flip(client: Any, key: str, _other: str) -> None:
    kind = client.type(key)
    if kind == b"string":
        data = bytearray(client.get(key))
        data[len(data) // 2] ^= 0x20
        client.set(key, bytes(data))
    elif kind == b"list":
        items = client.lrange(key, 0, -1)
        if items:
            first = bytearray(items[0])
            first[len(first) // 2] ^= 0x20
            client.lset(key, 0, bytes(first))
    elif kind == b"hash":
        fields = client.hgetall(key)
        for name, value in fields.items():
            client.hset(key, name, value[:-1] + (b"7" if value[-1:] != b"7" else b"8"))


def rewrite(client: Any, key: str, _other: str) -> None:
    kind = client.type(key)
    if kind == b"hash":
        for name in client.hkeys(key):
            client.hset(key, name, b"not-a-number")
    elif kind == b"list":
        client.rpush(key, b"{}")
    else:
        client.set(key, b'{"forged": true}')


def swap(client: Any, key: str, other: str) -> None:
    if client.exists(other):
        client.copy(other, key, replace=True)
    else:
        client.delete(key)


def delete(client: Any, key: str, _other: str) -> None:
    client.delete(key)


def wrong_type(client: Any, key: str, _other: str) -> None:
    kind = client.type(key)
    client.delete(key)
    if kind == b"string":
        client.rpush(key, b"x")
    else:
        client.set(key, b"x")


MUTATIONS: dict[str, Mutation] = {
    "flip": flip,
    "rewrite": rewrite,
    "swap": swap,
    "delete": delete,
    "wrong_type": wrong_type,
}
KEYS = ("scenario", "lease", "state", "ckpt", "archive", "history", "commits", "inbox", "incidents")


def effects(root: Path) -> int:
    with WorkspaceAdapter(root, ["app.py"]) as adapter:
        return adapter.effects


def prepared(fleet: Fleet, workspace: MakeWorkspace, name: str) -> tuple[str, Path, str]:
    """A run that did its first step (its read: generation > 1, archive and history hold
    entries) and holds junk evidence in its inbox and an incident, and another run at the
    same point whose keys can stand in for its own."""
    plan = [
        {"kind": "read_file", "args": {"path": "app.py"}},
        {"kind": "write_file", "args": {"path": "app.py", "content": RIGHT_GREETING}},
        {"kind": "run_verifier", "args": {"target": "unit"}},
        {"kind": "finish", "args": {"summary": "fixed"}},
    ]
    one_step = Fleet.connect(fleet.settings.model_copy(update={"max_steps_per_job": 1}))
    ids = []
    for prefix in ("r-hostile", "r-hostile-other"):
        root, document = workspace(runner="python")
        document = document.model_copy(
            update={"agent": "scripted", "agent_config": {"steps": plan}}
        )
        run_id = submit(fleet, document, run_id=f"{prefix}-{name}")
        assert execute_run(one_step, run_id, owner="w-prepare").steps == 1
        ids.append((run_id, root))
    (run_id, root), (other_id, _) = ids
    fleet.store.records.post_evidence(run_id, b'{"junk": 1}')
    fleet.store.records.record_incident(run_id, {"kind": "note", "message": "before"})
    return run_id, root, other_id


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
@pytest.mark.parametrize("slot", KEYS)
def test_a_mutated_record_never_leads_to_an_unauthorised_effect(
    fleet: Fleet, workspace: MakeWorkspace, slot: str, mutation: str
) -> None:
    run_id, root, other_id = prepared(fleet, workspace, f"{slot}-{mutation}")
    keys, others = run_keys(run_id), run_keys(other_id)
    client = fleet.store.client
    MUTATIONS[mutation](client, getattr(keys, slot), getattr(others, slot))
    before = {
        name: client.dump(getattr(keys, name))
        for name in KEYS
        if name
        not in ("lease", "state", "incidents", "history", "commits", "ckpt", "archive", "inbox")
    }
    report = execute_run(fleet, run_id, owner="w-hostile")  # never raises
    text = (root / "app.py").read_text()
    if report.outcome in REFUSED or report.phase in (None, ""):
        assert effects(root) == 0, report
        assert text == WRONG_GREETING
    else:
        # Nothing was refused: then the mutation changed nothing the signed state
        # decides (junk in the inbox or the incidents, a history entry), and the run did
        # exactly its signed plan: the one write of the signed intent, at most once.
        assert report.phase in ("completed", "running", "awaiting_approval"), report
        assert effects(root) <= 1
        assert text in (WRONG_GREETING, RIGHT_GREETING)
    for name, dumped in before.items():  # the document is never rewritten by a worker
        assert client.dump(getattr(keys, name)) == dumped, name


@pytest.mark.parametrize("index", [EXPIRY_INDEX, RUNS_INDEX])
def test_junk_in_the_cross_run_indexes_only_says_look_at_run_x(
    fleet: Fleet, workspace: MakeWorkspace, index: str
) -> None:
    """Index entries are harmless by construction: a run named there that does not exist,
    or another run's id, makes a worker look, and the signed state decides."""
    run_id, root, _other = prepared(fleet, workspace, f"index-{index.rsplit(':', 1)[-1]}")
    client = fleet.store.client
    client.zadd(index, {"no-such-run": 0, "../../etc": 1})
    assert execute_run(fleet, "no-such-run", owner="w-ghost").outcome == "no_run"
    report = execute_run(fleet, run_id, owner="w-real")
    assert report.phase == "completed"
    assert effects(root) == 1
