"""Listings that stay true at any size: per-phase indexes kept by the scripts, cursor pages
that list every run once, exact counts, and the views that read them (``ratchet runs``,
the console's list and review queue, the approvals gauge), against a real redis-server."""

from __future__ import annotations

import base64
import http.client
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ratchet.cli import app
from ratchet.cli.console import fleet_console_data
from ratchet.console import ConsoleServer, serve_console
from ratchet.errors import ContractError, NonceReplayError
from ratchet.fleet.context import Fleet
from ratchet.leasing import EXPIRY_INDEX, RUNS_INDEX, RedisStore, run_keys
from ratchet.leasing.keyspace import INDEX_KEYS, PHASE_INDEXES, PHASES, phase_index
from ratchet.leasing.walk import decode_cursor
from ratchet.ops import submit
from ratchet.ops.reindex import index_phases
from ratchet.redis_server import RedisServer
from ratchet.runtime.ports import Advance, Release, RunKey
from tests.ops.helpers import MakeWorkspace, run_awaiting_approval
from tests.worker.conftest import CHECKPOINT_KEY_HEX

runner = CliRunner()


def make_runs(store: RedisStore, prefix: str, n: int, *, task: str = "t") -> list[str]:
    """``n`` runs with opaque checkpoints: listings never open a checkpoint."""
    ids = [f"{prefix}-{i:04d}" for i in range(n)]
    for run_id in ids:
        store.create_run(run_id, task_id=task, env_instance_id="e", scenario=b"s", checkpoint=b"g1")
    return ids


def cli(redis_server: RedisServer, tmp_path: Path, *args: str) -> Any:
    env = {
        "RATCHET_REDIS_URL": redis_server.url,
        "RATCHET_CHECKPOINT_KEY": CHECKPOINT_KEY_HEX,
        "RATCHET_STATE_DIR": str(tmp_path / "cli-state"),
    }
    return runner.invoke(app, list(args), env=env)


