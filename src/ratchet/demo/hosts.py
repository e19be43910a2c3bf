"""The hosts demo: runs on a git workspace survive losing the host that was running them.

1. start a private embedded ``redis-server`` (AOF on, ``appendfsync always``);
2. make a git remote: a bare repository (made with dulwich: no ``git`` program needed)
   whose ``main`` holds the example task's files, reached over ``file://``;
3. submit ``runs`` runs of the greeting task on it (``environment.kind: git``): each gets
   its own branch ``ratchet/<run id>`` at ``main``;
4. start host ``a``: worker processes with their own ``RATCHET_HOST`` and their own disk
   (state folder), one of which dies right after its push landed (the failpoint
   ``git_after_push``), before anything recorded it;
5. at that moment host ``a`` is lost whole: every worker SIGKILLed and its disk deleted;
6. start host ``b``: its workers take every run over once the leases expire, find the
   write on the remote by its key, and finish;
7. count, on the remote, the commits that carry each run's idempotency keys: exactly one
   per write.

Every bound here is a deadline: nothing waits forever.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
from dataclasses import asdict, dataclass, field
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from ratchet.adapters.gitremote import RemoteBranch, seed_bare
from ratchet.demo.examples import RIGHT_GREETING, greeting_document, make_greeting_workspace
from ratchet.demo.fleet import demo_settings, owners_in_history, worker_settings
from ratchet.errors import ConfigurationError
from ratchet.fleet.context import Fleet, ensure_embedded_redis, stop_embedded_redis
from ratchet.fleet.runs import EnvironmentSpec, GitRemoteSpec, RunDocument
from ratchet.fleet.settings import Settings
from ratchet.ops import inspect_run, submit
from ratchet.runtime import Phase
from ratchet.runtime.state import TERMINAL_PHASES
from ratchet.worker.hooks import WorkerHooks
from ratchet.worker.pool import _settings_json, worker_main

__all__ = ["HostsDemoReport", "make_remote", "run_hosts_demo"]

_LOST = "a"
_SURVIVOR = "b"


@dataclass
class HostsDemoReport:
    runs: int
    completed: int
    commits_per_write: dict[str, list[int]]
    duplicate_commits: int
    greeting_fixed: int
    host_lost: str
    lost_after_push: bool
    workers_killed: int
    continued_on_survivor: int
    elapsed_s: float
    phases: dict[str, str] = field(default_factory=dict)
    remote: str = ""

    @property
    def ok(self) -> bool:
        return (
            self.completed == self.runs
            and self.duplicate_commits == 0
            and self.greeting_fixed == self.runs
            and self.lost_after_push
            and all(counts == [1] for counts in self.commits_per_write.values())
        )

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        return data


def make_remote(folder: Path, files: dict[str, bytes], *, branch: str = "main") -> Path:
    """A bare repository at ``folder`` whose ``branch`` holds one commit of ``files``."""
    seed_bare(
        folder,
        files,
        branch=branch,
        message=b"The example task: app.py prints the wrong greeting\n",
        author=b"ratchet demo <demo@localhost>",
    )
    return folder


def _document(url: str, think_ms: int) -> RunDocument:
    plain = greeting_document(Path("."), agent_config={"think_ms": think_ms}, runner="python")
    env = EnvironmentSpec(
        kind="git",
        remote=GitRemoteSpec(url=url, base="main"),
        verifiers=plain.environment.verifiers,
    )
    return plain.model_copy(update={"environment": env})


def _branch_facts(
    url: str, branch: str, base: str, cache: Path
) -> tuple[dict[str, int], bytes | None]:
    """Commits per idempotency key on ``branch`` above ``base``, and its ``app.py``,
    read from the remote as any worker would."""
    remote = RemoteBranch(url, branch, cache=cache)
    try:
        tip = remote.tip()
        if tip is None:
            return {}, None
        remote.fetch(tip)
        counts: dict[str, int] = {}
        for entry in remote.history(tip, base.encode()):
            key = entry.trailers.get("Ratchet-Key")
            if key is not None and not entry.is_fence:
                counts[key] = counts.get(key, 0) + 1
        found = remote.path_at(remote.commit(tip).tree, "app.py")
        return counts, remote.blob(found[1]).as_raw_string() if found is not None else None
    finally:
        remote.close()


#: The file a host-a worker writes, just before it kills itself after its first push.
_MARKER_ENV = "DEMO_HOSTS_PUSHED_MARKER"


class _DieAfterThePush(WorkerHooks):
    """Host a's worker: right after its first push landed on the remote, before anything
    recorded it, it notes so and SIGKILLs itself (as a lost host would)."""

    def write_stage(self, stage: str) -> None:
        if stage == "after_push":
            marker = os.environ.get(_MARKER_ENV)
            if marker:
                Path(marker).write_text(f"{os.getpid()}\n")
            os.kill(os.getpid(), signal.SIGKILL)


def _die_after_the_push() -> WorkerHooks:
    return _DieAfterThePush()


def _start(
    child: Settings, host: str, count: int, *, die_after_push: bool = False
) -> list[BaseProcess]:
    """``count`` worker processes of host ``host`` (its name, its own disk)."""
    ctx = mp.get_context("spawn")
    settings = child.model_copy(
        update={
            "host": host,
            "state_dir": child.state_dir.parent / f"host-{host}",
            "worker_name": f"host-{host}",
        }
    )
    payload = _settings_json(settings)
    procs: list[BaseProcess] = []
    for index in range(count):
        proc = ctx.Process(
            target=worker_main,
            args=(payload, index, False),
            kwargs={"hooks_factory": _die_after_the_push if die_after_push else None},
            daemon=True,
        )
        proc.start()
        procs.append(proc)
    return procs


def _stop(procs: list[BaseProcess], sig: int = signal.SIGTERM) -> None:
    for proc in procs:
        if proc.is_alive() and proc.pid is not None:
            os.kill(proc.pid, sig)
    for proc in procs:
        proc.join(timeout=15)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)


def run_hosts_demo(
    *,
    runs: int = 3,
    workers: int = 2,
    lease_ttl_ms: int = 2000,
    think_ms: int = 300,
    deadline_s: float = 180.0,
) -> HostsDemoReport:
    """Run the demo and return its report. Raises ConfigurationError on a bad setup."""
    if runs < 1 or workers < 1:
        raise ConfigurationError("the hosts demo needs at least one run and one worker per host")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ratchet-hosts-demo-") as tmp:
        base = Path(tmp)
        settings = demo_settings(base, name="hosts-demo", lease_ttl_ms=lease_ttl_ms)
        url = ensure_embedded_redis(settings.state_dir)
        fleet: Fleet | None = None
        try:
            fleet = Fleet.connect(settings)
            child = worker_settings(settings, url)
            return _run(
                fleet,
                child,
                base,
                runs=runs,
                workers=workers,
                think_ms=think_ms,
                deadline=started + deadline_s,
                started=started,
            )
        finally:
            if fleet is not None:  # its connections go before the server they reach
                fleet.store.client.close()
                fleet.rq_connection.close()
            stop_embedded_redis(settings.state_dir)


def _run(
    fleet: Fleet,
    child: Settings,
    base: Path,
    *,
    runs: int,
    workers: int,
    think_ms: int,
    deadline: float,
    started: float,
) -> HostsDemoReport:
    seed = make_greeting_workspace(base / "seed")
    bare = make_remote(
        base / "remote" / "greeting.git",
        {name: (seed / name).read_bytes() for name in ("app.py", "test_app.py")},
    )
    url = bare.resolve().as_uri()
    run_ids = [
        submit(fleet, _document(url, think_ms), run_id=f"hosts-demo-{i}-{os.getpid()}")
        for i in range(runs)
    ]
    fired = base / "pushed.marker"
    os.environ[_MARKER_ENV] = str(fired)
    try:
        # Host a: one of its workers dies right after its first push landed.
        lost = _start(child, _LOST, workers, die_after_push=True)
        killed = 0
        after_push = False
        try:
            while time.monotonic() < deadline:
                if any(not p.is_alive() for p in lost):
                    after_push = fired.exists()
                    break
                if all(inspect_run(fleet, r).state.phase in TERMINAL_PHASES for r in run_ids):
                    break
                time.sleep(0.02)
        finally:
            # The host is lost whole: every worker SIGKILLed, its disk gone.
            killed = sum(1 for p in lost if p.is_alive()) + sum(
                1 for p in lost if not p.is_alive() and p.exitcode == -signal.SIGKILL
            )
            _stop(lost, signal.SIGKILL)
            shutil.rmtree(child.state_dir.parent / f"host-{_LOST}", ignore_errors=True)
    finally:
        os.environ.pop(_MARKER_ENV, None)
    survivor = _start(child, _SURVIVOR, workers)
    try:
        phases = _wait_terminal(fleet, run_ids, deadline)
    finally:
        _stop(survivor)
    commits: dict[str, list[int]] = {}
    fixed = 0
    for run_id in run_ids:
        view = inspect_run(fleet, run_id)
        remote = view.document.environment.remote
        base_commit = remote.base if remote is not None else ""
        cache = child.state_dir.parent / "check-cache"
        counts, app = _branch_facts(url, f"ratchet/{run_id}", base_commit, cache)
        state = view.state
        commits[run_id] = [counts.get(w.idempotency_key, 0) for w in state.executed]
        fixed += app == RIGHT_GREETING.encode()
    continued = sum(
        1
        for r in run_ids
        if any(o.startswith(f"host-{_SURVIVOR}") for o in owners_in_history(fleet, r))
    )
    return HostsDemoReport(
        runs=len(run_ids),
        completed=sum(1 for p in phases.values() if p == Phase.COMPLETED.value),
        commits_per_write=commits,
        duplicate_commits=sum(max(0, n - 1) for c in commits.values() for n in c),
        greeting_fixed=fixed,
        host_lost=_LOST,
        lost_after_push=after_push,
        workers_killed=killed,
        continued_on_survivor=continued,
        elapsed_s=round(time.monotonic() - started, 2),
        phases=phases,
        remote=url,
    )


def _wait_terminal(fleet: Fleet, run_ids: list[str], deadline: float) -> dict[str, str]:
    phases: dict[str, str] = {}
    while time.monotonic() < deadline:
        phases = {r: inspect_run(fleet, r).state.phase.value for r in run_ids}
        if all(Phase(p) in TERMINAL_PHASES for p in phases.values()):
            return phases
        time.sleep(0.05)
    return phases
