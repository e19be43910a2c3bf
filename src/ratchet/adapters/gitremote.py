"""One branch of a git remote, as the git workspace's record (see ``docs/adapters.md``,
"Git workspaces"): its tip, its history read as data, and compare-and-swap pushes.

The remote is reached by dulwich's clients (``file://``, ``git://``, ``http(s)://``): no
``git`` program runs and no configuration is read, neither the user's nor the remote
repository's, so nothing the repository configures can execute here. Objects are fetched
into a private bare repository of this worker (``cache``), which ratchet alone writes.

A push names the commit the branch must still be at (``expected``): the client checks it
against the remote's advertisement and the server's receive-pack refuses the update if the
ref moved between the advertisement and the update (it takes the ref's lock and compares
the old value). That check is the environment's fence at the storage side
(:mod:`ratchet.adapters.gitworkspace` says how fences and writes use it).

Commit messages carry trailers (``Ratchet-Key: ...``) that the history reader parses; they
are plain text, read as data, never executed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import stat
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dulwich.client import (
    GitClient,
    HTTPProxyUnauthorized,
    HTTPUnauthorized,
    default_urllib3_manager,
    get_transport_and_path,
)
from dulwich.errors import GitProtocolError, HangupException, NotGitRepository
from dulwich.object_store import commit_tree_changes
from dulwich.objects import Blob, Commit, ObjectID, ShaFile, Tree
from dulwich.pack import pack_objects_to_data
from dulwich.refs import Ref
from dulwich.repo import Repo

from ratchet.errors import AdapterError, ConfigurationError

__all__ = [
    "ZERO",
    "BranchMoved",
    "HistoryEntry",
    "PushUnknown",
    "RemoteBranch",
    "parse_trailers",
    "remote_scheme",
    "seed_bare",
]

#: The all-zero object id: "no such ref" in the push protocol.
ZERO = b"0" * 40

#: Schemes a git workspace may name. ssh is not among them: dulwich would start the
#: ``ssh`` program with the user's configuration.
SCHEMES = ("file", "git", "http", "https")

_GITLINK = 0o160000
#: How far back a history walk goes before the branch counts as unreadable.
MAX_HISTORY = 20_000

_TRAILER = re.compile(rb"^(Ratchet-[A-Za-z0-9]+): ([\x21-\x7e]{1,200})$")
_HEX40 = re.compile(r"^[0-9a-f]{40}$")


class BranchMoved(Exception):  # noqa: N818 - a signal, never shown to a user as is
    """The push was refused: the branch was not at the expected commit (nothing landed)."""

    def __init__(self, actual: bytes | None) -> None:
        super().__init__("the branch moved")
        self.actual = actual


class PushUnknown(Exception):  # noqa: N818 - a signal, never shown to a user as is
    """The push's outcome is unknown: the connection failed after the pack may have
    been sent. Only a fresh read of the branch can say whether it landed."""


def remote_scheme(url: str) -> str:
    """The scheme of a git remote URL, checked.

    Raises:
        ConfigurationError: not one of :data:`SCHEMES`.
    """
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in SCHEMES or not rest:
        raise ConfigurationError(
            f"a git remote must be a {', '.join(s + '://' for s in SCHEMES)} URL",
            field="environment.remote.url",
        )
    return scheme


def parse_trailers(message: bytes) -> dict[str, str]:
    """The ``Ratchet-*`` trailers of a commit message: the lines of its last paragraph
    that have the form ``Ratchet-Name: value`` (printable ASCII, at most 200 characters).
    The first occurrence of a name wins; anything else is ignored."""
    paragraphs = message.strip().split(b"\n\n")
    found: dict[str, str] = {}
    if len(paragraphs) < 2:
        return found
    for line in paragraphs[-1].splitlines():
        match = _TRAILER.match(line)
        if match is not None:
            found.setdefault(match.group(1).decode(), match.group(2).decode())
    return found


@dataclass(frozen=True, slots=True)
class HistoryEntry:
    """One commit of the branch's first-parent chain above the base."""

    commit: bytes
    tree: bytes
    parent: bytes  # the first parent (b"": none)
    parent_tree: bytes
    commit_time: int
    trailers: dict[str, str]

    @property
    def is_fence(self) -> bool:
        """A fence commit: a fence trailer, no key, and no change to the tree."""
        return (
            "Ratchet-Fence" in self.trailers
            and "Ratchet-Key" not in self.trailers
            and self.tree == self.parent_tree
        )


