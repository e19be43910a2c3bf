"""A git workspace's write step against a bare ``git commit`` + ``git push``, in one run.

Both sides change the same file (``app.py``) of the same bare repository, one commit per
step, and push it to the same remote: by default over ``file://``; with ``--daemon`` also
over ``git daemon`` on loopback (``git://``, receive-pack on). Each round has a new bare
repository (made with dulwich, ``main`` at a base commit) that both sides of the round push
to, so every round starts from the same state and a figure does not depend on how many
rounds came before it.

**A step's cost should not depend on the run's length** (``--steps``; a round is one run):
a branch's history is read once per run and extended by the commits added since (the
chain and each tip's reading are cached: commits never change), and a push sends only
what the commit adds over its parent; over ``file://`` those objects are written loose
into the remote and the ref moved by compare-and-swap under its lock, as ``git
receive-pack`` does with a small push (so the remote gathers no pack files: the count
after each ratchet round is reported). ``--steps 150`` checks a longer run against the
default short one. ``--one-remote`` keeps one remote for every round instead; then the
floor's ``git receive-pack`` may start ``git gc --auto``, which costs CPU beside the timed
steps, so its figures are noisier.

* **ratchet**: one durable write step of a run on a git workspace, through the real
  engine path a worker takes: a :class:`~ratchet.runtime.RunEngine` per run, created
  through ``RedisStore.creator`` on a real ``redis-server`` (``appendfsync always``), its
  lease acquired and the engine resumed on the :class:`~ratchet.leasing.LeasedRun` (which
  raises the run's fence: a fence commit on the branch), then ``--steps`` ``write_file``
  proposals of new content for ``app.py``, each with a fresh idempotency key and the
  current environment version. The adapter is
  :class:`~ratchet.adapters.gitworkspace.GitWorkspaceAdapter` over
  :class:`~ratchet.adapters.gitremote.RemoteBranch` (dulwich's clients, a private object
  cache, no ``git`` program). A step is everything ``propose`` does for the write: the
  live precondition check (the branch observed and projected), the pending-intent commit
  to Redis, the adapter's ``execute`` (read the tip, check fences and the key, build the
  commit, compare-and-swap push), the observation after it and the receipt commit
  (coalesced with the next step's intent commit, as a fleet worker does for an agent that
  plans ahead, ``coalesce_commits``; the last one is sent with the lease's release by the
  closing ``flush``, which is timed with the steps). Each run has its own
  branch ``ratchet/<run>``, made at the base commit before the run starts; the run's
  set-up (start, acquire, resume with its fence commit, reconcile) is outside the timing.
* **floor**: the same change made by the real ``git`` program in a non-bare clone of the
  same bare repository (``git clone``, before the round's timing): per step the file written, ``git
  commit -q -am``, ``git push -q origin HEAD:refs/heads/<floor branch>``. No store, no
  fence, no idempotency: the least a pushed commit costs here with the stock tool. git
  runs with ``GIT_CONFIG_NOSYSTEM=1``, ``GIT_CONFIG_GLOBAL=/dev/null``, a throw-away
  ``HOME`` and its user given with ``-c``, so nobody's configuration matters. Without a
  ``git`` program the floor (and ``--daemon``) are skipped, with the reason printed.

Rounds interleave the two sides (ratchet then floor, then floor then ratchet, ...), so a
noisy shared machine affects both alike; one untimed warm-up round of each comes first.
Each figure is the **median** of its rounds' milliseconds per step;
``ratchet_fraction_of_floor`` is the floor's ms per step over ratchet's (ratchet's step
rate as a fraction of the floor's; the goal is 0.7 or more), and
``median_of_round_ratios`` the median of the same ratio taken round by round.
``ratchet_effects_ms_per_step`` splits ratchet's step by the engine's effects (timed by
the executor's hooks: ``Commit`` is Redis, the others the adapter), with their counts per
step; ``engine_other`` is what is left (the engine's own CPU: seals, transitions).
``client_cpu_ms_per_step`` is this process's CPU per step for ratchet (Redis and the
daemon not counted) and the git processes' (``git commit``, ``git push`` and what they
start, counted when they exit) for the floor.

    python benchmarks/git_workspace.py [--rounds 5] [--steps 30] [--daemon] [--one-remote]
        [--quick] [--json]

The default run takes about 10-15 s (``--daemon``: about 30 s); ``--quick`` (2 rounds of
5 steps) is a smoke run that checks nothing.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
GIT = shutil.which("git")
NO_GIT = None if GIT else "the git program is not installed: no floor, no git daemon"
FILE = "app.py"
BRANCH_PREFIX = "ratchet/"
GOAL = 0.7
DAEMON_START_S = 15.0


# -- the bare repository and git ------------------------------------------------------------


def _make_bare(root: Path, name: str) -> tuple[Path, str]:
    """A bare repository ``root/name`` whose ``main`` holds one commit of ``app.py`` and
    ``test_app.py`` (made with dulwich, as ``tests/gitremotes.py`` does). Returns the
    repository's folder and the commit id."""
    from dulwich.object_store import commit_tree_changes
    from dulwich.objects import Blob, Commit, Tree
    from dulwich.repo import Repo

    path = root / name
    path.mkdir(parents=True)
    repo = Repo.init_bare(str(path))
    try:
        store = repo.object_store
        changes = []
        for rel, data in {FILE: b"print('base')\n", "test_app.py": b"ok\n"}.items():
            blob = Blob.from_string(data)
            store.add_object(blob)
            changes.append((rel.encode(), 0o100644, blob.id))
        empty = Tree()
        store.add_object(empty)
        commit = Commit()
        commit.tree = commit_tree_changes(store, empty, changes)
        commit.author = commit.committer = b"someone <someone@example.com>"
        commit.author_time = commit.commit_time = 1_700_000_000
        commit.author_timezone = commit.commit_timezone = 0
        commit.message = b"base\n"
        store.add_object(commit)
        repo.refs[b"refs/heads/main"] = commit.id
        return path, commit.id.decode()
    finally:
        repo.close()


