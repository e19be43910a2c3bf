"""Store faults of a drill: Redis paused, slowed, out of memory, its disk full, records
corrupted, the store wiped. Each function injects one fault and returns what it did as a
plain dict (the checker's evidence); :class:`StoreFaults` decides when, from the drill's
tick (:mod:`ratchet.chaos.drill.runner`).

Why each is made the way it is:

* **redis-pause**: SIGSTOP, a bounded wait longer than the lease TTL, SIGCONT. Every lease
  live when Redis stopped is snapshotted first (run, lease version, expiry, generation),
  so the checker can name the leases that expired during the pause by identity;
* **redis-slow**: ``DEBUG SLEEP`` (the server blocks) a few times, each shorter than a
  renewal interval, so workers see a slow store, not a lost one. Redis 7 refuses
  ``DEBUG`` unless started with ``enable-debug-command``: the drill's server is
  (:mod:`ratchet.chaos.drill.cluster`);
* **maxmemory**: ``maxmemory`` below the memory in use with ``noeviction`` (the only policy
  workers accept): every write is answered ``OOM``. A probe write of the drill's own
  proves it, then the limit is lifted;
* **disk-full**: Redis' folder is a tmpfs of its own (root only; a unique mount point in
  the drill folder). Under ``appendfsync always`` Redis *exits* when an AOF write fails (it
  cannot take back a reply it has already queued), so for the fault the drill switches to
  ``everysec``, shrinks the tmpfs to what is in use and fills the rest: Redis keeps the
  write that failed in its buffer and answers every later write ``MISCONF``. Once the
  filler is deleted and the size restored, Redis writes its buffer out
  (``aof_last_write_status:ok``) and the drill sets ``always`` again. A Redis that exited
  anyway is restarted on the same folder;
* **corrupt-record**: one Lua script per run overwrites a field of a run whose lease is
  free (no worker holds it, none is paused on it), atomically, so no live holder can
  commit over the corruption: a flipped checkpoint byte, a non-numeric lease version, a
  document cut in half. It returns the lease version and Redis' time of the corruption;
* **store-wipe**: Redis restarted on an empty folder (a fresh store without its epoch);
  the old folder is kept and brought back for the checker afterwards. A restart, like
  a kill or a rollback: :mod:`ratchet.chaos.drill.restartfaults` makes it.

Nothing here keeps a secret; the redis URL never leaves :class:`RedisServer`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from redis.exceptions import OutOfMemoryError, RedisError, ResponseError

from ratchet.errors import ConfigurationError, RatchetError
from ratchet.leasing import run_keys
from ratchet.redis_server import RedisServer

if TYPE_CHECKING:
    from ratchet.chaos.drill.runner import _Drill

__all__ = [
    "CORRUPTIONS",
    "REFUSAL_INCIDENTS",
    "StoreFaults",
    "Tmpfs",
    "aof_write_ok",
    "corrupt_run",
    "effect_counts",
    "lease_snapshot",
    "lift_maxmemory",
    "pause_redis",
    "redis_time_ms",
    "slow_redis",
    "start_disk_full",
    "start_maxmemory",
    "store_refusal",
]

#: How a run's record is corrupted, in the order the drill hands them out.
CORRUPTIONS = ("checkpoint", "lease_version", "document")
#: Incidents that show a worker (or its reaper) refused a corrupted run's record.
REFUSAL_INCIDENTS = frozenset(
    {"restore_refused", "store_record_unreadable", "reaper_entry_refused"}
)

_PROBE_KEY = "drill:store-probe"
_POLL_S = 0.05  # as often as the drill ticks

# Atomic: only a run whose lease nobody holds is corrupted (a live holder would commit
# over a checkpoint, and a paused one would send its stale write to an adapter that has
# seen nothing newer), and only one that has not ended (the drill may not have seen it end
# yet; an ended run's record is what the terminal-phase invariant judges). Replies
# {lease_version (raw), now_ms}, or {} when the lease is held or the run has ended.
_CORRUPT = """
local owner = redis.call('HGET', KEYS[2], 'owner') or ''
if owner ~= '' or redis.call('EXISTS', KEYS[1]) == 0 then
  return {}
end
local phase = redis.call('HGET', KEYS[1], 'phase') or ''
if phase == 'completed' or phase == 'failed' or phase == 'cancelled' then
  return {}
