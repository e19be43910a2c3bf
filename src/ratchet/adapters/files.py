"""File-system helpers for the workspace adapter: allowed paths, hashing, atomic
replacement, and what git says about the tree.

Nothing here keeps state; :mod:`ratchet.adapters.workspace` decides when to call what.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ratchet.errors import AdapterError, ConfigurationError
from ratchet.runtime.canonical import Domain, digest
from ratchet.runtime.types import check_rel_path

__all__ = [
    "STATE_DIR",
    "AllowedPaths",
    "GitState",
    "atomic_delete",
    "atomic_replace",
    "content_sha",
    "file_sha",
    "fingerprint",
    "fsync_dir",
    "git_state",
    "is_git_repo",
    "predict_git_dirty",
    "write_temp",
]

STATE_DIR = ".ratchet"
_GIT_TIMEOUT_SECONDS = 30.0


def content_sha(data: bytes) -> str:
    """SHA-256 hex of file bytes (what the journal and the fingerprint record)."""
    return hashlib.sha256(data).hexdigest()


def file_sha(path: Path) -> str | None:
    """SHA-256 hex of a regular file's bytes, or None when there is no such file.

    Raises:
        AdapterError: the path exists but is not a regular file (retryable=False).
    """
    try:
        with path.open("rb") as handle:
            hasher = hashlib.sha256()
            for chunk in iter(lambda: handle.read(1 << 16), b""):
                hasher.update(chunk)
            return hasher.hexdigest()
    except FileNotFoundError:
        return None
    except (IsADirectoryError, NotADirectoryError):
        raise AdapterError(
            "path is not a regular file", retryable=False, path=str(path.name)
        ) from None


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

    def files(self, root: Path) -> dict[str, str]:
        """``{relative path: sha256}`` of every regular file under the allowed paths.

        Symbolic links are recorded by their target text (never followed), so a link
        pointing out of the workspace cannot widen what is read or written.
        """
        out: dict[str, str] = {}
        for allowed in self.paths:
            base = root / allowed
            if base.is_symlink():
                out[allowed] = "symlink:" + os.readlink(base)
            elif base.is_file():
                out[allowed] = file_sha(base) or ""
            elif base.is_dir():
                for dirpath, dirnames, filenames in os.walk(base, followlinks=False):
                    dirnames.sort()
                    for name in sorted(filenames) + [
                        d for d in dirnames if Path(dirpath, d).is_symlink()
                    ]:
                        full = Path(dirpath, name)
                        rel = full.relative_to(root).as_posix()
                        if full.is_symlink():
                            out[rel] = "symlink:" + os.readlink(full)
                        elif full.is_file():
                            out[rel] = file_sha(full) or ""
        return out


@dataclass(frozen=True, slots=True)
class GitState:
    """HEAD commit and whether tracked files differ from it (worktree or index)."""

    head: str
    dirty: bool
    changed: frozenset[str]  # tracked paths with changes, relative to the repository


def fingerprint(files: Mapping[str, str], git: GitState | None) -> str:
    """The workspace fingerprint: allowed files by hash, plus HEAD and the dirty flag."""
    git_part = None if git is None else {"head": git.head, "dirty": git.dirty}
    return digest(Domain.ENVIRONMENT, {"files": dict(files), "git": git_part})


def _git_env() -> dict[str, str]:
    # A clean environment: no inherited GIT_DIR / GIT_WORK_TREE, no optional locks (an
    # observation must not take index.lock from under a concurrent git command).
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "GIT_OPTIONAL_LOCKS": "0",
        "GIT_CONFIG_NOSYSTEM": "1",
        "HOME": os.devnull,
        "LC_ALL": "C",
    }


def _git(root: Path, args: Sequence[str], stdin: bytes | None = None) -> bytes:
    git = shutil.which("git")
    if git is None:
        raise AdapterError("git is not installed", retryable=False)
    try:
        done = subprocess.run(  # noqa: S603 - fixed argv, no shell
            [git, "-C", str(root), *args],
            input=stdin,
            capture_output=True,
            env=_git_env(),
            timeout=_GIT_TIMEOUT_SECONDS,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise AdapterError(
            "git could not be run", retryable=True, error=type(exc).__name__
        ) from None
    if done.returncode != 0:
        raise AdapterError(
            "git failed", retryable=True, command=args[0], returncode=done.returncode
        )
    return done.stdout


def is_git_repo(root: Path) -> bool:
    """True when ``root`` is the top of a git work tree (a ``.git`` entry exists)."""
    return (root / ".git").exists()


def git_state(root: Path) -> GitState:
    """Read HEAD and the tracked changes of the repository at ``root``.

    Untracked files do not make the tree dirty (the state folder, caches and new files
    the allowed-file fingerprint already covers would otherwise flip it).

    Raises:
        AdapterError: git failed (retryable=True).
    """
    head = _git(root, ["rev-parse", "--verify", "-q", "HEAD"]).decode().strip() or "unborn"
    status = _git(
        root, ["status", "--porcelain=v1", "-z", "--untracked-files=no", "--ignore-submodules=none"]
    )
    changed: set[str] = set()
    entries = status.split(b"\0")
    i = 0
    while i < len(entries):
        entry = entries[i]
        i += 1
        if len(entry) < 4:
            continue
        changed.add(entry[3:].decode("utf-8", "surrogateescape"))
        if entry[:1] in (b"R", b"C"):  # a rename carries its source path next
            i += 1
    return GitState(head=head, dirty=bool(changed), changed=frozenset(changed))


def predict_git_dirty(root: Path, state: GitState, path: str, content: bytes | None) -> bool:
    """Whether the tree would be dirty after writing ``content`` to ``path`` (None deletes).

    The path is dirty afterwards when its index entry differs from HEAD's, or the new
    content differs from the index entry; an untracked path never counts.

    Raises:
        AdapterError: git failed (retryable=True).
    """
    others = any(p != path for p in state.changed)
    if others:
        return True
    staged = _git(root, ["ls-files", "-s", "-z", "--", path]).split(b"\0")[0]
    index_blob = staged.split(b" ")[1].decode() if staged else None
    head_blob = None
    if state.head != "unborn":
        listed = _git(root, ["ls-tree", "-z", "HEAD", "--", path]).split(b"\0")[0]
        head_blob = listed.split(b" ")[2].split(b"\t")[0].decode() if listed else None
    if index_blob is None and head_blob is None:
        return False  # untracked
    if index_blob != head_blob:
        return True
    if content is None:
        return True  # deleting a tracked file
    new_blob = _git(root, ["hash-object", f"--path={path}", "--stdin"], stdin=content)
    return new_blob.decode().strip() != index_blob


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