def cli_json(redis_server: RedisServer, tmp_path: Path, *args: str) -> dict[str, Any]:
    result = cli(redis_server, tmp_path, *args, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert isinstance(data, dict)
    return data


@pytest.fixture
def console(fleet: Fleet) -> Iterator[ConsoleServer]:
    server = serve_console(fleet_console_data(fleet), port=0, background=True)
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def fetch(server: ConsoleServer, path: str) -> tuple[int, dict[str, str], str]:
    host, port = str(server.server_address[0]), int(server.server_address[1])
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return (
            response.status,
            {k.lower(): v for k, v in response.getheaders()},
            response.read().decode(),
        )
    finally:
        conn.close()


def walk(
    store: RedisStore, phase: str | None = None, *, limit: int, oldest_first: bool = False
) -> list[str]:
    seen: list[str] = []
    after = None
    while True:
        page = store.list_runs(phase, limit=limit, after=after, oldest_first=oldest_first)
        assert len(page.rows) <= limit
        seen += [row.run_id for row in page.rows]
        after = page.next_cursor
        if after is None:
            return seen


# --- the case ------------------------------------------------------------------------


@pytest.mark.slow
def test_a_new_run_awaiting_approval_after_500_older_runs_is_first_everywhere(
    fleet: Fleet,
    workspace: MakeWorkspace,
    redis_server: RedisServer,
    console: ConsoleServer,
    tmp_path: Path,
) -> None:
    older = make_runs(fleet.store, "r-old", 500)
    new_id = run_awaiting_approval(fleet, workspace, "r-new-approval")

    data = cli_json(redis_server, tmp_path, "runs", "--phase", "awaiting_approval")
    assert [row["run_id"] for row in data["runs"]] == [new_id]
    assert data["counts"]["awaiting_approval"] == 1 and data["counts"]["running"] == 500
    assert data["total"] == 501 and data["unindexed"] == 0
    newest = cli_json(redis_server, tmp_path, "runs", "--limit", "1")
    assert newest["runs"][0]["run_id"] == new_id and newest["next_cursor"]
    assert older[-1] not in json.dumps(newest["runs"])

    status, _, body = fetch(console, "/reviews")
    assert status == 200 and new_id in body and "Awaiting approval (1)" in body
    _, _, metrics = fetch(console, "/metrics")
    assert "ratchet_approvals_waiting 1.0" in metrics
    assert 'ratchet_runs{phase="running"} 500.0' in metrics
    assert 'ratchet_runs{phase="unindexed"} 0.0' in metrics
    status, _, body = fetch(console, "/runs?phase=awaiting_approval")
    assert status == 200 and new_id in body and older[0] not in body


# --- what the scripts keep -------------------------------------------------------------------


def test_counts_are_exact_after_creates_commits_and_phase_changes(fleet: Fleet) -> None:
    store = fleet.store
    make_runs(store, "r-count", 3)
    assert store.phase_counts() == {**dict.fromkeys(PHASES, 0), "running": 3}
    run = store.acquire("r-count-0001", owner="w1", ttl_ms=60_000)
    assert run is not None
    key = RunKey("t", "r-count-0001", "e")
    run.commit_batch(
        key, [Advance(1, b"g2", phase="running"), Advance(2, b"g3", phase="awaiting_approval")]
    )
    assert store.phase_counts()["awaiting_approval"] == 1
    assert store.phase_counts()["running"] == 2
    run.commit_batch(key, [Advance(3, b"g4", phase="awaiting_approval")])  # same phase
    run.commit(b"g5", nonces=["n-once"])  # a commit that states no phase leaves it
    assert store.phase_counts()["awaiting_approval"] == 1
    state = store.client.hgetall(run_keys("r-count-0001").state)
    assert state[b"phase"] == b"awaiting_approval" and int(state[b"generation"]) == 5
    # A batch refused at its second commit: the first applied, and so did its phase.
    with pytest.raises(NonceReplayError):
        run.commit_batch(
            key,
            [
                Advance(5, b"g6", phase="needs_review"),
                Advance(6, b"g7", ("n-once",), phase="completed"),
            ],
        )
    assert store.phase_counts()["needs_review"] == 1
    assert store.phase_counts()["awaiting_approval"] == 0
    assert store.phase_counts()["completed"] == 0
    run.commit_batch(key, [Advance(6, b"g7", phase="failed")], release=Release())
    assert store.read_run("r-count-0001").owner is None
    assert store.phase_counts() == {**dict.fromkeys(PHASES, 0), "running": 2, "failed": 1}
    assert store.run_count() == 3
    assert [r.run_id for r in store.list_runs("failed").rows] == ["r-count-0001"]


def test_every_index_a_run_is_in_is_named_by_index_keys(fleet: Fleet) -> None:
    store = fleet.store
    (run_id,) = make_runs(store, "r-keys", 1)
    run = store.acquire(run_id, owner="w1", ttl_ms=60_000)
    assert run is not None
    run.commit_batch(RunKey("t", run_id, "e"), [Advance(1, b"g2", phase="needs_review")])
    assert store.index_keys() == INDEX_KEYS
    assert set(INDEX_KEYS) == {RUNS_INDEX, EXPIRY_INDEX, *PHASE_INDEXES}
    holding = {
        key.decode()
        for key in store.client.scan_iter(match="ratchet:index:*")
        if store.client.zscore(key, run_id) is not None
    }
    assert holding == {RUNS_INDEX, EXPIRY_INDEX, phase_index("needs_review")}
    assert holding <= set(store.index_keys())


def test_the_engine_commits_carry_the_phase_through_the_worker(
    fleet: Fleet, workspace: MakeWorkspace
) -> None:
    _root, document = workspace()
    run_id = submit(fleet, document)
    assert [r.run_id for r in fleet.store.list_runs("running").rows] == [run_id]
    from ratchet.worker.job import execute_run

    assert execute_run(fleet, run_id, owner="w-phase").phase == "completed"
    assert [r.run_id for r in fleet.store.list_runs("completed").rows] == [run_id]
    assert fleet.store.phase_counts()["running"] == 0


# --- pages -----------------------------------------------------------------------------------


@pytest.mark.parametrize("limit", [1, 7, 50])
def test_pages_walk_every_run_exactly_once_even_with_equal_scores(fleet: Fleet, limit: int) -> None:
    store = fleet.store
    ids = make_runs(store, "r-tie", 60)
    # Three creation times only: twenty runs share each millisecond.
    store.client.zadd(RUNS_INDEX, {run_id: 1000 + (i % 3) for i, run_id in enumerate(ids)})
    expected = sorted(ids, key=lambda r: (1000 + ids.index(r) % 3, r), reverse=True)
    assert walk(store, limit=limit) == expected
    assert walk(store, limit=limit, oldest_first=True) == expected[::-1]


@pytest.mark.parametrize("oldest_first", [False, True])
def test_a_walk_continues_when_the_run_its_cursor_names_leaves_the_index(
    fleet: Fleet, oldest_first: bool
) -> None:
    store = fleet.store
    ids = make_runs(store, "r-gone", 30)
    store.client.zadd(RUNS_INDEX, {run_id: 5000 + i // 20 for i, run_id in enumerate(ids)})
    first = store.list_runs(limit=10, oldest_first=oldest_first)
    last = first.rows[-1].run_id
    store.client.zrem(RUNS_INDEX, last, first.rows[0].run_id)  # the cursor's, and another
    rest = walk_from(store, first.next_cursor, limit=4, oldest_first=oldest_first)
    shown = [r.run_id for r in first.rows] + rest
    assert len(shown) == len(set(shown)) == 30
    assert sorted(shown) == sorted(ids)


def walk_from(
    store: RedisStore, after: str | None, *, limit: int, oldest_first: bool = False
) -> list[str]:
    seen: list[str] = []
    while after is not None:
        page = store.list_runs(limit=limit, after=after, oldest_first=oldest_first)
        seen += [r.run_id for r in page.rows]
        after = page.next_cursor
    return seen


def cursor_of(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


@pytest.mark.parametrize(
    ("call", "field"),
    [
        ({"after": "not-a-cursor!"}, "after"),
        ({"after": "bjox"}, "after"),
        ({"after": cursor_of(b"n:5.0:0,0:r-x")}, "after"),  # passed nothing
        ({"after": cursor_of(b"n:5.0:1,-1:r-x")}, "after"),
        ({"after": cursor_of(b"n:5.0:" + b",".join([b"1"] * 65) + b":r-x")}, "after"),
        ({"after": cursor_of(b"n:5.0:1,1:r-x")}, "after"),  # two shards: not this store's
        ({"limit": 0}, "limit"),
        ({"limit": 1001}, "limit"),
        ({"limit": True}, "limit"),
        ({"phase": "sleeping"}, "phase"),
    ],
)
def test_a_bad_page_request_is_a_contract_error_naming_its_field(
    fleet: Fleet, call: dict[str, Any], field: str
) -> None:
    make_runs(fleet.store, "r-bad", 2)
    before = fleet.store.client.zrange(RUNS_INDEX, 0, -1, withscores=True)
    with pytest.raises(ContractError) as caught:
        fleet.store.list_runs(**call)
    assert caught.value.field == field
    assert fleet.store.client.zrange(RUNS_INDEX, 0, -1, withscores=True) == before


def test_a_cursor_is_for_one_order_only(fleet: Fleet) -> None:
    make_runs(fleet.store, "r-order", 3)
    cursor = fleet.store.list_runs(limit=1).next_cursor
    assert cursor is not None and not decode_cursor(cursor).oldest_first
    with pytest.raises(ContractError, match="other order"):
        fleet.store.list_runs(limit=1, after=cursor, oldest_first=True)


def test_junk_in_an_index_is_a_row_that_says_unreadable(fleet: Fleet) -> None:
    store = fleet.store
    make_runs(store, "r-good", 2)
    store.client.zadd(RUNS_INDEX, {"no-such-run": 9e12, "../../etc": 9e12 + 1})
    store.client.set(run_keys("r-wrongtype").state, b"junk")
    store.client.zadd(RUNS_INDEX, {"r-wrongtype": 9e12 + 2})
    store.records.record_incident("r-good-0001", {"kind": "restore_refused", "reason": "x"})
    store.records.record_incident("r-good-0001", {"kind": "evidence_refused", "reason": "y"})
    rows = {row.run_id: row for row in store.list_runs(limit=10).rows}
    failures = rows["r-good-0001"]
    assert (failures.incidents, failures.last_incident) == (2, "evidence_refused")
    assert (rows["r-good-0000"].incidents, rows["r-good-0000"].last_incident) == (0, None)
    assert rows["../../etc"].problem == "unreadable: not a valid run id"
    assert rows["no-such-run"].problem is not None and "no such run" in rows["no-such-run"].problem
    assert rows["r-wrongtype"].problem == "unreadable: ResponseError"
    assert rows["r-good-0000"].problem is None and rows["r-good-0000"].phase == "running"


def test_search_is_an_exact_prefix_and_a_limited_budget_continues_where_it_stopped(
    fleet: Fleet,
) -> None:
    store = fleet.store
    make_runs(store, "r-a", 5, task="task-alpha")
    make_runs(store, "r-b", 5, task="task-beta")
    assert {r.run_id for r in store.search_runs("task-al").rows} == {
        f"r-a-{i:04d}" for i in range(5)
    }
    assert [r.run_id for r in store.search_runs("r-b-0003").rows] == ["r-b-0003"]
    assert store.search_runs("alpha").rows == ()  # a prefix, not a substring
    # Budget 3: the newest three (r-b) hold no match; the cursor goes on from there.
    page = store.search_runs("r-a-", budget=3)
    assert page.rows == () and page.scanned == 3 and page.next_cursor is not None
    found: list[str] = []
    after: str | None = page.next_cursor
    while after is not None:
        page = store.search_runs("r-a-", budget=3, after=after)
        found += [r.run_id for r in page.rows]
        after = page.next_cursor
    assert sorted(found) == [f"r-a-{i:04d}" for i in range(5)]


# --- runs made before phase indexes ----------------------------------------------------------


def test_runs_made_before_phase_indexes_are_listed_and_store_init_indexes_them(
    fleet: Fleet, workspace: MakeWorkspace, redis_server: RedisServer, tmp_path: Path
) -> None:
    store = fleet.store
    _root, document = workspace()
    verified = submit(fleet, document, run_id="r-legacy-ok")
    (opaque,) = make_runs(store, "r-legacy-junk", 1)  # its checkpoint does not verify
    for run_id in (verified, opaque):  # what a store written before phase indexes holds
        store.client.hdel(run_keys(run_id).state, "phase", "phase_at_ms")
        store.client.zrem(phase_index("running"), run_id)
    rows = {r.run_id: r for r in store.list_runs().rows}
    assert rows[verified].phase is None and rows[verified].problem is None
    data = cli_json(redis_server, tmp_path, "runs")
    assert data["unindexed"] == 2 and data["counts"]["running"] == 0
    assert "store init" in next(r for r in data["runs"] if r["run_id"] == verified)["note"]

    init = cli_json(redis_server, tmp_path, "store", "init")
    assert init["phase_index"]["indexed"] == 1
    assert list(init["phase_index"]["unverifiable"]) == [opaque]
    assert [r.run_id for r in store.list_runs("running").rows] == [verified]
    assert store.client.hget(run_keys(verified).state, "phase") == b"running"
    assert store.client.hget(run_keys(opaque).state, "phase") is None  # left as it was
    assert index_phases(fleet).indexed == 0  # nothing left to do


def test_a_recorded_phase_missing_from_its_index_is_added_back(fleet: Fleet) -> None:
    store = fleet.store
    (run_id,) = make_runs(store, "r-crash", 1)
    store.client.zrem(phase_index("running"), run_id)  # a Cluster crash window's outcome
    assert list(store.runs_missing_phase()) == [(run_id, "running")]
    assert index_phases(fleet).indexed == 1
    assert list(store.runs_missing_phase()) == []
    assert not store.record_phase(run_id, "completed")  # it records another phase


# --- the command line and the console --------------------------------------------------------


def test_ratchet_runs_pages_with_a_cursor_and_refuses_a_bad_one(
    fleet: Fleet, redis_server: RedisServer, tmp_path: Path
) -> None:
    ids = make_runs(fleet.store, "r-cli", 5)
    first = cli_json(redis_server, tmp_path, "runs", "--limit", "3")
    rest = cli_json(redis_server, tmp_path, "runs", "--limit", "3", "--after", first["next_cursor"])
    assert [r["run_id"] for r in first["runs"] + rest["runs"]] == ids[::-1]
    assert rest["next_cursor"] is None
    text = cli(redis_server, tmp_path, "runs", "--limit", "3")
    assert text.exit_code == 0 and "running 5" in text.stdout
    assert f"--after {first['next_cursor']}" in text.stdout
    bad = cli(redis_server, tmp_path, "runs", "--after", "no-such-cursor")
    assert bad.exit_code == 2
    assert "cursor" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    assert "Traceback" not in bad.output


def test_the_console_list_pages_searches_sorts_and_refreshes_without_javascript(
    fleet: Fleet, console: ConsoleServer
) -> None:
    ids = make_runs(fleet.store, "r-page", 5, task="task-page")
    status, _, body = fetch(console, "/runs?limit=2")
    assert status == 200 and ids[4] in body and ids[3] in body and ids[2] not in body
    assert "running <strong>5</strong>" in body and "queue depth" in body
    match = re.search(r'rel="next" href="([^"]+)"', body)
    assert match is not None
    _, _, second = fetch(console, match.group(1).replace("&amp;", "&"))
    assert ids[2] in second and ids[1] in second and ids[4] not in second
    _, _, oldest = fetch(console, "/runs?limit=2&sort=oldest")
    assert ids[0] in oldest and ids[4] not in oldest
    _, _, refreshing = fetch(console, "/runs?refresh=30")
    assert '<meta http-equiv="refresh" content="30">' in refreshing
    assert "<script" not in refreshing and "http-equiv" not in body
    status, headers, _ = fetch(console, f"/runs?q={ids[1]}")
    assert status == 303 and headers["location"] == f"/runs/{ids[1]}"
    _, _, found = fetch(console, "/runs?q=r-page-000")
    assert all(run_id in found for run_id in ids) and "matching" in found
    status, _, junk = fetch(console, "/runs?after=%3Cb%3E&sort=%3Ci%3E&limit=x")
    assert status == 200 and "showing the first page" in junk and "<b>" not in junk
    assert "<i>" not in junk
