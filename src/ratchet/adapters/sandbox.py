"""Confinement for agent-written code: how verifier commands are run.

A verifier runs tests the agent wrote, so it must never reach what the worker holds: the
checkpoint key ring, the worker's environment and processes, the adapter's journal. The
worker never puts key material in a child's environment (the verifier's environment is
built from scratch), and on top of that the command runs confined, by an existing tool
rather than a home-made one:

``bwrap`` (bubblewrap, Debian's ``bubblewrap`` package; the default where it works)
    own user, pid, network, mount, ipc and uts namespaces (``--unshare-all``; the network
    only when the verifier spec allows it), a fresh ``/proc`` (only the command's own
    processes), ``/dev`` and ``/tmp``; the system directories and the command's own
    install prefix (a virtualenv) read-only; the workspace **read-only**, its ``.git``
    included (the code a verifier runs can change neither its own tests, nor a module
    beside them, nor the repository's configuration), with the adapter's state folder
    replaced by an empty one (the journal, receipts and lock stay out of reach) and only
    the verifier's own home and temp folders bound back read-write; every key and trust
    file the worker was configured with masked by ``/dev/null``; ``--clearenv`` and the
    verifier's environment only; ``--die-with-parent`` so nothing outlives it.
``uid`` (where bwrap cannot run and the worker is root)
    the command runs as a separate unprivileged uid (``RATCHET_VERIFIER_UID``); the worker
    marks itself not dumpable (``PR_SET_DUMPABLE=0``), so another uid cannot read its
    ``/proc/<pid>/environ`` or memory; key files must not be readable by that uid (they
    are checked when the sandbox is built), and before every run nothing in the
    workspace may be writable by it (owned by it, or group- or world-writable): a
    workspace it could write is refused, since the code it runs could change what the
    verifier reads.
``none`` (``RATCHET_VERIFIER_SANDBOX=none``)
    an explicit operator opt-out, logged at every worker start. Otherwise, when no
    confinement is possible, verifier runs are refused
    (:class:`~ratchet.errors.ConfigurationError`), never run unconfined by default.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import shutil
import stat
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from ratchet.adapters.ground import Ground
from ratchet.errors import ConfigurationError

__all__ = ["SYSTEM_DIRS", "Sandbox", "SandboxMode", "bwrap_works", "for_own_verifiers"]

log = logging.getLogger("ratchet.sandbox")

#: Read-only inside a bwrap sandbox (those that exist on the host).
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
_PR_SET_DUMPABLE = 4


class SandboxMode(StrEnum):
    AUTO = "auto"
    BWRAP = "bwrap"
    UID = "uid"
    NONE = "none"


@functools.cache
def bwrap_works(binary: str) -> bool:
    """Whether ``binary`` can set up the namespaces the sandbox uses, here (cached)."""
    argv = [binary, "--unshare-all", "--die-with-parent", "--new-session"]
    for d in SYSTEM_DIRS:
        if Path(d).exists():
            argv += ["--ro-bind", d, d]
    argv += ["--proc", "/proc", "--dev", "/dev", "--", "/bin/true"]
    try:
        done = subprocess.run(  # noqa: S603
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def for_own_verifiers() -> SandboxMode:
    """For ratchet's own demos, drills and benchmarks, whose verifiers are their own
    commands (grep, the example's test), not agent-written code: bubblewrap where it
    works, else the opt-out, which they report. Never for a user's fleet."""
    binary = shutil.which("bwrap")
    return SandboxMode.BWRAP if binary is not None and bwrap_works(binary) else (SandboxMode.NONE)


def _outside_system(path: Path) -> bool:
    return not any(path == Path(d) or Path(d) in path.parents for d in SYSTEM_DIRS)


def _prefixes_of(program: str) -> list[Path]:
    """The install prefixes to bind read-only for ``program`` when it lives outside the
    system directories: its virtualenv (the folder with ``pyvenv.cfg``) and the base
    installation that virtualenv points at (``home``), or the folder above its ``bin``;
    the same for the file its symlinks resolve to."""
    path = Path(program)
    if not path.is_absolute():
        return []
    found: list[Path] = []
    for candidate in (path, path.resolve()):
        if not _outside_system(candidate):
            continue
        venv = next(
            (parent for parent in list(candidate.parents)[:4] if (parent / "pyvenv.cfg").is_file()),
            None,
        )
        if venv is not None:
            found.append(venv)
            for line in (venv / "pyvenv.cfg").read_text(errors="replace").splitlines():
                name, _, value = line.partition("=")
                if name.strip() == "home" and value.strip():
                    base = Path(value.strip()).parent
                    if _outside_system(base):
                        found.append(base)
        else:
            parent = candidate.parent
            found.append(parent.parent if parent.name == "bin" else parent)
    return list(dict.fromkeys(found))


def _make_not_dumpable() -> None:
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        raise ConfigurationError("cannot find libc to set PR_SET_DUMPABLE")
    libc = ctypes.CDLL(libc_name, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise ConfigurationError("prctl(PR_SET_DUMPABLE, 0) failed")


@dataclass(frozen=True, slots=True)
class Sandbox:
    """A resolved way to run verifier commands. Build it with :meth:`resolve`.

    ``masked`` are files (key rings, trust files) hidden inside a bwrap sandbox;
    ``read_only`` extra host paths the command may read.
    """

    mode: SandboxMode
    bwrap: str | None = None
    uid: int | None = None
    gid: int | None = None
    masked: tuple[Path, ...] = ()
    read_only: tuple[Path, ...] = ()
    unavailable: str = ""  # why no confinement was possible (the mode is then AUTO)
    _marked: list[bool] = field(default_factory=list, repr=False, compare=False)

    @classmethod
    def resolve(
        cls,
        mode: SandboxMode | str = SandboxMode.AUTO,
        *,
        uid: int | None = None,
        masked: Iterable[str | os.PathLike[str]] = (),
        read_only: Iterable[str | os.PathLike[str]] = (),
        bwrap: str | None = None,
    ) -> Sandbox:
        """Pick the confinement ``mode`` asks for (``auto``: bwrap, else uid, else none
        possible).

        Raises:
            ConfigurationError: an explicit ``bwrap`` that cannot run here, ``uid``
                without a uid or without root, or a key file the uid could read.
        """
        mode = SandboxMode(mode)
        hidden = tuple(Path(p).resolve() for p in masked)
        extra = tuple(Path(p).resolve() for p in read_only)
        binary = bwrap or shutil.which("bwrap")
        if mode is SandboxMode.NONE:
            return cls(SandboxMode.NONE, masked=hidden, read_only=extra)
        if mode in (SandboxMode.AUTO, SandboxMode.BWRAP):
            if binary is not None and bwrap_works(binary):
                return cls(SandboxMode.BWRAP, bwrap=binary, masked=hidden, read_only=extra)
            if mode is SandboxMode.BWRAP:
                raise ConfigurationError(
                    "RATCHET_VERIFIER_SANDBOX=bwrap but bwrap cannot "
                    "run here (install Debian's bubblewrap; it needs "
                    "user namespaces or root)",
                    field="verifier_sandbox",
                )
            if uid is None:
                return cls(
                    SandboxMode.AUTO,
                    masked=hidden,
                    read_only=extra,
                    unavailable=(
                        "bwrap is missing or cannot run here and no RATCHET_VERIFIER_UID is set"
                    ),
                )
        if uid is None:
            raise ConfigurationError(
                "RATCHET_VERIFIER_SANDBOX=uid needs RATCHET_VERIFIER_UID", field="verifier_uid"
            )
        if os.geteuid() != 0:
            raise ConfigurationError(
                "running verifiers as another uid needs a root worker", field="verifier_uid"
            )
        if uid == 0:
            raise ConfigurationError("the verifier uid must not be root", field="verifier_uid")
        for path in hidden:
            try:
                info = path.stat()
            except OSError:
                continue
            readable = info.st_uid == uid or bool(info.st_mode & stat.S_IROTH)
            if readable:
                raise ConfigurationError(
                    f"{path} is readable by the verifier uid {uid}; make it owner-only (0600)",
                    field="verifier_uid",
                )
        return cls(SandboxMode.UID, uid=uid, gid=uid, masked=hidden, read_only=extra)

    @property
    def confined(self) -> bool:
        return self.mode in (SandboxMode.BWRAP, SandboxMode.UID)

    def check_usable(self) -> None:
        """Raises ConfigurationError when verifier runs must be refused here."""
        if self.mode is SandboxMode.AUTO:
            raise ConfigurationError(
                "verifier commands run agent-written code and no sandbox is available: "
                f"{self.unavailable}; install bubblewrap, set RATCHET_VERIFIER_UID, or opt "
                "out with RATCHET_VERIFIER_SANDBOX=none",
                field="verifier_sandbox",
            )

    def command(
        self,
        argv: Sequence[str],
        *,
        cwd: Path,
        env: Mapping[str, str],
        workspace: Path,
        state_dir: Path,
        writable: Sequence[Path],
        network: bool = False,
        workspace_writable: bool = False,
        inherit_env: bool = False,
    ) -> tuple[list[str], dict[str, str], dict[str, Any]]:
        """What to start for ``argv``: (argv, environment, extra ``Popen`` arguments).

        ``workspace`` is bound read-only (read-write only with ``workspace_writable``: a
        shell tool's own scratch folder) with ``state_dir`` emptied inside it, then
        ``writable`` (the verifier's home and temp folders) bound back read-write.
        With ``inherit_env`` the sandboxed program keeps the environment it is started
        with (returned, for the caller to start it with, which must hold nothing but
        ``env``): nothing of ``env`` goes into the command line, where other users of the
        host could read a secret.

        Raises ConfigurationError (see :meth:`check_usable`; in ``uid`` mode, a
        workspace path the uid could write).
        """
        self.check_usable()
        if self.mode is SandboxMode.NONE:
            return list(argv), dict(env), {}
        if self.mode is SandboxMode.UID:
            if not self._marked:
                _make_not_dumpable()
                self._marked.append(True)
            if not workspace_writable:
                self._check_not_writable(workspace, state_dir)
            return list(argv), dict(env), {"user": self.uid, "group": self.gid, "extra_groups": []}
        if self.bwrap is None:  # for the type checker: BWRAP always has its binary
            raise ConfigurationError("bwrap sandbox without a binary")
        args = [self.bwrap, "--unshare-all", "--die-with-parent", "--new-session"]
        if not inherit_env:
            args.append("--clearenv")
        if network:
            args.append("--share-net")
        bound: list[Path] = []
        for d in SYSTEM_DIRS:
            if Path(d).exists():
                args += ["--ro-bind", d, d]
                bound.append(Path(d))
        # Mounts apply in order: the fresh /tmp comes before anything bound below it (a
        # virtualenv or a workspace under /tmp stays visible).
        args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]  # noqa: S108 - a fresh tmpfs inside the sandbox
        prefixes = _prefixes_of(argv[0]) if argv else []
        for path in (*self.read_only, *prefixes):
            if path.exists():
                args += ["--ro-bind", str(path), str(path)]
                bound.append(path)
        bind = "--bind" if workspace_writable else "--ro-bind"
        args += [bind, str(workspace), str(workspace), "--tmpfs", str(state_dir)]
        for path in writable:
            args += ["--bind", str(path), str(path)]
        bound.append(workspace)
        for path in self.masked:
            visible = any(path == b or b in path.parents for b in bound)
            if visible and path.exists():
                args += ["--ro-bind", "/dev/null", str(path)]
        args += ["--chdir", str(cwd)]
        if inherit_env:
            return [*args, "--", *argv], dict(env), {}
        for name, value in env.items():
            args += ["--setenv", name, value]
        return [*args, "--", *argv], {}, {}

    def _check_not_writable(self, workspace: Path, state_dir: Path) -> None:
        """In ``uid`` mode: nothing in ``workspace`` (but the state folder) may be
        writable by the verifier's uid, or the code it runs could rewrite its own test.

        Raises:
            ConfigurationError: names the first such path.
        """
        ground = Ground(workspace)
        skip = state_dir.name if state_dir.parent == workspace else None
        root = workspace.stat()
        entries: list[tuple[str, os.stat_result]] = [(".", root)]
        for rel, info in ground.walk(""):
            if skip is not None and (rel == skip or rel.startswith(skip + "/")):
                continue
            entries.append((rel, info))
        for rel, info in entries:
            if stat.S_ISLNK(info.st_mode):
                continue  # a link's own mode means nothing; its target is checked itself
            if (
                info.st_uid == self.uid
                or info.st_mode & stat.S_IWOTH
                or (info.st_mode & stat.S_IWGRP and info.st_gid == self.gid)
            ):
                raise ConfigurationError(
                    f"workspace path {rel} is writable by the verifier uid {self.uid}: the "
                    "code it runs could change what the verifier reads; make the workspace "
                    "owned by another user and not group- or world-writable",
                    field="verifier_uid",
                    path=rel,
                )

    def describe(self) -> str:
        """One line for the worker's start-up log."""
        if self.mode is SandboxMode.BWRAP:
            return f"verifier sandbox: bwrap ({self.bwrap})"
        if self.mode is SandboxMode.UID:
            return f"verifier sandbox: separate uid {self.uid}"
        if self.mode is SandboxMode.NONE:
            return (
                "verifier sandbox: NONE (RATCHET_VERIFIER_SANDBOX=none): agent-written "
                "tests run unconfined, as the worker's uid"
            )
        return f"verifier sandbox: unavailable ({self.unavailable}); verifier runs refused"