def _transport_errors() -> tuple[type[BaseException], ...]:
    return (
        OSError,
        GitProtocolError,
        HangupException,
        HTTPUnauthorized,
        HTTPProxyUnauthorized,
        ValueError,
        KeyError,
    )


class RemoteBranch:
    """One branch of one remote, with a private object cache.

    Args:
        url: the remote (``file://``, ``git://``, ``http(s)://``).
        branch: the branch's name under ``refs/heads/``.
        cache: a folder for this worker's bare repository of the remote's objects
            (created if missing; shared safely by the processes of one host).
        password: for ``http(s)://``, called once per connection for the secret sent
            as the password of HTTP basic authentication (None: no authentication).
        username: the user name sent with it.

    Raises (constructor):
        ConfigurationError: a bad URL or branch name, or a password for a scheme that
            cannot carry one.
    """

    def __init__(
        self,
        url: str,
        branch: str,
        *,
        cache: Path,
        password: Callable[[], str] | None = None,
        username: str = "ratchet",
    ) -> None:
        scheme = remote_scheme(url)
        if password is not None and scheme not in ("http", "https"):
            raise ConfigurationError(
                f"a {scheme}:// remote carries no credential", field="environment.remote"
            )
        self.url = url
        self.branch = branch
        self.ref = b"refs/heads/" + branch.encode()
        self._password = password
        self._username = username
        self._cache_dir = cache / hashlib.sha256(url.encode()).hexdigest()[:24]
        self._repo: Repo | None = None
        self._entries: dict[bytes, HistoryEntry] = {}
        self._chains: dict[tuple[bytes, bytes], list[HistoryEntry]] = {}
        self._connected: tuple[GitClient, str] | None = None
        self._pool: Any = None
        self._responses: list[Any] = []

    def __repr__(self) -> str:
        return f"RemoteBranch(url={self.url!r}, branch={self.branch!r})"

    # -- the local object cache -------------------------------------------------------------

    @property
    def repo(self) -> Repo:
        """This worker's bare repository of the remote's objects."""
        if self._repo is None:
            try:
                self._cache_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
                if (self._cache_dir / "objects").is_dir():
                    self._repo = Repo(str(self._cache_dir), bare=True)
                else:
                    self._repo = Repo.init_bare(str(self._cache_dir))
            except OSError as exc:
                raise AdapterError(
                    "the git object cache cannot be opened",
                    retryable=True,
                    error=type(exc).__name__,
                ) from None
        return self._repo

    def close(self) -> None:
        """Close the object cache and the client's connections (an HTTP client keeps
        its connections alive between calls of one job)."""
        if self._repo is not None:
            self._repo.close()
            self._repo = None
        if self._connected is not None:
            self._connected[0].close()
            self._connected = None
        for response in self._responses:
            # Released or not (dulwich raises on a 401 without releasing it): closed.
            with contextlib.suppress(Exception):
                response.close()
        self._responses.clear()
        if self._pool is not None:
            self._pool.clear()
            self._pool = None

    def _http_pool(self) -> Any:
        """An HTTP connection pool whose responses are all closed by :meth:`close`."""
        pool = default_urllib3_manager(None)
        request = pool.request

        def tracked(*args: Any, **kwargs: Any) -> Any:
            response = request(*args, **kwargs)
            self._responses.append(response)
            return response

        pool.request = tracked  # type: ignore[method-assign]
        self._pool = pool
        return pool

    def _client(self) -> tuple[GitClient, str]:
        if self._connected is None:
            password = self._password() if self._password is not None else None
            http = self.url.startswith(("http://", "https://"))
            self._connected = get_transport_and_path(
                self.url,
                config=None,
                username=self._username if password is not None else None,
                password=password,
                quiet=True,
                pool_manager=self._http_pool() if http else None,
            )
        return self._connected

    def _unreachable(self, exc: BaseException, what: str) -> AdapterError:
        if isinstance(exc, HTTPUnauthorized):
            return AdapterError(f"the git remote refused the credential ({what})", retryable=False)
        return AdapterError(
            f"the git remote could not be reached ({what})",
            retryable=True,
            error=type(exc).__name__,
        )

    # -- reading ----------------------------------------------------------------------------

    def refs(self) -> dict[bytes, bytes]:
        """The remote's refs (one round trip).

        Raises:
            AdapterError: unreachable (retryable=True), credential refused.
        """
        client, path = self._client()
        try:
            result = client.get_refs(path.encode() if isinstance(path, str) else path)
        except _transport_errors() as exc:
            raise self._unreachable(exc, "listing refs") from None
        return {name: sha for name, sha in result.refs.items() if sha is not None}

    def tip(self) -> bytes | None:
        """The branch's commit on the remote now, or None when it has none."""
        return self.refs().get(self.ref)

    def has(self, sha: bytes) -> bool:
        return ObjectID(sha) in self.repo.object_store

    def fetch(self, sha: bytes) -> None:
        """Bring ``sha`` (a commit the remote advertises) and its history into the cache.

        Raises:
            AdapterError: unreachable (retryable=True), or the remote did not send it.
        """
        if self.has(sha):
            return
        client, path = self._client()
        local = self.repo

        def wants(refs: Mapping[Ref, ObjectID], depth: int | None = None) -> list[ObjectID]:
            return [ObjectID(sha)] if ObjectID(sha) not in local.object_store else []

        try:
            client.fetch(path.encode() if isinstance(path, str) else path, local, wants)
        except _transport_errors() as exc:
            raise self._unreachable(exc, "fetching") from None
        if not self.has(sha):
            raise AdapterError(
                "the git remote did not send the branch's commit",
                retryable=True,
                commit=sha.decode(),
            )

    def commit(self, sha: bytes) -> Commit:
        obj = self.repo.object_store[ObjectID(sha)]
        if not isinstance(obj, Commit):
            raise AdapterError("not a commit", retryable=False, object=sha.decode())
        return obj

    def tree(self, sha: bytes) -> Tree:
        obj = self.repo.object_store[ObjectID(sha)]
        if not isinstance(obj, Tree):
            raise AdapterError("not a tree", retryable=False, object=sha.decode())
        return obj

    def blob(self, sha: bytes) -> Blob:
        obj = self.repo.object_store[ObjectID(sha)]
        if not isinstance(obj, Blob):
            raise AdapterError("not a blob", retryable=False, object=sha.decode())
        return obj

    def path_at(self, tree: bytes, path: str) -> tuple[int, bytes] | None:
        """The mode and object id at ``path`` (``a/b/c``) in ``tree``, or None."""
        current = self.tree(tree)
        parts = path.encode().split(b"/")
        for i, part in enumerate(parts):
            try:
                mode, sha = current[part]
            except KeyError:
                return None
            if i == len(parts) - 1:
                return int(mode), sha
            if not stat.S_ISDIR(mode):
                return None
            current = self.tree(sha)
        return None

    def entry(self, sha: bytes) -> HistoryEntry:
        """The history entry of commit ``sha`` (cached: commits never change)."""
        found = self._entries.get(sha)
        if found is not None:
            return found
        commit = self.commit(sha)
        parent = commit.parents[0] if commit.parents else b""
        parent_tree = self.commit(parent).tree if parent else b""
        found = HistoryEntry(
            commit=sha,
            tree=commit.tree,
            parent=parent,
            parent_tree=parent_tree,
            commit_time=int(commit.commit_time),
            trailers=parse_trailers(commit.message),
        )
        self._entries[sha] = found
        return found

    def history(self, tip: bytes, base: bytes) -> list[HistoryEntry]:
        """The first-parent chain from ``base`` (exclusive) to ``tip`` (inclusive),
        oldest first. ``tip`` must have been fetched.

        Raises:
            AdapterError: ``base`` is not on the chain (the branch was rewritten, or
                runs too long to read; retryable=False).
        """
        cached = self._chains.get((tip, base))
        if cached is not None:
            return cached
        # Walk back until the base, or a commit whose chain is known (the tip a previous
        # read saw): a run's later reads cost only the commits added since.
        fresh: list[HistoryEntry] = []
        at = tip
        known: list[HistoryEntry] | None = None
        while at != base:
            known = self._chains.get((at, base))
            if known is not None or len(fresh) >= MAX_HISTORY:
                break
            entry = self.entry(at)
            fresh.append(entry)
            if not entry.parent:
                break
            at = entry.parent
        if known is None and at != base:
            raise AdapterError(
                "the run's branch no longer descends from its base commit (it was "
                "rewritten); nothing is written to it",
                retryable=False,
                reason="branch_rewritten",
                branch=self.branch,
            )
        fresh.reverse()
        chain = [*(known or ()), *fresh]
        if len(chain) > MAX_HISTORY:
            raise AdapterError(
                "the run's branch is too long to read", retryable=False, branch=self.branch
            )
        self._chains[(tip, base)] = chain
        return chain

    # -- writing ----------------------------------------------------------------------------

    def push(self, expected: bytes | None, new: bytes) -> None:
        """Move the branch from ``expected`` (None: it must not exist) to ``new``, whose
        objects are in the cache, or to nothing.

        Raises:
            BranchMoved: the branch was not at ``expected`` (nothing landed).
            PushUnknown: the connection failed after the update may have been sent.
            AdapterError: the remote could not be reached before anything was sent
                (retryable=True), or refused the update for another reason.
        """
        delta = self._delta(new, expected)
        if self.url.startswith("file://") and self._push_local(expected, new, delta):
            return
        client, path = self._client()
        want_old = expected if expected is not None else ZERO
        seen: dict[str, bytes | None] = {}
        local = self.repo

        def update_refs(refs: dict[Ref, ObjectID]) -> dict[Ref, ObjectID]:
            current = refs.get(Ref(self.ref))
            seen["advertised"] = current
            if (current or ZERO) != want_old:
                raise BranchMoved(current)
            # Only this ref is named: no other is touched.
            return {Ref(self.ref): ObjectID(new)}

        def generate(
            have: set[ObjectID],
            want: set[ObjectID],
            *,
            ofs_delta: bool = False,
            progress: object = None,
        ) -> tuple[int, Iterator[Any]]:
            if delta is not None:
                # Only what the commit adds over its parent, the tip the remote advertised:
                # no walk of the history.
                return pack_objects_to_data(delta, deltify=False, ofs_delta=ofs_delta)
            return local.object_store.generate_pack_data(have, want, ofs_delta=ofs_delta)

        try:
            result = client.send_pack(
                path.encode() if isinstance(path, str) else path,
                update_refs,
                generate,  # type: ignore[arg-type]
            )
        except BranchMoved:
            raise
        except _transport_errors() as exc:
            if "advertised" not in seen:
                raise self._unreachable(exc, "pushing") from None
            raise PushUnknown(str(type(exc).__name__)) from None
        status = (result.ref_status or {}).get(self.ref)
        if status is not None:
            # The server refused the update: its old-value check failed (the ref moved
            # after the advertisement), or a hook or rule of the remote refused it.
            raise BranchMoved(None)

    def _delta(self, new: bytes, old: bytes | None) -> list[ShaFile] | None:
        """The objects commit ``new`` adds over ``old``, its first parent: the commit and
        the trees and blobs its tree changed. None when ``new`` does not build on ``old``
        (a push of a commit the remote may have: the client then works it out)."""
        if old is None:
            return None
        commit = self.commit(new)
        if not commit.parents or commit.parents[0] != old:
            return None
        out: list[ShaFile] = [commit]
        self._tree_delta(commit.tree, self.commit(old).tree, out)
        return out

    def _tree_delta(self, new_tree: bytes, old_tree: bytes | None, out: list[ShaFile]) -> None:
        if new_tree == old_tree:
            return
        tree = self.tree(new_tree)
        out.append(tree)
        before: dict[bytes, tuple[int, bytes]] = {}
        if old_tree is not None:
            before = {e.path: (e.mode, e.sha) for e in self.tree(old_tree).iteritems()}
        for entry in tree.iteritems():
            prev = before.get(entry.path)
            if prev is not None and prev[1] == entry.sha:
                continue
            if stat.S_ISDIR(entry.mode):
                old_sub = prev[1] if prev is not None and stat.S_ISDIR(prev[0]) else None
                self._tree_delta(entry.sha, old_sub, out)
            elif entry.mode != _GITLINK:
                out.append(self.blob(entry.sha))

    def _push_local(self, expected: bytes | None, new: bytes, delta: list[ShaFile] | None) -> bool:
        """A ``file://`` push done as git's receive-pack does a small one: the new objects
        written loose into the remote (each atomically, by dulwich), then the ref moved by
        compare-and-swap under its lock file. False when the remote lacks objects this
        cannot name (the caller then pushes through dulwich's client).

        Raises BranchMoved, PushUnknown, AdapterError as :meth:`push`.
        """
        path = self.url[len("file://") :]
        try:
            target = Repo(path, bare=True)
        except (OSError, NotGitRepository) as exc:
            raise self._unreachable(exc, "opening the remote") from None
        try:
            ref = Ref(self.ref)
            try:
                current: bytes | None = target.refs[ref]
            except KeyError:
                current = None
            if current != expected:
                raise BranchMoved(current)
            store = target.object_store
            if delta is None:
                if ObjectID(new) not in store:
                    return False
                delta = []
            try:
                for obj in delta:
                    if obj.id not in store:
                        store.add_object(obj)
            except OSError as exc:
                raise self._unreachable(exc, "writing objects") from None
            try:
                if expected is None:
                    moved = target.refs.add_if_new(ref, ObjectID(new))
                else:
                    moved = target.refs.set_if_equals(ref, ObjectID(expected), ObjectID(new))
            except OSError as exc:
                raise PushUnknown(type(exc).__name__) from None
            if not moved:
                raise BranchMoved(None)
            return True
        finally:
            target.close()