end
local version = redis.call('HGET', KEYS[2], 'lease_version') or '0'
if ARGV[1] == 'checkpoint' then
  local blob = redis.call('GET', KEYS[3])
  if not blob or #blob < 2 then
    return {}
  end
  local at = math.floor(#blob / 2)
  local byte = string.byte(blob, at + 1)
  redis.call('SETRANGE', KEYS[3], at, string.char((byte + 128) % 256))
elseif ARGV[1] == 'lease_version' then
  redis.call('HSET', KEYS[2], 'lease_version', 'not-a-number')
else
  local doc = redis.call('GET', KEYS[4])
  if not doc or #doc < 2 then
    return {}
  end
  redis.call('SET', KEYS[4], string.sub(doc, 1, math.floor(#doc / 2)))
end
local t = redis.call('TIME')
return {version, tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)}
"""


def redis_time_ms(client: Any) -> int:
    """Redis' clock in milliseconds. Raises RedisError."""
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value or "")


def lease_snapshot(client: Any, run_ids: list[str]) -> list[dict[str, Any]]:
    """Every lease of ``run_ids`` that is live now: run, owner, lease version, expiry and
    generation, read in one pipeline. Raises RedisError."""
    now = redis_time_ms(client)
    pipe = client.pipeline(transaction=False)
    for run_id in run_ids:
        keys = run_keys(run_id)
        pipe.hmget(keys.lease, "owner", "lease_version", "expires_at_ms")
        pipe.hget(keys.state, "generation")
    replies = pipe.execute()
    out = []
    for index, run_id in enumerate(run_ids):
        owner, version, expires = (_text(v) for v in replies[2 * index])
        generation = _text(replies[2 * index + 1])
        if owner and version.isdigit() and expires.isdigit() and int(expires) > now:
            out.append(
                {
                    "run_id": run_id,
                    "owner": owner,
                    "lease_version": int(version),
                    "expires_at_ms": int(expires),
                    "generation": int(generation) if generation.isdigit() else None,
                }
            )
    return out


def pause_redis(
    server: RedisServer, client: Any, run_ids: list[str], hold_s: float
) -> dict[str, Any]:
    """SIGSTOP Redis for ``hold_s`` seconds, then SIGCONT; returns the leases live when it
    stopped and Redis' time before and after. Raises RedisError, ConfigurationError."""
    pid = server.pid
    if pid is None:
        raise ConfigurationError("redis-server is not running")
    leases = lease_snapshot(client, run_ids)
    paused_ms = redis_time_ms(client)
    began = time.time()
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(hold_s)  # the fault itself: Redis answers nobody for this long
    finally:
        os.kill(pid, signal.SIGCONT)
    return {
        "kind": "redis-pause",
        "at": began,
        "ended_at": time.time(),
        "hold_s": hold_s,
        "paused_ms": paused_ms,
        "resumed_ms": redis_time_ms(client),
        "leases": leases,
    }


def slow_redis(client: Any, *, sleeps: int, sleep_s: float, gap_s: float) -> dict[str, Any]:
    """``DEBUG SLEEP sleep_s`` ``sleeps`` times, ``gap_s`` apart. ``done`` counts the sleeps
    Redis served; ``refused`` says why none was (``DEBUG`` disabled)."""
    began, done, refused = time.time(), 0, None
    for _ in range(sleeps):
        try:
            client.execute_command("DEBUG", "SLEEP", f"{sleep_s:.3f}")
            done += 1
        except ResponseError as exc:
            refused = str(exc)[:200]
            break
        time.sleep(gap_s)  # the fault's rhythm: slow, answer, slow again
    return {
        "kind": "redis-slow",
        "at": began,
        "ended_at": time.time(),
        "sleeps": done,
        "sleep_s": sleep_s,
        "refused": refused,
    }


def store_refusal(client: Any) -> str | None:
    """Probe one write of the drill's own: the refusal's first words (``OOM``,
    ``MISCONF``), or None when Redis accepted it."""
    try:
        client.set(_PROBE_KEY, b"x" * 16384)
    except ResponseError as exc:
        text = str(exc)
        # redis-py strips the error code of the one it has a class for.
        if isinstance(exc, OutOfMemoryError) and not text.startswith("OOM"):
            text = f"OOM {text}"
        return text[:120]
    return None


def start_maxmemory(client: Any) -> dict[str, Any]:
    """Set ``maxmemory`` to half the memory in use (``noeviction``): writes get ``OOM``.
    Raises RedisError."""
    used = int(client.info("memory")["used_memory"])
    policy = _text(client.config_get("maxmemory-policy").get("maxmemory-policy"))
    before = _text(client.config_get("maxmemory").get("maxmemory")) or "0"
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", str(max(1024 * 1024, used // 2)))
    return {
        "kind": "maxmemory",
        "at": time.time(),
        "used_memory": used,
        "policy": policy,
        "maxmemory_before": before,
    }


def lift_maxmemory(client: Any, fault: dict[str, Any]) -> None:
    """Restore ``maxmemory`` (and drop the probe key). Raises RedisError."""
    client.config_set("maxmemory", fault.get("maxmemory_before") or "0")
    with contextlib.suppress(RedisError):
        client.delete(_PROBE_KEY)
    fault["ended_at"] = time.time()


class Tmpfs:
    """A tmpfs of its own for a folder (Redis', the workspaces'), so its disk can be
    filled (root only).

    ``mount`` returns None or why it cannot (not root, no ``mount``, the kernel refused):
    the disk-full fault is then reported as skipped. ``unmount`` is safe to call twice and
    after a failed mount; the runner calls it in ``finally``.
    """

    def __init__(self, point: Path, size_mb: int = 512, *, what: str = "the AOF's disk") -> None:
        self.point = point
        self.size_mb = size_mb
        self.what = what  # what the mount is for, in a skip reason
        self.mounted = False
        self.filler = point / "drill-filler"

    def __repr__(self) -> str:
        return f"Tmpfs(point={os.fspath(self.point)!r}, mounted={self.mounted})"

    def _mount(self, *options: str) -> str | None:
        done = subprocess.run(  # noqa: S603 - fixed argument list, no shell
            [
                shutil.which("mount") or "mount",
                "-t",
                "tmpfs",
                *options,
                "tmpfs",
                os.fspath(self.point),
            ],
            capture_output=True,
            timeout=30,
            check=False,
        )
        return None if done.returncode == 0 else done.stderr.decode(errors="replace")[-200:]

    def mount(self) -> str | None:
        if os.geteuid() != 0:
            return f"not running as root: {self.what} cannot be mounted small and filled"
        if shutil.which("mount") is None:
            return "no mount command"
        self.point.mkdir(parents=True, exist_ok=False)
        failed = self._mount("-o", f"size={self.size_mb}m,mode=0755")
        if failed is not None:
            return f"mount -t tmpfs failed: {failed.strip()}"
        self.mounted = True
        return None

    def fill(self) -> int:
        """Shrink the tmpfs to what is in use plus a little, then fill that: the next AOF
        write fails with ENOSPC. Returns the filler's size. Raises OSError."""
        st = os.statvfs(self.point)
        used_kb = (st.f_blocks - st.f_bfree) * st.f_frsize // 1024
        failed = self._mount("-o", f"remount,size={used_kb + 256}k")
        if failed is not None:
            raise OSError(f"tmpfs remount failed: {failed.strip()}")
        written = 0
        with self.filler.open("wb") as fh:
            chunk = b"\0" * 65536
            with contextlib.suppress(OSError):  # ENOSPC: full, as wanted
                while True:
                    fh.write(chunk)
                    fh.flush()
                    written += len(chunk)
        return written

    def free(self) -> None:
        """Delete the filler and give the tmpfs its size back, then check that it has it.
        Raises OSError (the filler still there, the remount refused, the size not back)."""
        self.filler.unlink(missing_ok=True)
        failed = self._mount("-o", f"remount,size={self.size_mb}m")
        if failed is not None:
            raise OSError(f"tmpfs remount failed: {failed.strip()}")
        st = os.statvfs(self.point)
        size_kb = st.f_blocks * st.f_frsize // 1024
        if size_kb < self.size_mb * 1024:
            raise OSError(
                f"tmpfs at {os.fspath(self.point)} is {size_kb} KiB after the remount, "
                f"not {self.size_mb * 1024} KiB"
            )

    def unmount(self) -> None:
        if not self.mounted:
            return
        with contextlib.suppress(OSError):
            self.filler.unlink(missing_ok=True)
        done = subprocess.run(  # noqa: S603 - fixed argument list, no shell
            [shutil.which("umount") or "umount", os.fspath(self.point)],
            capture_output=True,
            timeout=30,
            check=False,
        )
        if done.returncode != 0:  # still busy: detach it, the kernel frees it when idle
            subprocess.run(  # noqa: S603 - fixed argument list, no shell
                [shutil.which("umount") or "umount", "-l", os.fspath(self.point)],
                capture_output=True,
                timeout=30,
                check=False,
            )
        self.mounted = False
        with contextlib.suppress(OSError):
            self.point.rmdir()


def start_disk_full(client: Any, disk: Tmpfs) -> dict[str, Any]:
    """Fill Redis' disk (see the module docstring). Raises RedisError, OSError."""
    client.config_set("appendfsync", "everysec")
    began = time.time()
    filler = disk.fill()
    return {"kind": "disk-full", "at": began, "filler_bytes": filler}


def aof_write_ok(client: Any) -> bool:
    """Redis says its last AOF write succeeded. Raises RedisError."""
    return str(client.info("persistence").get("aof_last_write_status")) == "ok"


def effect_counts(folder: Path, index: int) -> dict[str, int]:
    """Committed workspace writes and orders of run ``index``, read-only (for before/after
    comparisons: a run that may not run again must not gain an effect)."""
    counts = {"workspace": 0, "orders": 0}
    journal = folder / "workspaces" / f"ws-{index}" / ".ratchet" / "journal.sqlite3"
    orders = folder / "orders" / f"t{index}.sqlite3"
    for name, path, query in (
        ("workspace", journal, "SELECT count(*) FROM writes WHERE status = 'committed'"),
        ("orders", orders, "SELECT count(*) FROM orders"),
    ):
        if not path.exists():
            continue
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
        try:
            counts[name] = int(db.execute(query).fetchone()[0])
        except sqlite3.Error:
            counts[name] = -1  # unreadable: the comparison fails closed
        finally:
            db.close()
    return counts


def corrupt_run(client: Any, run_id: str, how: str) -> dict[str, Any] | None:
    """Corrupt ``run_id``'s record ``how`` (:data:`CORRUPTIONS`) if nobody holds its lease
    and it has not ended. Returns the lease version and Redis' time of the corruption, or
    None when the lease was held or the run had ended (nothing written). Raises
    RedisError."""
    keys = run_keys(run_id)
    began = time.time()
    reply = client.eval(_CORRUPT, 4, keys.state, keys.lease, keys.ckpt, keys.scenario, how)
    if not reply:
        return None
    version = _text(reply[0])
    return {
        "run_id": run_id,
        "how": how,
        "at": began,
        "at_ms": int(reply[1]),
        "lease_version": int(version) if version.isdigit() else 0,
    }


class StoreFaults:
    """When the drill injects each store fault of its schedule (the functions above do
    the injecting), called from its tick; and whether a corrupted run was refused.

    Store faults share the Redis lane with the kills, the rollback's cut and the
    partitions (the drill's ``holding``, ``cut`` and ``last_redis_fault``): one at a time,
    spaced from every other Redis fault. An OOM or disk-full fault stays in force for a
    while (``holding``) and is lifted by a later tick, so the drill goes on ticking under
    it.
    """

    def __init__(self, disk: Tmpfs | None = None) -> None:
        self.disk = disk  # Redis' own tmpfs, for the disk-full fault
        self.live_tries_until: dict[str, float] = {}  # a store fault waits for a live lease

    def pending(self, drill: _Drill) -> bool:
        return bool(drill.schedule.store_faults_at) or drill.holding is not None

    def tick(self, drill: _Drill, now: float, fraction: float) -> None:
        """The next store fault once its fraction of runs settled is reached, spaced from
        every other Redis fault and never while a rollback cut is armed (the AOF it cuts
        must not hold a fault's own writes)."""
        if drill.holding is not None:
            if now >= float(drill.holding["lift_at"]):
                self.lift(drill)
            return
        due = drill.schedule.store_faults_at
        if not due or fraction < due[0][1] or drill.cut is not None:
            return
        if drill.net is not None and drill.net.redis_turn(fraction, due[0][1]):
            return  # a partition in force, or one due first
        if now - drill.last_redis_fault <= 2.5:
            return
        kind = due[0][0]
        ttl = drill.o.lease_ttl_s
        client = drill.fleet.store.client
        if kind in ("redis-pause", "redis-slow"):
            live = lease_snapshot(client, sorted(drill.unsettled()))
            until = self.live_tries_until.setdefault(kind, now + 60.0)
            if not live and (drill.unsettled() or drill.pending) and now < until:
                # Wait for a run that holds a lease, so the pause expires one and the slowed
                # store has commits to acknowledge (runs spend stretches between jobs, and
                # the next run may not be enqueued yet).
                return
        if kind == "redis-pause" and isinstance(drill.server, RedisServer):  # single Redis only
            fault = pause_redis(
                drill.server, client, sorted(drill.unsettled()), hold_s=max(2 * ttl, ttl + 1.0)
            )
            fault["unsettled"] = sorted(drill.unsettled())
            drill.rec.store_faults.append(fault)
        elif kind == "redis-slow":
            fault = slow_redis(client, sleeps=6, sleep_s=min(0.25, ttl / 4), gap_s=0.3)
            if fault["refused"] and not fault["sleeps"]:
                drill.rec.store_skipped[kind] = f"DEBUG SLEEP refused: {fault['refused']}"
            drill.rec.store_faults.append(fault)
        elif kind == "maxmemory":
            fault = start_maxmemory(client)
            self._hold(drill, fault, hold_s=max(2.0, 2 * ttl))
        elif kind == "disk-full":
            if self.disk is None or not self.disk.mounted:
                drill.rec.store_skipped[kind] = drill.rec.store_skipped.get(
                    kind, "Redis' folder is not on a tmpfs of its own"
                )
            else:
                fault = start_disk_full(client, self.disk)
                self._hold(drill, fault, hold_s=max(2.0, 2 * ttl))
        elif kind == "corrupt-record" and not self._corrupt_some(drill, now):
            return  # no run with a free lease yet: try again next tick
        due.pop(0)
        drill.last_redis_fault = time.time()

    def _hold(self, drill: _Drill, fault: dict[str, Any], hold_s: float) -> None:
        """Probe until Redis refuses a write of the drill's own (bounded), then keep the
        fault in force for ``hold_s`` while the drill goes on ticking."""
        client = drill.fleet.store.client
        deadline = time.time() + 3.0
        refused = store_refusal(client)
        while refused is None and time.time() < deadline:
            time.sleep(_POLL_S)  # the write that fails the AOF is buffered; the next is refused
            refused = store_refusal(client)
        fault["refused"] = refused
        fault["unsettled"] = sorted(drill.unsettled())
        fault["lift_at"] = time.time() + hold_s
        drill.holding = fault
        drill.rec.store_faults.append(fault)

    def lift(self, drill: _Drill) -> None:
        """End the OOM or disk-full fault in force; Redis must accept writes again."""
        fault, drill.holding = drill.holding, None
        if fault is None:
            return
        client = drill.fleet.store.client
        if fault["kind"] == "maxmemory":
            lift_maxmemory(client, fault)
        else:
            disk = self.disk
            if disk is not None:
                disk.free()
            deadline = time.time() + 15.0
            while time.time() < deadline:
                if not drill.server.running:
                    fault["redis_exited"] = True
                    drill.server.start()
                    break
                try:
                    if aof_write_ok(client):
                        break
                except RedisError:
                    pass
                time.sleep(_POLL_S)
            client.config_set("appendfsync", "always")
            fault["aof_ok"] = aof_write_ok(client)
            fault["ended_at"] = time.time()
        drill.last_redis_fault = time.time()

    def _corrupt_some(self, drill: _Drill, now: float) -> bool:
        """Corrupt one run per kind of :data:`CORRUPTIONS`, each a run nobody holds: first
        runs in flight, else runs not yet enqueued. False when none could be had."""
        zombies = {
            w.pause.get("run_id")
            for w in drill.pool.everyone.values()
            if w.paused_at is not None and w.resumed_at is None
        }
        asked = {c["run_id"] for c in drill.rec.cancels}
        # A run waiting for the drill's reviewer is nobody's: spared, or its review is lost.
        spared = zombies | asked | set(drill.reviewers.log["runs"])
        in_flight = sorted(drill.unsettled() - spared)
        drill.rng.shuffle(in_flight)
        waiting = [r for r in drill.pending if r not in spared][: len(CORRUPTIONS)]
        done: list[dict[str, Any]] = []
        for how in CORRUPTIONS:
            for run_id in [*in_flight, *reversed(waiting)]:
                if run_id in drill.rec.corrupted:
                    continue
                got = corrupt_run(drill.fleet.store.client, run_id, how)
                if got is None:
                    continue
                got["index"] = drill.index[run_id]
                got["enqueued"] = run_id in drill.rec.runs
                got["effects"] = effect_counts(drill.rec.folder, drill.index[run_id])
                drill.rec.corrupted[run_id] = got
                done.append(got)
                break
        if not done:
            return False
        drill.rec.store_faults.append({"kind": "corrupt-record", "at": now, "runs": done})
        return True

    def refused(self, drill: _Drill, run_id: str) -> str | None:
        """The kind of the first incident recorded for ``run_id`` since its corruption
        that shows a worker refused it; None while there is none."""
        since = int(drill.rec.corrupted[run_id]["at_ms"])
        try:
            incidents = drill.fleet.store.records.incidents(run_id)
        except RatchetError:
            return None
        for incident in incidents:
            kind = str(incident.get("kind"))
            if kind in REFUSAL_INCIDENTS and int(incident.get("at_ms") or 0) >= since:
                drill.rec.corrupted[run_id].setdefault("refusal", incident)
                return kind
        return None
