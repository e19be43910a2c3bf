"""A simulated host: a mount and UTS namespace with its own disk at a shared path.

Each host is one ``unshare --mount --uts --propagation private`` process (the *holder*)
that binds the host's disk (``backing``, a folder of the drill) at ``mountpoint`` and
sets its host name, then sleeps. Every process of the host is started with ``nsenter``
into the holder's namespaces, its working directory the host's disk. Two hosts see two
different disks at the same path, as two machines with one workspace volume each do.

Losing the host SIGKILLs every process whose mount namespace is the holder's (the
holder too): with no process left, the namespace and its bind mount are gone, and the
disk is unreachable at the mount point. The host comes back as a new namespace on the
same backing folder, under the same name.

Hosts share the drill's network namespace, so the store and the orders service stay on
loopback. Root and util-linux (``unshare``, ``nsenter``, ``mount``) are needed:
:func:`namespaces_usable` says why not, when not.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from ratchet.errors import ConfigurationError

__all__ = ["HostNamespace", "namespaces_usable"]

_TOOLS = ("unshare", "nsenter", "mount", "hostname", "sleep")


def namespaces_usable() -> str | None:
    """Why hosts cannot be simulated here (None: they can)."""
    if os.geteuid() != 0:
        return "hosts are mount and UTS namespaces: root is needed"
    for tool in _TOOLS:
        if shutil.which(tool) is None:
            return f"{tool} (util-linux / coreutils) is not installed"
    return None


def _mount_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def _members(namespace: str) -> list[int]:
    """Pids of every process in the mount namespace ``namespace``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _mount_ns(int(entry)) == namespace:
            found.append(int(entry))
    return found


class HostNamespace:
    """One simulated host (see the module docstring). Not thread-safe."""

    def __init__(self, name: str, backing: Path, mountpoint: Path) -> None:
        self.name = name
        self.backing = backing
        self.mountpoint = mountpoint
        self.holder: subprocess.Popen[bytes] | None = None
        self.procs: list[subprocess.Popen[bytes]] = []  # started here, reaped on loss
        self.namespace: str | None = None

    def __repr__(self) -> str:
        return f"HostNamespace({self.name!r}, up={self.up})"

    @property
    def up(self) -> bool:
        return self.holder is not None and self.holder.poll() is None

    def start(self, deadline_s: float = 30.0) -> None:
        """Make the namespace and wait (bounded) until the disk is bound and the name set.

        Raises ConfigurationError when it does not come up."""
        self.backing.mkdir(parents=True, exist_ok=True)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        script = 'mount --bind "$0" "$1" && hostname "$2" && exec sleep infinity'
        self.holder = subprocess.Popen(  # noqa: S603 - fixed argv
            [  # noqa: S607 - util-linux from PATH, as an operator runs it
                "unshare",
                "--mount",
                "--uts",
                "--propagation",
                "private",
                "sh",
                "-c",
                script,
                os.fspath(self.backing),
                os.fspath(self.mountpoint),
                self.name,
            ],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if self.holder.poll() is not None:
                break
            if self._comm(self.holder.pid) == "sleep":  # mount and hostname succeeded
                self.namespace = _mount_ns(self.holder.pid)
                return
            time.sleep(0.02)
        self.lose()
        raise ConfigurationError(f"host {self.name} did not come up", host=self.name)

    @staticmethod
    def _comm(pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            return ""

    def enter(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the host, its working directory the host's disk.

        (nsenter's ``--wd`` resolves its folder before it enters: the shell cds inside.)
        Raises ConfigurationError when the host is down."""
        if self.holder is None or not self.up:
            raise ConfigurationError(f"host {self.name} is down", host=self.name)
        into = ["sh", "-c", 'cd "$0" && exec "$@"', os.fspath(self.mountpoint)]
        return ["nsenter", "-t", str(self.holder.pid), "-m", "-u", "--", *into, *argv]

    def popen(
        self,
        argv: Sequence[str],
        *,
        env: dict[str, str],
        log: Path,
        stdin: int | None = subprocess.DEVNULL,
        stdout: int | IO[bytes] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` in the host (its stderr, and stdout unless piped, to ``log``).
        nsenter execs (no pid namespace is entered), so the pid is the program's."""
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:
            proc = subprocess.Popen(  # noqa: S603 - argv built here
                self.enter(argv),
                env=env,
                stdin=stdin,
                stdout=out if stdout is None else stdout,
                stderr=out,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def run(
        self, argv: Sequence[str], *, env: dict[str, str], timeout_s: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in the host to its end (bounded by ``timeout_s``)."""
        return subprocess.run(  # noqa: S603 - argv built here
            self.enter(argv),
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )

    def reap(self) -> None:
        """Forget processes of the host that exited (each waited for)."""
        self.procs = [p for p in self.procs if p.poll() is None]

    def lose(self, deadline_s: float = 30.0) -> list[int]:
        """Lose the host whole: SIGKILL every process in its mount namespace (also those
        the drill did not start itself: a verifier a worker ran), wait for the drill's
        own, and wait (bounded) until no process is left in the namespace, so its mount is
        gone. Returns the pids killed. Raises ConfigurationError if processes stay."""
        killed: list[int] = []
        namespace = self.namespace
        deadline = time.monotonic() + deadline_s
        while namespace is not None:
            members = _members(namespace)
            if not members:
                break
            for pid in members:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
                    if pid not in killed:
                        killed.append(pid)
            for proc in (*self.procs, self.holder):
                if proc is not None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=0.05)
            if time.monotonic() > deadline:
                raise ConfigurationError(
                    f"processes of host {self.name} survived SIGKILL", pids=str(members[:10])
                )
            time.sleep(0.02)
        for proc in (*self.procs, self.holder):
            if proc is not None and proc.poll() is None:  # never entered the namespace
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        self.procs.clear()
        self.holder = None
        self.namespace = None
        return killed
