"""Reading untrusted ground: a folder that agent-written code could have touched.

A workspace, its ``.git`` and everything beside the allowed files are data ratchet reads,
never programs or configuration it runs (docs/security.md, "The environment is untrusted
ground"). Whatever is found at a path, reading it must neither block, nor act on a
device, nor follow a link out of the folder, nor take in more bytes than a cap. So every
access here keeps these rules:

* A path is resolved **beneath its root, one component at a time**: each folder is opened
  with ``O_DIRECTORY | O_NOFOLLOW`` relative to its parent's descriptor, so no symbolic
  link is followed anywhere in the path, whatever is swapped in meanwhile.
* A file is ``lstat``-ed first and opened only when it is a regular file, then opened with
  ``O_NOFOLLOW | O_NONBLOCK | O_NOCTTY`` and ``fstat``-ed again: same device, same inode,
  still regular. A FIFO is never opened (and, if one is swapped in between the two checks,
  the non-blocking open returns at once and the second check refuses it); a device is
  never opened on purpose; a socket cannot be opened at all.
* Every read is bounded by a cap its caller names, and hashing streams in chunks.

Anything else is refused with :class:`~ratchet.errors.UntrustedGroundError` (never
retryable; ``path``, ``file_type`` and ``reason`` say what was found), without opening it.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ratchet.errors import AdapterError, UntrustedGroundError

__all__ = ["CHUNK", "Ground", "file_type"]

CHUNK = 1 << 16
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def file_type(mode: int) -> str:
    """The name of a file type, as errors and incidents report it."""
    for test, name in (
        (stat.S_ISREG, "regular"),
        (stat.S_ISDIR, "directory"),
        (stat.S_ISLNK, "symlink"),
        (stat.S_ISFIFO, "fifo"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "char_device"),
        (stat.S_ISBLK, "block_device"),
    ):
        if test(mode):
            return name
    return "unknown"


def _refuse(path: str, kind: str, reason: str = "not_regular") -> UntrustedGroundError:
    what = {
        "not_regular": f"is a {kind.replace('_', ' ')}, not a regular file",
        "link_in_path": "goes through a symbolic link or a non-folder",
        "changed": "changed while it was opened",
    }.get(reason, reason)
    return UntrustedGroundError(
        f"workspace path {path} {what}; it is not read", path=path, file_type=kind, reason=reason
    )


class Ground:
    """Read-only access beneath ``root`` under the rules in the module docstring.

    ``root`` itself is trusted (the operator or the signed run document named it); only
    what lies beneath it is ground. Relative paths use ``/`` and never hold ``..``. Each
    call opens and closes its own descriptors; :meth:`lstat_many` and :meth:`walk` keep
    at most one descriptor per folder level open.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"Ground({str(self.root)!r})"

    # -- folders -------------------------------------------------------------------------

    def _open_root(self) -> int:
        return os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    @staticmethod
    def _open_child(parent: int, name: str) -> int | None:
        """A descriptor of folder ``name`` in ``parent``, or None when it is missing, a
        link or not a folder."""
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=parent)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                return None
            raise

    @contextmanager
    def _parent(self, rel: str) -> Iterator[tuple[int | None, str]]:
        """The descriptor of ``rel``'s folder (None: it is not reachable as plain
        folders) and ``rel``'s last component."""
        parts = rel.split("/")
        fd: int | None = self._open_root()
        try:
            for part in parts[:-1]:
                child = self._open_child(fd, part) if fd is not None else None
                if fd is not None:
                    os.close(fd)
                fd = child
                if fd is None:
                    break
            yield fd, parts[-1]
        finally:
            if fd is not None:
                os.close(fd)

    # -- single paths --------------------------------------------------------------------

    def lstat(self, rel: str, *, links_in_path: str = "refuse") -> os.stat_result | None:
        """The path's own ``lstat`` (a link is not followed), or None when it is missing.

        A folder on the way that is a link or not a folder: refused
        (``links_in_path="refuse"``), or reported as missing (``"missing"``, as git sees
        a tracked path behind a link).
        """
        with self._parent(rel) as (parent, name):
            if parent is None:
                if links_in_path == "missing" or not self._link_on_way(rel):
                    return None
                raise _refuse(rel, "symlink", "link_in_path")
            try:
                return os.lstat(name, dir_fd=parent)
            except FileNotFoundError:
                return None

    def _link_on_way(self, rel: str) -> bool:
        """Whether a folder on the way to ``rel`` exists but is not a plain folder."""
        current = self.root
        for part in rel.split("/")[:-1]:
            current = current / part
            try:
                info = os.lstat(current)
            except FileNotFoundError:
                return False
            if not stat.S_ISDIR(info.st_mode):
                return True
        return False

    def readlink(self, rel: str) -> str:
        """The target text of the link at ``rel`` (never followed)."""
        with self._parent(rel) as (parent, name):
            if parent is None:
                raise _refuse(rel, "symlink", "link_in_path")
            return os.readlink(name, dir_fd=parent)

    @contextmanager
    def open(self, rel: str) -> Iterator[tuple[int, os.stat_result] | None]:
        """An open descriptor of the regular file at ``rel`` and its ``fstat``, or None
        when nothing is there.

        Raises:
            UntrustedGroundError: the path is anything but a regular file, or lies
                behind a link.
        """
        with self._parent(rel) as (parent, name):
            if parent is None:
                if self._link_on_way(rel):
                    raise _refuse(rel, "symlink", "link_in_path")
                yield None
                return
            try:
                before = os.lstat(name, dir_fd=parent)
            except FileNotFoundError:
                yield None
                return
            if not stat.S_ISREG(before.st_mode):
                raise _refuse(rel, file_type(before.st_mode))
            try:
                fd = os.open(name, _FILE_FLAGS, dir_fd=parent)
            except FileNotFoundError:
                yield None
                return
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENXIO, errno.ENODEV):
                    raise _refuse(rel, "unknown", "changed") from None
                raise
            try:
                info = os.fstat(fd)
                if not stat.S_ISREG(info.st_mode) or (info.st_dev, info.st_ino) != (
                    before.st_dev,
                    before.st_ino,
                ):
                    raise _refuse(rel, file_type(info.st_mode), "changed")
                yield fd, info
            finally:
                os.close(fd)

    def read(self, rel: str, *, limit: int) -> bytes | None:
        """The whole regular file at ``rel`` (None: missing), at most ``limit`` bytes.

        Raises:
            UntrustedGroundError: not a regular file, behind a link, or larger than
                ``limit`` (``reason="too_large"``; nothing past the cap is read).
        """
        with self.open(rel) as opened:
            if opened is None:
                return None
            fd, info = opened
            if info.st_size > limit:
                raise _too_large(rel, limit)
            data = bytearray()
            while True:
                chunk = os.read(fd, min(CHUNK, limit + 1 - len(data)))
                if not chunk:
                    return bytes(data)
                data += chunk
                if len(data) > limit:  # it grew while read
                    raise _too_large(rel, limit)

    def digest(
        self,
        rel: str,
        new: Callable[[], Any] = hashlib.sha256,
        *,
        prefix: Callable[[int], bytes] | None = None,
    ) -> tuple[str, os.stat_result] | None:
        """Hex digest of the regular file at ``rel`` streamed through ``new()`` (after
        ``prefix(size)`` when given: git's blob header), and the ``fstat`` it was read
        under; None when missing.

        Raises:
            UntrustedGroundError: not a regular file, or behind a link.
            AdapterError: the file changed size while it was read (retryable=True).
        """
        with self.open(rel) as opened:
            if opened is None:
                return None
            fd, info = opened
            hasher = new()
            if prefix is not None:
                hasher.update(prefix(info.st_size))
            seen = 0
            while True:
                chunk = os.read(fd, CHUNK)
                if not chunk:
                    break
                seen += len(chunk)
                hasher.update(chunk)
            if prefix is not None and seen != info.st_size:
                raise AdapterError(
                    "a workspace file changed while it was hashed", retryable=True, path=rel
                )
            return hasher.hexdigest(), info

    # -- folders' contents ---------------------------------------------------------------

    def walk(self, rel: str) -> Iterator[tuple[str, os.stat_result]]:
        """Every entry beneath folder ``rel`` (``""``: the root), depth first in name
        order, as ``(relative path, lstat)``; links and other non-folders are yielded,
        never entered. A folder that vanished or became a link meanwhile is skipped."""
        parts = tuple(p for p in rel.split("/") if p)
        fd: int | None = self._open_root()
        for part in parts:
            child = self._open_child(fd, part) if fd is not None else None
            if fd is not None:
                os.close(fd)
            fd = child
            if fd is None:
                return
        if fd is not None:
            yield from self._walk(fd, parts)

    def _walk(self, fd: int, parts: tuple[str, ...]) -> Iterator[tuple[str, os.stat_result]]:
        """Walk the folder open at ``fd`` (closed when done)."""
        try:
            for name in sorted(os.listdir(fd)):
                try:
                    info = os.lstat(name, dir_fd=fd)
                except FileNotFoundError:
                    continue
                path = (*parts, name)
                yield "/".join(path), info
                if stat.S_ISDIR(info.st_mode):
                    child = self._open_child(fd, name)
                    if child is not None:
                        yield from self._walk(child, path)
        finally:
            os.close(fd)

    def lstat_many(self, rels: list[str]) -> dict[str, os.stat_result | None]:
        """``lstat`` of many paths (None: missing, or behind a link or a non-folder, as
        git sees a tracked path there), visiting each folder once: the paths are taken
        in sorted order, keeping one open descriptor per folder level."""
        out: dict[str, os.stat_result | None] = {}
        stack: list[tuple[str, int | None]] = []  # the open folders, root first
        root = self._open_root()
        try:
            for rel in sorted(rels):
                parts = rel.split("/")
                folders = parts[:-1]
                keep = 0
                while keep < min(len(stack), len(folders)) and stack[keep][0] == folders[keep]:
                    keep += 1
                for _, fd in stack[keep:]:
                    if fd is not None:
                        os.close(fd)
                del stack[keep:]
                for part in folders[keep:]:
                    parent = stack[-1][1] if stack else root
                    stack.append(
                        (part, self._open_child(parent, part) if parent is not None else None)
                    )
                parent = stack[-1][1] if stack else root
                if parent is None:
                    out[rel] = None
                    continue
                try:
                    out[rel] = os.lstat(parts[-1], dir_fd=parent)
                except FileNotFoundError:
                    out[rel] = None
        finally:
            for _, fd in stack:
                if fd is not None:
                    os.close(fd)
            os.close(root)
        return out


def _too_large(rel: str, limit: int) -> UntrustedGroundError:
    return UntrustedGroundError(
        f"workspace path {rel} is larger than {limit} bytes; it is not read",
        path=rel,
        file_type="regular",
        reason="too_large",
        limit=limit,
    )