def _set_branch(bare: Path, branch: str, commit: str) -> None:
    """``refs/heads/<branch>`` of the bare repository at ``commit`` (as submit makes a
    run's branch)."""
    from dulwich.repo import Repo

    repo = Repo(str(bare))
    try:
        repo.refs[b"refs/heads/" + branch.encode()] = commit.encode()
    finally:
        repo.close()


@dataclass(frozen=True)
class Remote:
    """A bare repository both sides push to: its folder, URL and base commit."""

    bare: Path
    url: str
    base: str

    def packs(self) -> int:
        """How many pack files the repository holds now."""
        return len(list((self.bare / "objects" / "pack").glob("*.pack")))


def _git_env(home: Path) -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "LC_ALL": "C",
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _git_daemon(base: Path, home: Path) -> Iterator[str]:
    """``git daemon`` serving the repositories under ``base`` on loopback, receive-pack
    on; yields the URL prefix (``git://127.0.0.1:<port>``).

    It runs in a process group of its own, which is ended as a whole on exit: ``git``
    starts ``git-daemon`` as a child, which forks one more per connection, so ending the
    ``git`` process alone would leave the daemon running."""
    port = _free_port()
    proc = subprocess.Popen(
        [
            str(GIT),
            "daemon",
            "--export-all",
            "--enable=receive-pack",
            "--reuseaddr",
            f"--base-path={base}",
            "--listen=127.0.0.1",
            f"--port={port}",
            str(base),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=_git_env(home),
        start_new_session=True,
    )
    try:
        end = time.monotonic() + DAEMON_START_S
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"git daemon exited at start ({proc.returncode})")
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                if time.monotonic() > end:
                    raise SystemExit("git daemon did not listen in time") from None
                time.sleep(0.02)
        yield f"git://127.0.0.1:{port}"
    finally:
        _end_group(proc)


