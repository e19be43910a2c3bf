"""The git remote of ``ratchet drill --hosts N --environment git``, and its faults.

One bare repository in the drill folder (``remote/drill.git``, outside every host's disk),
its ``main`` holding the drill task's initial files; each run's branch is made on it at
submit. It is served by ``git daemon`` on loopback (receive-pack on, its own process group)
when the ``git`` program is installed, else reached over ``file://`` (every host sees the
drill folder: only ``disk/`` differs between hosts).

``git-server-kill`` (:class:`ServerKill`): once the runs are under way, a watcher polls the
daemon's processes for a ``git receive-pack`` (a push in flight), SIGKILLs the daemon's
whole process group the moment it sees one (or when none came in a while, said so), keeps
it down, then starts it again on the same port. A push cut there fails at its client as
unreachable (nothing sent) or with an unknown outcome (the pack may have landed): the
worker must read the branch again and never commit a write twice.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ratchet.adapters.gitremote import seed_bare
from ratchet.chaos.drill.schedule import Schedule
from ratchet.chaos.drill.services import NOTE, drill_document
from ratchet.errors import ConfigurationError
from ratchet.fleet.runs import EnvironmentSpec, GitRemoteSpec, RunDocument

__all__ = [
    "BASE_BRANCH",
    "GitSchedule",
    "GitServer",
    "ServerKill",
    "git_document",
    "make_drill_remote",
    "owner_host",
]

#: The branch of the remote every run's branch is made at.
BASE_BRANCH = "main"
#: What the folder profile's workspace holds when a run starts.
INITIAL_FILES = {NOTE: b"draft\n"}
_FOLDER_STAGES = ("workspace_after_intent", "workspace_after_replace")
_GIT_STAGES = ("git_before_push", "git_after_push")
_Maker = Callable[[random.Random], str]


def _kill_at(point: str) -> _Maker:
    """A spec that SIGKILLs the worker at ``point``'s first or second hit (a run writes
    its file twice)."""

    def make(rng: random.Random) -> str:
        return f"{point}=kill@{rng.randint(1, 2)}"

    return make


def make_drill_remote(path: Path) -> str:
    """A bare repository at ``path`` whose ``main`` holds one commit of the drill task's
    initial files (made with dulwich: no ``git`` program needed). Returns the commit id.

    Raises ConfigurationError when ``path`` exists (a drill folder used before)."""
    if path.exists():
        raise ConfigurationError(
            f"{path} exists: the git profile needs a new drill folder (--dir)", path=str(path)
        )
    return seed_bare(
        path,
        INITIAL_FILES,
        branch=BASE_BRANCH,
        message=b"The drill task's initial files\n",
        author=b"ratchet drill <drill@localhost>",
    )


def git_document(url: str, base_url: str, index: int, *, think_ms: int) -> RunDocument:
    """Drill run ``index`` on a branch of the remote at ``url`` (made at submit from
    :data:`BASE_BRANCH`): the folder profile's plan, verifier and orders tenant."""
    plain = drill_document(Path("."), base_url, index, think_ms=think_ms)
    env = EnvironmentSpec(
        kind="git",
        remote=GitRemoteSpec(url=url, base=BASE_BRANCH),
        verifiers=plain.environment.verifiers,
        http_base_url=plain.environment.http_base_url,
    )
    return plain.model_copy(update={"environment": env})


def owner_host(owner: str | None) -> str | None:
    """The host of a lease owner id (``<host name>-<incarnation>-<pid>``: the drill's
    workers take their namespace's host name)."""
    if not owner or owner.count("-") < 2:
        return None
    return owner.rsplit("-", 2)[0]


@dataclass
class GitSchedule(Schedule):
    """The host's kill schedule for git runs: the kills inside the workspace's write aim
    at the push (made, not pushed yet / landed, nothing recorded yet); the folder's
    journal stages never fire for a git run."""

    def _targets(self) -> list[tuple[str, _Maker]]:
        targets = super()._targets()
        out: list[tuple[str, _Maker]] = []
        for point, make in targets:
            if point in _FOLDER_STAGES:
                stage = _GIT_STAGES[_FOLDER_STAGES.index(point)]
                out.append((stage, _kill_at(stage)))
            else:
                out.append((point, make))
        return out


def _git_env(home: Path) -> dict[str, str]:
    """The daemon's environment: no system or user configuration read."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.fspath(home),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _children(pid: int) -> list[int]:
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError):
                text = Path(f"/proc/{pid}/task/{task}/children").read_text()
                found += [int(c) for c in text.split()]
    return found


def _receive_pack(pid: int) -> bool:
    """Whether process ``pid`` serves a push: ``git receive-pack`` or ``git-receive-pack``
    (not the daemon, whose arguments name receive-pack too)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    program = argv[0].rsplit(b"/", 1)[-1]
    return program == b"git-receive-pack" or (program == b"git" and argv[1:2] == [b"receive-pack"])


def _group_members(pgid: int) -> list[int]:
    """Pids of the live (not zombie) processes of process group ``pgid``."""
    found: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # state, ppid, pgrp, ...
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            found.append(int(entry))
    return found


