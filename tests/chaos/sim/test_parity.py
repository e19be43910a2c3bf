"""The simulator's Redis against a real ``redis-server``: the same seeded sequences of store
calls (create with retries, acquire, renew, release, commit batches with retries of the
same commit ids and stale leases, reads, reap claims, incidents, evidence) through the
real ``RedisStore`` on both, every result and the final keyspace compared.

Time: the real server's clock cannot be moved, so every lease here is long (10 minutes)
and nothing in a sequence depends on expiry; the simulated store reads the real server's
``TIME`` for each call, and every value derived from time (``*_ms`` fields, lease versions,
which are ``max(version + 1, now_ms)``, history timestamps, index scores) is compared
masked. Expiry itself is covered by the simulation's own truth (tests/chaos/sim/
test_simulator.py), which judges every lease decision on the simulated store clock."""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ratchet.chaos.sim.keyspace import Keyspace, SimRedis
from ratchet.errors import RatchetError
from ratchet.leasing import RedisStore
from ratchet.leasing.results import Lease
from ratchet.redis_server import RedisServer
from ratchet.runtime.ports import Release

LONG_TTL_MS = 600_000
RUNS = ("pa", "pb")
OWNERS = ("o1", "o2", "o3")
_TIME = re.compile(rb"\d{13,}")
_TIME_FIELDS = {
    "now_ms",
    "expires_at_ms",
    "lease_version",
    "created_at_ms",
    "phase_at_ms",
    "acquired_at_ms",
    "claimed_at_ms",
    "previous_lease_version",
    "current_lease_version",
    "at_ms",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    redis = RedisServer(Path(tmp_path_factory.mktemp("parity-redis"))).start()
    try:
        yield redis
    finally:
        redis.kill()


def _mask(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: ("<t>" if k in _TIME_FIELDS else _mask(v)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_mask(v) for v in value]
    if isinstance(value, bytes):
        return _TIME.sub(b"<t>", value)
    if isinstance(value, str):
        return _TIME.sub(b"<t>", value.encode()).decode()
    if isinstance(value, int) and not isinstance(value, bool) and value >= 10**12:
        return "<t>"
    return value


def _outcome(call: Callable[[], Any]) -> Any:
    try:
        result = call()
    except RatchetError as exc:
        context = {k: v for k, v in exc.context.items() if k not in ("cause",)}
        return ("raised", type(exc).__name__, _mask(context))
    return _mask(_plain(result))


def _plain(value: Any) -> Any:
    """Results as plain data (dataclasses as dicts, a LeasedRun as its lease)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if hasattr(value, "lease") and hasattr(value, "took_over"):  # a LeasedRun
        return {"lease": dataclasses.asdict(value.lease), "took_over": value.took_over}
    return value


class Side:
    """One store (real or simulated) and the leases its callers hold."""

    def __init__(self, store: RedisStore) -> None:
        self.store = store
        self.leases: dict[tuple[str, str], Lease] = {}
        self.stale: list[Lease] = []


def _dump_real(client: Any) -> dict[bytes, Any]:
    out: dict[bytes, Any] = {}
    for key in client.scan_iter(count=1000):
        kind = client.type(key)
        if kind == b"string":
            out[key] = client.get(key)
        elif kind == b"hash":
            out[key] = dict(client.hgetall(key))
        elif kind == b"list":
            out[key] = client.lrange(key, 0, -1)
        elif kind == b"set":
            out[key] = sorted(client.smembers(key))
        elif kind == b"zset":
            out[key] = [(m, s) for m, s in client.zrange(key, 0, -1, withscores=True)]
    return out


def _dump_sim(space: Keyspace) -> dict[bytes, Any]:
    out: dict[bytes, Any] = {}
    for key, value in space.data.items():
        if isinstance(value, set):
            out[key] = sorted(value)
        elif isinstance(value, dict) and type(value).__name__ == "_ZSet":
            out[key] = space.zsorted(key)
        elif isinstance(value, dict):
            out[key] = dict(value)
        elif isinstance(value, list):
            out[key] = list(value)
        else:
            out[key] = value
    return out


def _normal_keyspace(dump: dict[bytes, Any]) -> dict[bytes, Any]:
    def value(v: Any) -> Any:
        if isinstance(v, list) and v and isinstance(v[0], tuple):  # a zset: mask scores
            return sorted((m, "<t>" if s >= 10**12 else s) for m, s in v)
        return _mask(v)

    return {k: value(v) for k, v in sorted(dump.items())}


def _sequence(
    seed: int, real: Side, sim: Side, compare: Callable[[str, Callable[[Side], Any]], None]
) -> None:
    rng = random.Random(seed)
    created: dict[str, str] = {}
    commit_no = 0
    for step in range(60):
        run, owner = rng.choice(RUNS), rng.choice(OWNERS)
        op = rng.choice(
            [
                "create",
                "acquire",
                "acquire",
                "renew",
                "release",
                "commit",
                "commit",
                "commit",
                "stale",
                "read",
                "reap",
                "incident",
                "evidence",
            ]
        )
        if op == "create":
            commit_id = (
                created.get(run) if run in created and rng.random() < 0.5 else f"cr-{seed}-{step}"
            )
            created.setdefault(run, commit_id)
            compare(
                op,
                lambda s, r=run, c=commit_id: s.store.create_run(
                    r,
                    task_id="t",
                    env_instance_id="e",
                    scenario=b"{}",
                    checkpoint=f"ckpt-{r}-1".encode(),
                    commit_id=c,
                    archive_segment=b"seg-0" if r == "pb" else b"",
                ),
            )
        elif op == "acquire":

            def acquire(s: Side, r: str = run, o: str = owner) -> Any:
                got = s.store.try_acquire(r, owner=o, ttl_ms=LONG_TTL_MS)
                lease = getattr(got, "lease", None)
                if lease is not None:
                    old = s.leases.get((r, o))
                    if old is not None:
                        s.stale.append(old)
                    for other in OWNERS:
                        if other != o and (r, other) in s.leases:
                            s.stale.append(s.leases.pop((r, other)))
                    s.leases[(r, o)] = lease
                return got

            compare(op, acquire)
        elif op in ("renew", "release"):
            reap = rng.random() < 0.5

            def lease_call(
                s: Side, r: str = run, o: str = owner, kind: str = op, reap: bool = reap
            ) -> Any:
                lease = s.leases.get((r, o)) or (s.stale[-1] if s.stale else None)
                if lease is None:
                    return "no lease"
                if kind == "renew":
                    return s.store.renew(lease, ttl_ms=LONG_TTL_MS)
                return s.store.release(lease, reap=reap)

            compare(op, lease_call)
        elif op in ("commit", "stale"):
            size = rng.randint(1, 3)
            retry = rng.random() < 0.3
            release = rng.choice(["", "", "drop", "reap"])
            phases = [rng.choice(["", "", "running", "completed"]) for _ in range(size)]
            nonces = [[f"n-{seed}-{step}-{i}"] if rng.random() < 0.2 else [] for i in range(size)]
            commit_no += 1
            ids = [f"c-{seed}-{commit_no}-{i}" for i in range(size)]
            stale = op == "stale"

            def commit(
                s: Side,
                r: str = run,
                o: str = owner,
                ids: list[str] = ids,
                retry: bool = retry,
                release: str = release,
                phases: list[str] = phases,
                nonces: list[list[str]] = nonces,
                stale: bool = stale,
            ) -> Any:
                lease = (s.stale[0] if s.stale else None) if stale else s.leases.get((r, o))
                if lease is None:
                    return "no lease"
                snap = s.store.read_run(r)
                prepared = [
                    s.store.prepare_commit(
                        r,
                        generation=snap.generation + 1 + i,
                        checkpoint=f"ckpt-{r}-{snap.generation + 1 + i}-{ids[i]}".encode(),
                        commit_id=ids[i],
                        nonces=nonces[i],
                        phase=phases[i],
                        segment=b"seg-%d" % (snap.generation + 1 + i) if r == "pb" else b"",
                        keys=b"k%07d" % (snap.generation + 1 + i) if r == "pb" else b"",
                    )
                    for i in range(len(ids))
                ]
                results = []
                for _ in range(2 if retry else 1):
                    try:
                        results.append(
                            s.store.commit_many(
                                lease,
                                prepared,
                                expected_state_version=snap.state_version,
                                release=Release(reap=release == "reap") if release else None,
                            )
                        )
                    except RatchetError as exc:
                        results.append(("raised", type(exc).__name__))
                return results

            compare(op, commit)
        elif op == "read":
            ckpt, scen = rng.random() < 0.5, rng.random() < 0.5
            tail = rng.choice((0, 0, 1, 3))
            compare(
                op,
                lambda s, r=run, c=ckpt, sc=scen, t=tail: s.store.read_run(
                    r, with_checkpoint=c, with_scenario=sc, archive_tail=t
                ),
            )
        elif op == "reap":
            compare(op, lambda s, r=run: s.store.claim_reap(r, reclaim_after_ms=LONG_TTL_MS))
        elif op == "incident":
            compare(
                op,
                lambda s, r=run, i=step: s.store.records.record_incident(
                    r, {"id": f"inc-{seed}-{i}", "kind": "parity"}, keep=3
                ),
            )
        elif op == "evidence":
            compare(
                op,
                lambda s, r=run, i=step: s.store.records.post_evidence(r, b'{"e":%d}' % i, keep=2),
            )


@pytest.mark.parametrize("seed", range(12))
def test_the_simulated_store_answers_every_call_as_a_real_redis_does(
    server: RedisServer, seed: int
) -> None:
    client = server.client()
    client.flushall()
    space = Keyspace(lambda: _server_ms(client))
    real = Side(RedisStore(client))
    sim = Side(RedisStore(SimRedis(space)))
    compared = 0

    def compare(op: str, call: Callable[[Side], Any]) -> None:
        nonlocal compared
        want, got = _outcome(lambda: call(real)), _outcome(lambda: call(sim))
        assert got == want, f"seed {seed}, call {compared} ({op}): sim {got!r} != real {want!r}"
        compared += 1

    _sequence(seed, real, sim, compare)
    assert compared == 60
    assert _normal_keyspace(_dump_sim(space)) == _normal_keyspace(_dump_real(client))


def _server_ms(client: Any) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def test_a_wrong_type_fails_the_script_on_both_as_a_refusal(server: RedisServer) -> None:
    client = server.client()
    client.flushall()
    space = Keyspace(lambda: _server_ms(client))
    for store, raw in (
        (RedisStore(client), client),
        (RedisStore(SimRedis(space)), SimRedis(space)),
    ):
        store.create_run("wt", task_id="t", env_instance_id="e", scenario=b"{}", checkpoint=b"c")
        raw.set("ratchet:{wt}:lease", b"not a hash")
        with pytest.raises(RatchetError) as refused:
            store.try_acquire("wt", owner="o1", ttl_ms=LONG_TTL_MS)
        assert type(refused.value).__name__ == "StoreProtocolError"