def seed_bare(
    folder: Path,
    files: Mapping[str, bytes],
    *,
    branch: str = "main",
    message: bytes = b"initial files\n",
    author: bytes = b"ratchet <ratchet@localhost>",
    when: int | None = None,
) -> str:
    """Make a bare repository at ``folder`` (created; refused if it exists) whose
    ``branch`` holds one commit of ``files`` (paths to bytes, regular files). Returns the
    commit id. A remote for a git workspace to start from, made without a ``git`` program.

    Raises:
        FileExistsError: ``folder`` exists.
    """
    folder.mkdir(parents=True)
    repo = Repo.init_bare(str(folder))
    try:
        store = repo.object_store
        changes: list[tuple[bytes, int | None, ObjectID | None]] = []
        for path, data in files.items():
            blob = Blob.from_string(data)
            store.add_object(blob)
            changes.append((path.encode(), 0o100644, blob.id))
        empty = Tree()
        store.add_object(empty)
        commit = Commit()
        commit.tree = commit_tree_changes(store, empty, changes)
        commit.author = commit.committer = author
        commit.author_time = commit.commit_time = int(time.time()) if when is None else when
        commit.author_timezone = commit.commit_timezone = 0
        commit.message = message
        store.add_object(commit)
        repo.refs[Ref(b"refs/heads/" + branch.encode())] = commit.id
        return commit.id.decode()
    finally:
        repo.close()


def is_commit_id(text: str) -> bool:
    """Whether ``text`` is a full lowercase hex SHA-1 object id."""
    return _HEX40.match(text) is not None


def cache_folder(state_dir: Path) -> Path:
    """Where a worker keeps its git object caches: inside its own state folder."""
    return Path(os.path.abspath(state_dir)) / "git"
