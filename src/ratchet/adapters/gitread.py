"""What a workspace's git repository says, read as data: HEAD, the index and objects.

ratchet never runs ``git`` on a folder agent-written code could have written: ``git
status`` honours the repository's own configuration (``core.fsmonitor`` runs a program
of the repository's choosing, as the caller, on every status; so do hooks, filter and
diff drivers, ``includeIf``d files). This module reads the few facts the workspace
fingerprint needs straight from the files, with dulwich's parsers over bytes read under
:class:`~ratchet.adapters.ground.Ground`'s rules (no link followed, no FIFO opened,
every read capped):

* **HEAD**: ``.git/HEAD``, a loose ref or ``packed-refs`` (symbolic refs followed at most
  five deep); a repository without a commit is ``unborn``.
* **Objects** (:mod:`ratchet.adapters.gitobjects`): loose or packed, each inflated to at
  most its declared size and the cap, its id checked against its bytes. Only commits and
  trees are read, never blobs.
* **The index**: parsed by dulwich from its bytes.

The repository's configuration is never read (nothing it says could change these facts
without a program running), so none of its settings applies: no filter, no
``core.autocrlf``, no fsmonitor, no hooks. ``git status --untracked-files=no`` is
reproduced as git computes it: the index against HEAD (tree ids computed from the index
and compared subtree by subtree), and each tracked work-tree file against its index entry
(the entry's stat data first, as git does, then the file's bytes hashed as a blob). Where
git would run a clean filter (LFS, ``eol`` conversion) a file whose bytes differ from its
blob counts as changed.

Refused with a typed error (never guessed): a ``.git`` that is not a folder (a linked
work tree's or submodule's ``.git`` file), reftable refs, SHA-256 repositories, a split
index, an object over the cap.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from dulwich.index import (
    EXTENDED_FLAG_INTEND_TO_ADD,
    EXTENDED_FLAG_SKIP_WORKTREE,
    FLAG_VALID,
    ConflictedIndexEntry,
    IndexEntry,
    read_index_dict_with_version,
)
from dulwich.objects import Tree

from ratchet.adapters.gitobjects import (
    GIT_DIR,
    HEX,
    TREE_MODE,
    ObjectStore,
    corrupt,
    stat_key,
    unsupported,
)
from ratchet.adapters.ground import Ground
from ratchet.errors import UntrustedGroundError

__all__ = ["GitReader", "GitState", "blob_id", "state_facts"]

MAX_INDEX_BYTES = 256 << 20
MAX_REF_BYTES = 4096
MAX_PACKED_REFS_BYTES = 64 << 20
_MAX_SYMREF_DEPTH = 5
_REFNAME = re.compile(r"^refs/[A-Za-z0-9._/+@-]{1,200}$")
_GITLINK = 0o160000
_LINK = 0o120000


@dataclass(frozen=True, slots=True)
class GitState:
    """HEAD commit and whether tracked files differ from it (work tree or index)."""

    head: str
    dirty: bool
    changed: frozenset[str]  # tracked paths with changes, relative to the repository


def blob_id(data: bytes) -> str:
    """The git blob id of ``data`` (no filter applied)."""
    return hashlib.sha1(b"blob %d\x00" % len(data) + data, usedforsecurity=False).hexdigest()


def _split_time(value: object) -> tuple[int, int]:
    if isinstance(value, tuple):
        return int(value[0]), int(value[1])
    if isinstance(value, int):
        return value, 0
    seconds = float(value)  # type: ignore[arg-type]
    return int(seconds), int((seconds - int(seconds)) * 1e9)


def _entry_mode(mode: int) -> int:
    if stat.S_ISLNK(mode):
        return _LINK
    if stat.S_ISDIR(mode) or mode & 0o170000 == _GITLINK:
        return _GITLINK
    return 0o100755 if mode & 0o100 else 0o100644


@dataclass
class _Index:
    """A parsed index: stage-0 entries by path, conflicted paths, the index file's mtime
    (git's racy-clean rule) and, computed once, the tree ids of every folder."""

    entries: dict[str, IndexEntry]
    conflicted: frozenset[str]
    mtime_ns: int
    trees: dict[str, str] = field(default_factory=dict)  # folder ("" = root) -> tree id
    folders: dict[str, dict[str, tuple[int, str]]] = field(default_factory=dict)


class GitReader:
    """Facts of the repository whose ``.git`` folder is at ``ground``'s root.

    Caches what only changes with the files it came from (the parsed index and pack
    indexes, keyed by their ``stat``; the work tree's blob ids, keyed by each file's
    ``stat``), so a repeated status costs one ``lstat`` per tracked file.

    Raises (every method): AdapterError (``reason="git"`` for an unsupported repository,
    ``"git_corrupt"`` for unreadable bytes; never retryable), UntrustedGroundError.
    """

    def __init__(self, ground: Ground) -> None:
        self.ground = ground
        self.objects = ObjectStore(ground)
        self._index: tuple[tuple[int, int, int, int, int], _Index] | None = None
        self._blobs: dict[str, tuple[tuple[int, int, int, int, int], str]] = {}

    # -- refs ----------------------------------------------------------------------------

    def _git(self, rel: str) -> str:
        return f"{GIT_DIR}/{rel}"

    def check_layout(self) -> None:
        """Refuse what this reader does not read: ``.git`` not a folder, reftable."""
        info = self.ground.lstat(GIT_DIR)
        if info is None:
            raise unsupported("is gone: the workspace has no .git folder")
        if not stat.S_ISDIR(info.st_mode):
            raise unsupported(
                "is a .git file (a linked work tree or a submodule), which is not read; "
                "use a clone with its own .git folder"
            )
        if self.ground.lstat(self._git("reftable")) is not None:
            raise unsupported("stores its refs in a reftable, which is not read")

    def head(self) -> str | None:
        """HEAD's commit id, or None when the branch it names has no commit yet."""
        self.check_layout()
        text = self._small(self._git("HEAD"))
        if text is None:
            raise corrupt("HEAD is missing")
        for _ in range(_MAX_SYMREF_DEPTH):
            if HEX.match(text):
                return text.decode()
            if not text.startswith(b"ref: "):
                if re.match(rb"^[0-9a-f]{64}$", text):
                    raise unsupported("uses SHA-256 object ids, which are not read")
                raise corrupt("HEAD or a ref holds neither an object id nor a ref")
            name = text[5:].decode("utf-8", "replace")
            if not _REFNAME.match(name) or ".." in name:
                raise corrupt("a ref name is malformed", ref=name[:200])
            loose = self._small(self._git(name))
            if loose is None:
                return self._packed_ref(name)
            text = loose
        raise corrupt("symbolic refs nest too deep")

    def _small(self, rel: str) -> bytes | None:
        data = self.ground.read(rel, limit=MAX_REF_BYTES)
        return None if data is None else data.strip()

    def _packed_ref(self, name: str) -> str | None:
        data = self.ground.read(self._git("packed-refs"), limit=MAX_PACKED_REFS_BYTES)
        if data is None:
            return None
        wanted = name.encode()
        for line in data.splitlines():
            if line.startswith((b"#", b"^")):
                continue
            sha, _, ref = line.partition(b" ")
            if ref == wanted and HEX.match(sha):
                return sha.decode()
        return None

    # -- objects -------------------------------------------------------------------------

    # -- the index -----------------------------------------------------------------------

    def index(self) -> _Index:
        """The parsed index (an empty one when the repository has no index file)."""
        info = self.ground.lstat(self._git("index"))
        if info is None:
            return _Index(entries={}, conflicted=frozenset(), mtime_ns=0)
        key = stat_key(info)
        if self._index is not None and self._index[0] == key:
            return self._index[1]
        data = self.ground.read(self._git("index"), limit=MAX_INDEX_BYTES)
        if data is None:
            return _Index(entries={}, conflicted=frozenset(), mtime_ns=0)
        try:
            raw, _version, extensions = read_index_dict_with_version(io.BytesIO(data))
        except Exception:
            raise corrupt("the index is malformed") from None
        if any(ext.signature == b"link" for ext in extensions):
            raise unsupported("uses a split index (core.splitIndex), which is not read")
        entries: dict[str, IndexEntry] = {}
        conflicted: set[str] = set()
        for name, entry in raw.items():
            path = name.decode("utf-8", "surrogateescape")
            if isinstance(entry, ConflictedIndexEntry):
                conflicted.add(path)
            elif stat.S_ISDIR(entry.mode):
                raise unsupported("has a sparse index, which is not read")
            else:
                entries[path] = entry
        parsed = _Index(
            entries=entries, conflicted=frozenset(conflicted), mtime_ns=info.st_mtime_ns
        )
        _index_trees(parsed)
        self._index = (key, parsed)
        return parsed

    # -- status --------------------------------------------------------------------------

    def status(self) -> GitState:
        """HEAD and the tracked paths that differ (index against HEAD, work tree against
        the index), as ``git status --untracked-files=no`` lists them."""
        head = self.head()
        index = self.index()
        changed: set[str] = set(index.conflicted)
        head_tree = self.objects.commit_tree(head) if head is not None else None
        if head_tree is None:
            changed.update(index.entries)
        elif index.trees.get("") != head_tree:
            self._diff_tree(head_tree, "", index, changed)
        changed.update(self._worktree_changes(index))
        return GitState(head=head or "unborn", dirty=bool(changed), changed=frozenset(changed))

    def _diff_tree(self, tree_id: str, folder: str, index: _Index, changed: set[str]) -> None:
        """Add the paths under ``folder`` where HEAD's tree ``tree_id`` and the index
        differ, entering only subtrees whose ids differ."""
        theirs = self.objects.tree(tree_id)
        ours = index.folders.get(folder, {})
        for name in set(theirs) | set(ours):
            path = f"{folder}/{name}" if folder else name
            a, b = theirs.get(name), ours.get(name)
            if a == b:
                continue
            a_tree = a is not None and a[0] == TREE_MODE
            b_tree = b is not None and b[0] == TREE_MODE
            if a_tree and b_tree and a is not None and b is not None:
                self._diff_tree(a[1], path, index, changed)
                continue
            if a_tree and a is not None:
                self._all_paths(a[1], path, changed)
            elif a is not None:
                changed.add(path)
            if b_tree:
                prefix = path + "/"
                changed.update(p for p in index.entries if p.startswith(prefix))
            elif b is not None:
                changed.add(path)

    def _all_paths(self, tree_id: str, folder: str, out: set[str]) -> None:
        for name, (mode, sha) in self.objects.tree(tree_id).items():
            path = f"{folder}/{name}"
            if mode == TREE_MODE:
                self._all_paths(sha, path, out)
            else:
                out.add(path)

    def _worktree_changes(self, index: _Index) -> Iterable[str]:
        checked = [
            p
            for p, e in index.entries.items()
            if not (e.flags & FLAG_VALID or e.extended_flags & EXTENDED_FLAG_SKIP_WORKTREE)
        ]
        stats = self.ground.lstat_many(checked)
        for path in checked:
            entry = index.entries[path]
            if entry.extended_flags & EXTENDED_FLAG_INTEND_TO_ADD:
                yield path
                continue
            info = stats.get(path)
            if info is None:
                yield path
                continue
            mode = entry.mode & 0o170000
            if mode == _GITLINK:
                if not stat.S_ISDIR(info.st_mode):
                    yield path
                continue
            if _entry_mode(info.st_mode) != _entry_mode(entry.mode) or not (
                stat.S_ISREG(info.st_mode) or stat.S_ISLNK(info.st_mode)
            ):
                yield path
                continue
            if _stat_matches(entry, info, index.mtime_ns):
                continue
            if self.worktree_blob(path, info) != entry.sha.decode():
                yield path

    def worktree_blob(self, path: str, info: os.stat_result) -> str | None:
        """The blob id of work-tree file ``path`` as it is now (a link: its target text),
        cached by its ``stat``; None when it is neither a file nor a link any more."""
        key = stat_key(info)
        cached = self._blobs.get(path)
        if cached is not None and cached[0] == key:
            return cached[1]
        if stat.S_ISLNK(info.st_mode):
            sha: str | None = blob_id(os.fsencode(self.ground.readlink(path)))
        else:
            try:
                found = self.ground.digest(
                    path,
                    lambda: hashlib.sha1(usedforsecurity=False),
                    prefix=lambda size: b"blob %d\x00" % size,
                )
            except UntrustedGroundError:
                return None  # swapped for something else meanwhile: a change
            if found is None:
                return None
            sha, info = found
            key = stat_key(info)
        if len(self._blobs) > 65536:
            self._blobs.clear()
        if sha is not None:
            self._blobs[path] = (key, sha)
        return sha

    def blobs_at(self, path: str, head: str | None) -> tuple[str | None, str | None]:
        """``(index blob id, HEAD blob id)`` of ``path`` (None where it is absent)."""
        entry = self.index().entries.get(path)
        in_index = entry.sha.decode() if entry is not None else None
        if head is None:
            return in_index, None
        tree_id = self.objects.commit_tree(head)
        parts = path.split("/")
        for part in parts[:-1]:
            found = self.objects.tree(tree_id).get(part)
            if found is None or found[0] != TREE_MODE:
                return in_index, None
            tree_id = found[1]
        leaf = self.objects.tree(tree_id).get(parts[-1])
        in_head = leaf[1] if leaf is not None and leaf[0] != TREE_MODE else None
        return in_index, in_head


def _stat_matches(entry: IndexEntry, info: os.stat_result, index_mtime_ns: int) -> bool:
    """Git's stat check: the entry's recorded size, mtime and inode equal the file's, and
    the file is not racily clean (modified in the same instant the index was written)."""
    sec, nsec = _split_time(entry.mtime)
    recorded_ns = sec * 1_000_000_000 + nsec
    if recorded_ns >= index_mtime_ns:
        return False  # racily clean: only the bytes can tell
    return (
        entry.size == (info.st_size & 0xFFFFFFFF)
        and sec == int(info.st_mtime_ns // 1_000_000_000)
        and nsec == info.st_mtime_ns % 1_000_000_000
        and entry.ino == (info.st_ino & 0xFFFFFFFF)
    )


def _index_trees(index: _Index) -> None:
    """Fill ``index.folders`` (each folder's entries as a tree would hold them) and
    ``index.trees`` (each folder's tree id), as ``git write-tree`` would compute them."""
    folders: dict[str, dict[str, tuple[int, str]]] = {"": {}}
    for path, entry in index.entries.items():
        parts = path.split("/")
        for depth in range(1, len(parts)):
            folders.setdefault("/".join(parts[:depth]), {})
        parent = "/".join(parts[:-1])
        mode = entry.mode & 0o170000
        clean = (
            _LINK
            if mode == 0o120000
            else _GITLINK
            if mode == _GITLINK
            else (0o100755 if entry.mode & 0o100 else 0o100644)
        )
        folders[parent][parts[-1]] = (clean, entry.sha.decode())
    # Deepest folders first, so a parent's entry for each child folder has its id.
    order = sorted((f for f in folders if f), key=lambda f: f.count("/"), reverse=True)
    trees: dict[str, str] = {}
    for folder in [*order, ""]:
        tree = Tree()
        for name, (mode, sha) in folders[folder].items():
            tree.add(name.encode("utf-8", "surrogateescape"), mode, sha.encode())  # type: ignore[arg-type]
        trees[folder] = tree.id.decode()
        if folder:
            parent, _, name = folder.rpartition("/")
            folders[parent][name] = (TREE_MODE, trees[folder])
    index.folders = folders
    index.trees = trees


def state_facts(state: GitState | None) -> Mapping[str, str]:
    """The observation details a git state contributes."""
    if state is None:
        return {}
    return {"git_head": state.head, "git_dirty": "1" if state.dirty else "0"}
