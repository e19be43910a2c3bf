"""File-system helpers for the workspace adapter: allowed paths, hashing, atomic
replacement.

Nothing here keeps state; :mod:`ratchet.adapters.workspace` decides when to call what.
Everything read from the workspace goes through :class:`~ratchet.adapters.ground.Ground`
(no link followed, no FIFO or device opened, reads capped); what its git repository says
comes from :mod:`ratchet.adapters.gitread`, which runs no program.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePosixPath

from ratchet.adapters.gitread import GitState
from ratchet.adapters.ground import Ground, file_type
from ratchet.errors import ConfigurationError, UntrustedGroundError
from ratchet.runtime.canonical import Domain, digest
from ratchet.runtime.types import check_rel_path

__all__ = [
    "STATE_DIR",
    "AllowedPaths",
    "atomic_delete",
    "atomic_replace",
    "content_sha",
    "file_sha",
    "fingerprint",
    "fsync_dir",
    "write_temp",
]

STATE_DIR = ".ratchet"


def content_sha(data: bytes) -> str:
    """SHA-256 hex of file bytes (what the journal and the fingerprint record)."""
    return hashlib.sha256(data).hexdigest()


def file_sha(ground: Ground, path: str) -> str | None:
    """SHA-256 hex of the regular file at ``path`` beneath ``ground``, or None when there
    is no such file.

    Raises:
        UntrustedGroundError: the path is something else (a FIFO, a device, a socket, a
            folder, a link) or lies behind a link; it is not opened.
    """
    found = ground.digest(path)
    return None if found is None else found[0]


class AllowedPaths:
    """The relative paths (files or folders) an adapter may write and fingerprints.

    Raises (constructor):
        ConfigurationError: a path is not canonical and relative, or lies in the state
            folder.
    """

    def __init__(self, paths: Iterable[str]) -> None:
        checked: list[str] = []
        for raw in paths:
            try:
                path = check_rel_path(raw)
            except ValueError as exc:
                raise ConfigurationError(f"allowed path {raw!r}: {exc}", path=raw) from None
            if path.split("/")[0] == STATE_DIR:
                raise ConfigurationError("the state folder cannot be an allowed path", path=raw)
            checked.append(path)
        if not checked:
            raise ConfigurationError("a workspace needs at least one allowed path")
        self.paths: tuple[str, ...] = tuple(sorted(set(checked)))

    def __contains__(self, path: object) -> bool:
        if not isinstance(path, str):
            return False
        p = PurePosixPath(path)
        return any(p == PurePosixPath(a) or PurePosixPath(a) in p.parents for a in self.paths)

    def files(self, ground: Ground) -> dict[str, str]:
        """``{relative path: sha256}`` of every regular file under the allowed paths.

        Symbolic links are recorded by their target text (never followed), so a link
        pointing out of the workspace cannot widen what is read or written.

        Raises:
            UntrustedGroundError: an allowed path (or an entry under an allowed folder) is
                a FIFO, a socket or a device, or lies behind a link; nothing of it is
                opened.
        """
        out: dict[str, str] = {}
        for allowed in self.paths:
            info = ground.lstat(allowed)
            if info is None:
                continue
            if stat.S_ISDIR(info.st_mode):
                for rel, entry in ground.walk(allowed):
                    _record(ground, rel, entry, out)
            else:
                _record(ground, allowed, info, out)
        return out


def _record(ground: Ground, rel: str, info: os.stat_result, out: dict[str, str]) -> None:
    if stat.S_ISDIR(info.st_mode):
        return
    if stat.S_ISLNK(info.st_mode):
        out[rel] = "symlink:" + ground.readlink(rel)
    elif stat.S_ISREG(info.st_mode):
        out[rel] = file_sha(ground, rel) or ""
    else:
        kind = file_type(info.st_mode)
        raise UntrustedGroundError(
            f"workspace path {rel} is a {kind.replace('_', ' ')}, not a regular file; "
            "it is not read",
            path=rel,
            file_type=kind,
            reason="not_regular",
        )


def fingerprint(files: Mapping[str, str], git: GitState | None) -> str:
    """The workspace fingerprint: allowed files by hash, plus HEAD and the dirty flag."""
    git_part = None if git is None else {"head": git.head, "dirty": git.dirty}
    return digest(Domain.ENVIRONMENT, {"files": dict(files), "git": git_part})


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename or unlink inside it is durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_temp(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` (created or truncated) and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_replace(temp: Path, target: Path) -> None:
    """Rename an fsynced temp file over ``target`` and fsync the target's folder.

    Creates missing parent folders (each made durable in its own parent).
    """
    _make_parents(target.parent)
    os.replace(temp, target)
    fsync_dir(target.parent)


def atomic_delete(target: Path) -> None:
    """Unlink ``target`` and fsync its folder."""
    target.unlink()
    fsync_dir(target.parent)


def _make_parents(folder: Path) -> None:
    missing: list[Path] = []
    current = folder
    while not current.exists():
        missing.append(current)
        current = current.parent
    for item in reversed(missing):
        item.mkdir(exist_ok=True)
        fsync_dir(item.parent)