def _end_group(proc: subprocess.Popen[bytes]) -> None:
    """End ``proc``'s process group (its own, see :func:`_git_daemon`): SIGTERM, a short
    wait for ``proc``, then SIGKILL for anyone left in the group."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


# -- the two sides --------------------------------------------------------------------------


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class Floor:
    """``git commit`` + ``git push`` of the same change, in a clone of the remote (made
    with ``git clone`` the first time a remote is used, outside the timing, and the
    floor's branch pushed there at the base commit)."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.home = work / "home"
        self.home.mkdir(parents=True)
        self.env = _git_env(self.home)
        self.branch = f"floor/{os.getpid()}-{os.urandom(3).hex()}"
        self.clones: dict[str, Path] = {}

    def _clone(self, remote: Remote) -> Path:
        clone = self.clones.get(remote.url)
        if clone is None:
            clone = self.work / f"clone-{len(self.clones)}"
            self._git("clone", "-q", "-b", "main", remote.url, str(clone), cwd=self.work)
            # The floor's branch made at the base before the timing (as a run's branch is).
            self._git("push", "-q", "origin", f"HEAD:refs/heads/{self.branch}", cwd=clone)
            self.clones[remote.url] = clone
        return clone

    def _git(self, *args: str, cwd: Path) -> None:
        done = subprocess.run(
            [
                str(GIT),
                "-c",
                "user.name=bench",
                "-c",
                "user.email=bench@localhost",
                *args,
            ],
            cwd=cwd,
            env=self.env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            check=False,
        )
        if done.returncode != 0:
            err = done.stderr.decode(errors="replace").strip()[:500]
            raise SystemExit(f"git {args[0]} failed ({done.returncode}): {err}")

    def round(self, remote: Remote, n: int, steps: int) -> dict[str, Any]:
        clone = self._clone(remote)
        target = clone / FILE
        cpu = _children_cpu_s()
        start = time.perf_counter()
        for i in range(steps):
            target.write_text(f"print('floor {n} {i}')\n")
            self._git("commit", "-q", "-am", f"floor {n} {i}", cwd=clone)
            self._git("push", "-q", "origin", f"HEAD:refs/heads/{self.branch}", cwd=clone)
        elapsed = time.perf_counter() - start
        return {"seconds": elapsed, "cpu_s": _children_cpu_s() - cpu}


class Ratchet:
    """Runs on a git workspace through the real engine on a real Redis (see the module
    docstring); a round is one run of ``steps`` writes."""

    def __init__(self, work: Path, redis_url: str) -> None:
        from harness import keyring

        from ratchet.leasing import RedisStore
        from ratchet.runtime import Hooks, Scenario
        from ratchet.runtime.canonical import model_json

        self.work = work
        self.store = RedisStore.from_url(redis_url)
        self.store.load_scripts()
        self.keys = keyring()
        self.tag = f"{os.getpid()}-{os.urandom(3).hex()}"
        self.scenario = Scenario.model_validate(
            {
                "schema_version": 1,
                "task_id": "bench-git",
                "task_version": "1",
                "policy_id": "bench",
                "policy_version": "1",
                "permissions": ["write_file", "finish"],
                "allowed_paths": [FILE],
                "allowed_verifier_targets": ["unit"],
                "allowed_operations": [],
                "approval_required": [],
                "budgets": {
                    "proposals": 10_000,
                    "steps": 10_000,
                    "wall_clock_seconds": 3600,
                    "cost_units": 0,
                },
                "initial_files": {},
                "verifier": {"target": "unit", "expected_files": {}},
            }
        )
        self.scenario_bytes = model_json(self.scenario)
        timing: dict[str, list[float]] = {}
        self.timing = timing
        self.counting = False

        bench = self

        class Timed(Hooks):
            """Times every effect by kind while a round's steps are timed."""

            def around(self, effect: Any, proceed: Callable[[], Any]) -> Any:
                if not bench.counting or type(effect).__name__ == "Reached":
                    return proceed()  # Reached performs nothing
                start = time.perf_counter()
                try:
                    return proceed()
                finally:
                    spent = time.perf_counter() - start
                    slot = timing.setdefault(type(effect).__name__, [0, 0.0])
                    slot[0] += 1
                    slot[1] += spent

        self.hooks = Timed()

    def _action(self, engine: Any, run_id: str, n: int, index: int) -> dict[str, Any]:
        from ratchet.runtime import derive_idempotency_key

        state = engine.state
        return {
            "action_id": f"a-{state.next_seq}",
            "kind": "write_file",
            "risk": "reversible_write",
            "args": {"path": FILE, "content": f"print('ratchet {n} {index}')\n"},
            "idempotency_key": derive_idempotency_key(run_id, index),
            "expected_env_version": state.environment.version,
            "deadline_at": int(time.time()) + 600,
        }

    def prepare(self, remote: Remote, n: int) -> tuple[Any, Any, Any, str]:
        """A new run on a new branch, started, leased, resumed and reconciled."""
        from ratchet.adapters.gitremote import RemoteBranch
        from ratchet.adapters.gitworkspace import GitWorkspaceAdapter
        from ratchet.runtime import RunEngine
        from ratchet.worker.executor import Executor

        run_id = f"bench-{self.tag}-{n}"
        branch = BRANCH_PREFIX + run_id
        _set_branch(remote.bare, branch, remote.base)
        adapter = GitWorkspaceAdapter(
            RemoteBranch(remote.url, branch, cache=self.work / "cache"),
            base=remote.base,
            run_id=run_id,
            allowed_paths=[FILE],
            scratch=self.work / "scratch",
            clock=_Clock(),
        )
        RunEngine.start(
            run_id,
            scenario=self.scenario,
            keyring=self.keys,
            executor=Executor(adapter, self.store.creator(self.scenario_bytes)),
            clock=_Clock(),
            archive_trace=True,
        )
        lease = self.store.acquire(run_id, owner=f"bench-{os.getpid()}", ttl_ms=600_000)
        if lease is None:
            raise SystemExit("could not acquire the benchmark run's lease")
        snap = lease.read(with_checkpoint=True)
        if snap.checkpoint is None:
            raise SystemExit("the benchmark run has no checkpoint")
        engine = RunEngine.resume(
            snap.checkpoint,
            archive=snap.archive,
            scenario=self.scenario,
            keyring=self.keys,
            executor=Executor(adapter, lease, hooks=self.hooks),
            clock=_Clock(),
            lease_version=lease.lease_version,
            coalesce=True,
        )
        engine.reconcile()
        return engine, lease, adapter, run_id

    def steps(self, engine: Any, lease: Any, run_id: str, n: int, steps: int) -> None:
        """The timed part: ``steps`` write proposals and the closing flush."""
        from ratchet.runtime import TraceOutcome
        from ratchet.runtime.ports import Release

        for index in range(steps):
            result = engine.propose(
                self._action(engine, run_id, n, index),
                agent_state={"cursor": index, "plan_length": steps},
            )
            if result.outcome is not TraceOutcome.EXECUTED:
                raise SystemExit(f"ratchet step {index} ended {result.outcome.value}")
        engine.flush(release=Release())

    def round(self, remote: Remote, n: int, steps: int) -> dict[str, Any]:
        engine, lease, adapter, run_id = self.prepare(remote, n)
        try:
            self.timing.clear()
            self.counting = True
            cpu = time.process_time()
            start = time.perf_counter()
            self.steps(engine, lease, run_id, n, steps)
            elapsed = time.perf_counter() - start
            cpu = time.process_time() - cpu
            self.counting = False
            if engine.state.environment.version != steps:
                raise SystemExit(
                    f"the run's environment is at version {engine.state.environment.version} "
                    f"after {steps} writes"
                )
            effects = {k: (int(v[0]), float(v[1])) for k, v in self.timing.items()}
        finally:
            self.counting = False
            with contextlib.suppress(Exception):
                lease.release()
            adapter.close()
        return {"seconds": elapsed, "cpu_s": cpu, "effects": effects, "packs": remote.packs()}

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.store.client.close()


class _Clock:
    def now(self) -> int:
        return int(time.time())


# -- measuring ------------------------------------------------------------------------------


def measure_transport(
    transport: str, *, rounds: int, steps: int, one_remote: bool, redis_url: str, work: Path
) -> dict[str, Any]:
    """Interleaved rounds of both sides over ``transport`` (``file`` or ``daemon``), each
    round on a new bare repository (``one_remote``: every round on the same one)."""
    from harness import median, median_of_ratios, ratio

    folder = work / transport
    repos = folder / "repos"
    repos.mkdir(parents=True)
    with contextlib.ExitStack() as stack:
        prefix = f"file://{repos}"
        if transport == "daemon":
            home = folder / "daemon-home"
            home.mkdir()
            prefix = stack.enter_context(_git_daemon(repos, home))

        def new_remote(name: str) -> Remote:
            bare, base = _make_bare(repos, f"{name}.git")
            return Remote(bare, f"{prefix}/{bare.name}", base)

        ratchet = Ratchet(folder / "ratchet", redis_url)
        stack.callback(ratchet.close)
        floor = Floor(folder / "floor") if NO_GIT is None else None
        sides: dict[str, Callable[[Remote, int, int], dict[str, Any]]] = {"ratchet": ratchet.round}
        if floor is not None:
            sides["floor"] = floor.round
        shared = new_remote("remote") if one_remote else None
        # Warm-up (imports, caches, connections), not counted.
        warm = shared or new_remote("warm-up")
        for run in sides.values():
            run(warm, -1, min(steps, 5))
        results: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
        names = list(sides)
        for r in range(rounds):
            remote = shared or new_remote(f"round-{r}")
            for name in names if r % 2 == 0 else names[::-1]:
                results[name].append(sides[name](remote, r, steps))
    ms = {name: [row["seconds"] / steps * 1e3 for row in rows] for name, rows in results.items()}
    medians = {name: round(median(values), 2) for name, values in ms.items()}
    total_steps = steps * rounds
    effects: dict[str, dict[str, float]] = {}
    for row in results["ratchet"]:
        for kind, (count, spent) in row["effects"].items():
            slot = effects.setdefault(kind, {"count": 0.0, "ms": 0.0})
            slot["count"] += count
            slot["ms"] += spent * 1e3
    step_ms = sum(row["seconds"] for row in results["ratchet"]) * 1e3 / total_steps
    breakdown = {
        kind: {
            "ms": round(v["ms"] / total_steps, 2),
            "per_step": round(v["count"] / total_steps, 2),
        }
        for kind, v in sorted(effects.items())
    }
    breakdown["engine_other"] = {
        "ms": round(step_ms - sum(v["ms"] for v in effects.values()) / total_steps, 2),
        "per_step": 0.0,
    }
    report: dict[str, Any] = {
        "transport": transport,
        "ms_per_step": medians,
        "ratchet_fraction_of_floor": ratio(medians.get("floor"), medians["ratchet"], 3),
        "median_of_round_ratios": (
            median_of_ratios(ms["floor"], ms["ratchet"], 3) if "floor" in ms else None
        ),
        "meets_goal": (
            medians["floor"] / medians["ratchet"] >= GOAL if "floor" in medians else None
        ),
        "client_cpu_ms_per_step": {
            name: round(sum(row["cpu_s"] for row in rows) * 1e3 / total_steps, 2)
            for name, rows in results.items()
        },
        "ratchet_effects_ms_per_step": breakdown,
        "rounds_ms_per_step": {name: [round(v, 2) for v in values] for name, values in ms.items()},
        "remote_packs_after_ratchet_round": [row["packs"] for row in results["ratchet"]],
        "one_remote": one_remote,
    }
    if floor is None:
        report["floor_skipped"] = NO_GIT
    return report


def _print_table(report: dict[str, Any]) -> None:
    print(
        f"git workspace write step: {report['rounds']} rounds of {report['steps']} steps "
        f"(median ms per step; ratio = floor ms / ratchet ms, goal >= {GOAL})"
    )
    for row in report["results"]:
        ms, cpu = row["ms_per_step"], row["client_cpu_ms_per_step"]
        print(f"\n[{row['transport']}]")
        print(f"  {'side':<8} {'ms/step':>9} {'CPU ms/step':>12}  rounds")
        for side in ms:
            rounds = " ".join(f"{v:.1f}" for v in row["rounds_ms_per_step"][side])
            print(f"  {side:<8} {ms[side]:>9.2f} {cpu[side]:>12.2f}  {rounds}")
        packs = " ".join(str(n) for n in row["remote_packs_after_ratchet_round"])
        where = "one remote" if row["one_remote"] else "a new remote per round"
        print(f"  ({where}; its pack files after each ratchet round: {packs})")
        if row.get("floor_skipped"):
            print(f"  floor skipped: {row['floor_skipped']}")
        else:
            verdict = "meets" if row["meets_goal"] else "below"
            print(
                f"  ratchet step rate / floor's: {row['ratchet_fraction_of_floor']} "
                f"(median of round ratios {row['median_of_round_ratios']}; {verdict} the "
                f"goal {GOAL})"
            )
        parts = ", ".join(
            f"{kind} {v['ms']} ms" + (f" x{v['per_step']}" if v["per_step"] else "")
            for kind, v in row["ratchet_effects_ms_per_step"].items()
        )
        print(f"  ratchet step by effect: {parts}")
    for note in report.get("skipped", []):
        print(f"\n{note}")


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(HERE))
    from harness import emit, parse_args, parser, temp_redis

    cli = parser(__doc__)
    cli.add_argument("--rounds", type=int, default=5, help="timed rounds of each side")
    cli.add_argument("--steps", type=int, default=30, help="write steps per round")
    cli.add_argument(
        "--daemon", action="store_true", help="also measure over git daemon on loopback"
    )
    cli.add_argument(
        "--one-remote",
        action="store_true",
        help="every round on one bare repository (default: a new one per round)",
    )
    args = parse_args(cli, argv, quick="smoke run: 2 rounds of 5 steps")
    if args.quick:
        args.rounds, args.steps = 2, 5
    if not 1 <= args.rounds <= 40 or not 1 <= args.steps <= 500:
        cli.error("--rounds must be 1..40 and --steps 1..500")
    transports = ["file"]
    skipped = []
    if args.daemon:
        if NO_GIT is None:
            transports.append("daemon")
        else:
            skipped.append(f"--daemon skipped: {NO_GIT}")
    if NO_GIT is not None:
        print(f"floor skipped: {NO_GIT}", file=sys.stderr)
    with (
        contextlib.redirect_stdout(sys.stderr),
        temp_redis(prefix="ratchet-git-workspace-") as (server, work),
    ):
        results = [
            measure_transport(
                transport,
                rounds=args.rounds,
                steps=args.steps,
                one_remote=args.one_remote,
                redis_url=server.url,
                work=Path(work),
            )
            for transport in transports
        ]
    report: dict[str, Any] = {
        "rounds": args.rounds,
        "steps": args.steps,
        "goal_fraction_of_floor": GOAL,
        "git_version": _git_version(),
        "results": results,
    }
    if skipped:
        report["skipped"] = skipped
    emit(report, as_json=args.json, table=_print_table)
    return 0


def _git_version() -> str | None:
    if GIT is None:
        return None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            [GIT, "--version"], capture_output=True, check=True, env=_git_env(Path(os.devnull))
        )
        return out.stdout.decode().strip()
    return None


if __name__ == "__main__":
    sys.exit(main())