class GitServer:
    """The drill's remote, served by ``git daemon`` on loopback (:attr:`daemon` True) or
    reached over ``file://`` when the ``git`` program is missing.

    The daemon runs in a process group of its own: :meth:`kill` SIGKILLs the group (every
    connection's process with it), :meth:`start` starts it again on the same port. Not
    thread-safe beyond :meth:`pushes_in_flight`, which a watcher thread may call."""

    def __init__(self, repo: Path) -> None:
        self.repo = repo
        self.git = shutil.which("git")
        self.port = _free_port() if self.git else 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.locks_removed: list[str] = []

    def __repr__(self) -> str:
        return f"GitServer(url={self.url!r}, up={self.up})"

    @property
    def daemon(self) -> bool:
        return self.git is not None

    @property
    def url(self) -> str:
        if not self.daemon:
            return self.repo.resolve().as_uri()
        return f"git://127.0.0.1:{self.port}/{self.repo.name}"

    @property
    def up(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, deadline_s: float = 15.0) -> None:
        """Start the daemon (no-op over ``file://``) and wait (bounded) until it accepts
        connections. Raises ConfigurationError when it does not."""
        if self.git is None:
            return
        base = self.repo.parent
        log = base.parent / "logs" / "git-daemon.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:
            self.proc = subprocess.Popen(  # noqa: S603 - fixed argv
                [
                    self.git,
                    "daemon",
                    "--export-all",
                    "--enable=receive-pack",
                    "--reuseaddr",
                    f"--base-path={base}",
                    "--listen=127.0.0.1",
                    f"--port={self.port}",
                    os.fspath(base),
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                env=_git_env(base),
                start_new_session=True,  # its connections' processes go with it
            )
        self.starts += 1
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2),
            ):
                return
            time.sleep(0.02)
        self.kill()
        raise ConfigurationError("the drill's git daemon did not start", port=self.port)

    def pushes_in_flight(self) -> list[int]:
        """Pids of the daemon's ``git receive-pack`` processes (pushes being served)."""
        proc = self.proc
        if proc is None:
            return []
        found: list[int] = []
        todo = [proc.pid]
        seen: set[int] = set()
        while todo and len(seen) < 256:
            pid = todo.pop()
            if pid in seen:
                continue
            seen.add(pid)
            if _receive_pack(pid):
                found.append(pid)
            todo += _children(pid)
        return found

    def kill(self) -> None:
        """SIGKILL the daemon's process group and wait for the daemon; then remove the ref
        lock files the killed processes left (no process holds them any more: a git server
        restarted after a crash needs that, or the branch could never move again)."""
        proc = self.proc
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        deadline = time.monotonic() + 10.0  # every process of the group dead (or a zombie)
        while time.monotonic() < deadline and _group_members(proc.pid):
            time.sleep(0.01)
        self.proc = None
        for lock in (*self.repo.joinpath("refs").rglob("*.lock"), self.repo / "packed-refs.lock"):
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()
                self.locks_removed.append(os.fspath(lock.relative_to(self.repo)))


@dataclass
class ServerKill:
    """One ``git-server-kill``: armed at a fraction of the runs ended; a watcher thread
    kills the daemon the moment a push is in flight (or after ``wait_s`` without one);
    the daemon stays down ``down_s``, then starts again on its port."""

    at: float  # fraction of the runs ended
    log: dict[str, Any]
    wait_s: float = 20.0
    down_s: float = 1.5
    stage: str = "planned"  # planned | watching | down | done
    _thread: threading.Thread | None = None
    _found: dict[str, Any] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _locks_before: int = 0

    def arm(self, server: GitServer) -> None:
        """Start the watcher (the drill checked that runs are in flight)."""
        self.stage = "watching"
        self._locks_before = len(server.locks_removed)
        self.log["armed_at"] = time.time()
        self._thread = threading.Thread(
            target=self._watch, args=(server,), daemon=True, name="git-server-kill"
        )
        self._thread.start()

    def _watch(self, server: GitServer) -> None:
        deadline = time.monotonic() + self.wait_s
        pushing: list[int] = []
        while not self._stop.is_set() and time.monotonic() < deadline:
            pushing = server.pushes_in_flight()
            if pushing:
                break
            time.sleep(0.002)
        if self._stop.is_set():
            return
        pid = server.proc.pid if server.proc is not None else None
        server.kill()
        self._found.update(killed_at=time.time(), pushes_in_flight=len(pushing), daemon_pid=pid)

    def step(self, server: GitServer) -> None:
        """Advance: record the kill once the watcher did it; restart after ``down_s``."""
        if self.stage == "watching":
            if self._thread is None or self._thread.is_alive():
                return
            self.log.update(self._found)
            self.stage = "down"
        if self.stage == "down" and time.time() - float(self.log["killed_at"]) >= self.down_s:
            server.start()
            self.log["restarted_at"] = time.time()
            self.log["down_s"] = round(self.log["restarted_at"] - float(self.log["killed_at"]), 2)
            self.log["ref_locks_removed"] = server.locks_removed[self._locks_before :]
            self.stage = "done"

    def abandon(self, server: GitServer) -> None:
        """The drill ends: stop the watcher, and have the server up again."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.stage == "watching" and self._found:
            self.log.update(self._found)
        if not server.up and server.daemon:
            server.start()
            self.log.setdefault("restarted_at", time.time())
        self.stage = "done"
