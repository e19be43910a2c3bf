"""The git workspace: a run's files live on a branch of a git remote, which any worker on
any host can reach, and the remote itself refuses a stale worker's write.

The remote is the environment's record (nothing of the run is kept only on a worker's
disk)::

    instance      the remote's URL, the run's branch and its base commit, bound at submit
    version       the commits on the branch above the base, fence commits not counted
    fingerprint   the branch's tree (a foreign push that changes a file is drift)
    a write       one commit on the branch: the file changed, and trailers carrying the
                  idempotency key, the intent digest, the approval digest and the fence
    its receipt   that commit (a lookup by key reads the branch's history)

One write, in order::

    read the tip ─▶ fetch ─▶ fences on the branch <= ours? key already there? version? ─▶
    commit (tree + trailers) in the private cache ─▶ push: branch from tip to commit,
    compare-and-swap at the remote ─▶ receipt from the commit

**Fencing at the remote.** Every push names the commit the branch must still be at, and
the remote's receive-pack refuses it otherwise, under the ref's lock. A writer checks the
fences recorded on the branch (the ``Ratchet-Fence`` trailers) of exactly the commit its
push replaces, so a write lands only on a branch whose highest fence is not above its own.
A new owner's fence is recorded on the branch by :meth:`raise_fence` as a *fence commit*
(no change to the tree, the fence in its trailers), pushed by the same compare-and-swap:
from then on a zombie's push, built on an older tip, fails at the remote, and one built on
the fence commit is refused by the zombie's own fence check. Every job raises its fence
once, so a branch carries one commit per write and one fence commit per job that raised a
fence higher than the branch's (``docs/adapters.md``, "Git workspaces", has the
interleavings). Fence commits count in no version and change no tree.

**Unknown outcomes.** A push whose reply was lost is looked up by key on a fresh read of
the branch: found, its receipt is the answer; absent, the call fails as ``outcome
unknown`` (retryable) and the engine settles the key behind its fence, never committing
a second time.

Nothing from the repository runs outside the sandbox: the branch is read as data (dulwich
objects in a private cache), the verifier runs confined on a checkout written from the
tree here (regular files and links only, every name checked), and no ``git`` program is
started.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from dulwich.object_store import commit_tree_changes
from dulwich.objects import Blob, Commit, ObjectID, Tree

from ratchet.adapters.files import AllowedPaths, content_sha
from ratchet.adapters.gitremote import BranchMoved, HistoryEntry, PushUnknown, RemoteBranch
from ratchet.errors import (
    AdapterError,
    FenceRejectedError,
    IdempotencyConflictError,
    UntrustedGroundError,
)
from ratchet.runtime.actions import Action, ActionKind
from ratchet.runtime.canonical import Domain, digest
from ratchet.runtime.ports import Clock, Fence, Observation, ReadResult, Receipt, VerifierReport

if TYPE_CHECKING:
    from ratchet.adapters.verifier import CommandVerifier, VerifierRun

__all__ = ["GitWorkspaceAdapter", "git_instance_id"]

_MAX_READ_BYTES = 1 << 20
#: The largest blob a checkout writes (a bigger one refuses the checkout).
_MAX_BLOB_BYTES = 256 << 20
_FILE_MODE = 0o100644
_EXEC_MODE = 0o100755
_LINK_MODE = 0o120000
_TREE_MODE = 0o040000
_AUTHOR = b"ratchet <ratchet@localhost>"
#: Pushes a fence is tried before it gives up (each lost race reads the branch again).
_FENCE_ATTEMPTS = 5


def git_instance_id(url: str, branch: str, base: str) -> str:
    """The instance id of a git workspace: its remote, branch and base commit."""
    text = f"{url}\n{branch}\n{base}".encode()
    return "git-" + hashlib.sha256(text).hexdigest()[:40]


def _fence_text(fence: Fence) -> str:
    return f"{fence.lease_version}.{fence.state_version}"


def _fence_key(text: str) -> tuple[int, int] | None:
    lease, sep, state = text.partition(".")
    if not sep or not lease.isdigit() or not state.isdigit():
        return None
    return (int(lease), int(state))


def _safe_name(name: bytes) -> bool:
    """A tree entry name a checkout may create: one path segment, never ``.git``."""
    return (
        bool(name)
        and name not in (b".", b"..")
        and b"/" not in name
        and b"\0" not in name
        and name.lower() != b".git"
    )


class _Tip:
    """The branch as one read saw it: its commit, its history above the base, the
    version and tree, the highest fence recorded for each run, the store epoch the branch
    is bound to (the first one recorded) and the commit of each idempotency key."""

    def __init__(self, commit: bytes, history: list[HistoryEntry]) -> None:
        self.commit = commit
        self.history = history
        self.version = sum(1 for e in history if not e.is_fence)
        self.tree = history[-1].tree if history else b""
        self.fences: dict[str, tuple[int, int]] = {}
        self.epoch: str | None = None
        self.keys: dict[str, tuple[HistoryEntry, int]] = {}
        version = 0
        for entry in history:
            if not entry.is_fence:
                version += 1
            trailers = entry.trailers
            run = trailers.get("Ratchet-Run")
            if run is None:
                continue  # not ratchet's: a foreign commit counts in the version only
            key = _fence_key(trailers.get("Ratchet-Fence", ""))
            if key is not None and key > self.fences.get(run, (-1, -1)):
                self.fences[run] = key
            if self.epoch is None and "Ratchet-Epoch" in trailers:
                self.epoch = trailers["Ratchet-Epoch"]
            idem = trailers.get("Ratchet-Key")
            if idem is not None and idem not in self.keys and not entry.is_fence:
                self.keys[idem] = (entry, version)


class GitWorkspaceAdapter:
    """A branch of a git remote as a run's workspace (see the module docstring).

    Args:
        remote: the run's branch on its remote.
        base: the base commit (40 hex) the branch was made at, signed at submit.
        run_id: the run whose fences and keys the branch carries.
        allowed_paths: the files or folders a write may change.
        scratch: a folder of this worker for checkouts (created if missing).
        verifier: runs allow-listed commands for :meth:`verify`, on a checkout.
        clock: commit times (a worker passes the store's clock).
        hook: crash-drill hook, called with ``"before_push"`` and ``"after_push"``.
        namespace: the receipt namespace.
    """

    def __init__(
        self,
        remote: RemoteBranch,
        *,
        base: str,
        run_id: str,
        allowed_paths: Iterable[str],
        scratch: Path,
        verifier: CommandVerifier | None = None,
        clock: Clock | None = None,
        hook: Callable[[str], None] | None = None,
        namespace: str = "git",
    ) -> None:
        self._remote = remote
        self._base = base.encode()
        self._run_id = run_id
        self.allowed = AllowedPaths(allowed_paths)
        self._scratch = scratch
        self._verifier = verifier
        self._clock = clock
        self._hook = hook or (lambda stage: None)
        self._namespace = namespace
        self._instance = git_instance_id(remote.url, remote.branch, base)
        self._lock = threading.Lock()
        self._tips: dict[bytes, _Tip] = {}  # commits never change: nor does a tip's reading
        self._checkout: Path | None = None
        self._state: Path | None = None

    def __repr__(self) -> str:
        return f"GitWorkspaceAdapter(remote={self._remote!r}, run_id={self._run_id!r})"

    def __enter__(self) -> GitWorkspaceAdapter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Throw the checkout away and close the object cache."""
        for folder in (self._checkout, self._state):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
        self._checkout = self._state = None
        self._remote.close()

    @property
    def namespace(self) -> str:
        return self._namespace

    @property
    def instance_id(self) -> str:
        return self._instance

    @property
    def remote(self) -> RemoteBranch:
        return self._remote

    # -- reading the branch -------------------------------------------------------------------

    def _read(self) -> _Tip:
        tip = self._remote.tip()
        if tip is None:
            raise AdapterError(
                "the run's branch is gone from the git remote; nothing is written to it",
                retryable=False,
                reason="branch_missing",
                branch=self._remote.branch,
            )
        found = self._tips.get(tip)
        if found is None:
            self._remote.fetch(tip)
            found = _Tip(tip, self._remote.history(tip, self._base))
            if len(self._tips) >= 8:
                self._tips.clear()  # a run's reads see a handful of tips at a time
            self._tips[tip] = found
        return found

    def _observation(self, version: int, tree: bytes) -> Observation:
        tree_hex = (tree or self._remote.commit(self._base).tree).decode()
        return Observation(
            instance_id=self._instance,
            version=version,
            fingerprint=digest(Domain.ENVIRONMENT, {"git_tree": tree_hex}),
            details={"branch": self._remote.branch, "tree": tree_hex},
        )

    def _tree_of(self, tip: _Tip) -> bytes:
        return tip.tree or self._remote.commit(self._base).tree

    def observe(self) -> Observation:
        """The branch's version and tree on the remote now.

        Raises:
            AdapterError: unreachable (retryable=True); the branch is gone or was
                rewritten past its base (retryable=False).
        """
        with self._lock:
            tip = self._read()
            return self._observation(tip.version, self._tree_of(tip))

    def _lookup_path(self, tree: bytes, path: str) -> tuple[int, bytes] | None:
        return self._remote.path_at(tree, path)

    def _changed_tree(self, tree: bytes, action: Action) -> bytes:
        """The tree after ``action`` (a write or a delete of an allowed path), its new
        objects added to the cache.

        Raises:
            AdapterError: path not allowed, nothing to delete, or the path is a folder or
                a link on the branch (retryable=False).
        """
        path = action.text("path")
        if path not in self.allowed:
            raise AdapterError("path is outside the allowed paths", retryable=False, path=path)
        store = self._remote.repo.object_store
        found = self._lookup_path(tree, path)
        if found is not None and not stat.S_ISREG(found[0]):
            raise AdapterError(
                "the path is a folder or a link on the branch", retryable=False, path=path
            )
        if action.kind is ActionKind.DELETE_FILE:
            if found is None:
                raise AdapterError("nothing to delete", retryable=False, path=path)
            change: tuple[bytes, int | None, ObjectID | None] = (path.encode(), None, None)
        else:
            blob = Blob.from_string(action.text("content").encode())
            store.add_object(blob)
            mode = found[0] if found is not None else _FILE_MODE
            change = (path.encode(), mode, blob.id)
        return commit_tree_changes(store, self._remote.tree(tree), [change])

    def project(self, action: Action, before: Observation) -> Observation | None:
        """The observation ``action`` would produce from ``before``, or None when
        ``before`` is not the branch now or the action changes no file."""
        if action.kind not in (ActionKind.WRITE_FILE, ActionKind.DELETE_FILE):
            return None
        if action.text("path") not in self.allowed:
            return None
        with self._lock:
            tip = self._read()
            now = self._observation(tip.version, self._tree_of(tip))
            if not now.same_state(before):
                return None
            try:
                tree = self._changed_tree(self._tree_of(tip), action)
            except AdapterError:
                return None
            return self._observation(tip.version + 1, tree)

    # -- fences -------------------------------------------------------------------------------

    def _check_fence(self, tip: _Tip, fence: Fence) -> None:
        if fence.store_epoch is not None and tip.epoch not in (None, fence.store_epoch):
            raise FenceRejectedError(
                "this branch serves another store (its epoch differs): a run of a wiped "
                "or re-initialised store may not write here",
                run_id=fence.run_id,
                reason="store_epoch",
                bound_epoch=tip.epoch,
            )
        seen = tip.fences.get(fence.run_id)
        if seen is not None and fence.key() < seen:
            raise FenceRejectedError(
                "fence is older than one already recorded on the branch",
                run_id=fence.run_id,
                fence=fence.key(),
                seen=seen,
            )

    def raise_fence(self, fence: Fence) -> None:
        """Record ``fence`` on the branch as a fence commit, unless the branch records one
        at least as high already (see the module docstring).

        Raises:
            FenceRejectedError: a higher fence, another run's or another store's.
            AdapterError: the remote is unreachable, or the branch kept moving
                (retryable=True).
        """
        with self._lock:
            self._record_fence(fence)

    def _trailers(self, fence: Fence, extra: dict[str, str]) -> bytes:
        lines = [f"Ratchet-Run: {fence.run_id}"]
        lines += [f"{name}: {value}" for name, value in extra.items()]
        lines.append(f"Ratchet-Fence: {_fence_text(fence)}")
        if fence.store_epoch is not None:
            lines.append(f"Ratchet-Epoch: {fence.store_epoch}")
        return "\n".join(lines).encode()

    def _commit(self, tip: _Tip, tree: bytes, subject: str, trailers: bytes) -> Commit:
        commit = Commit()
        commit.tree = tree
        commit.parents = [ObjectID(tip.commit)]
        commit.author = commit.committer = _AUTHOR
        when = self._clock.now() if self._clock is not None else int(time.time())
        commit.author_time = commit.commit_time = when
        commit.author_timezone = commit.commit_timezone = 0
        commit.message = subject.encode() + b"\n\n" + trailers + b"\n"
        self._remote.repo.object_store.add_object(commit)
        return commit

    def _record_fence(self, fence: Fence) -> None:
        """Push a fence commit for ``fence`` unless the branch records one at least as
        high; each lost compare-and-swap reads the branch again.

        Raises:
            FenceRejectedError: a higher fence is (or landed meanwhile) on the branch.
            AdapterError: the remote could not be reached, or kept moving.
        """
        for _ in range(_FENCE_ATTEMPTS):
            tip = self._read()
            self._check_fence(tip, fence)
            seen = tip.fences.get(fence.run_id)
            if seen is not None and seen >= fence.key():
                return
            commit = self._commit(
                tip,
                self._tree_of(tip),
                f"ratchet: fence {_fence_text(fence)}",
                self._trailers(fence, {}),
            )
            try:
                self._remote.push(tip.commit, commit.id)
            except (BranchMoved, PushUnknown):
                continue  # read again: the branch now says what happened
            return
        raise AdapterError(
            "the run's branch kept moving while its fence was recorded",
            retryable=True,
            branch=self._remote.branch,
        )

    # -- writes and receipts ------------------------------------------------------------------

    def _receipt(self, entry: HistoryEntry, version: int) -> Receipt:
        trailers = entry.trailers
        path = trailers.get("Ratchet-Path", "")
        result: dict[str, str | int] = {
            "commit": entry.commit.decode(),
            "path": path,
            "op": trailers.get("Ratchet-Op", ""),
        }
        if "Ratchet-Sha256" in trailers:
            result["sha256"] = trailers["Ratchet-Sha256"]
        return Receipt(
            namespace=self._namespace,
            receipt_version=1,
            receipt_id=f"{self._instance}/{entry.commit.decode()}",
            idempotency_key=trailers["Ratchet-Key"],
            intent_digest=trailers["Ratchet-Intent"],
            result=result,
            committed_at=entry.commit_time,
            env_version_after=version,
            approval_digest=trailers.get("Ratchet-Approval"),
        )

    def _found(self, tip: _Tip, key: str) -> Receipt | None:
        hit = tip.keys.get(key)
        if hit is None:
            return None
        try:
            return self._receipt(*hit)
        except (ValueError, KeyError):
            raise UntrustedGroundError(
                "a commit on the run's branch carries this key with trailers that are not "
                "a receipt; nothing is decided from it",
                path=hit[0].commit.decode(),
                file_type="commit",
                reason="malformed_receipt",
            ) from None

    def _answer(self, receipt: Receipt, intent_digest: str, key: str) -> Receipt:
        if receipt.intent_digest != intent_digest:
            raise IdempotencyConflictError(
                "key was used for another intent", idempotency_key=key, receipt=receipt
            )
        return receipt

    def execute(
        self, action: Action, intent_digest: str, fence: Fence, approval_digest: str | None
    ) -> Receipt:
        """Write or delete one file as one commit under ``action.idempotency_key``.

        Raises:
            FenceRejectedError: a newer fence is recorded on the branch.
            IdempotencyConflictError: the key has a commit for another intent.
            AdapterError: wrong kind, path not allowed, nothing to delete, or the version
                is not ``action.expected_env_version`` (retryable=False); unreachable, the
                branch moved, or the outcome is unknown (``outcome="unknown"``; look the
                key up) (retryable=True).
        """
        if action.kind not in (ActionKind.WRITE_FILE, ActionKind.DELETE_FILE):
            raise AdapterError(
                "the git workspace performs write_file and delete_file only",
                retryable=False,
                kind=str(action.kind),
            )
        key = action.idempotency_key
        if key is None:
            raise AdapterError("writes need an idempotency key", retryable=False)
        with self._lock:
            tip = self._read()
            self._check_fence(tip, fence)
            existing = self._found(tip, key)
            if existing is not None:
                return self._answer(existing, intent_digest, key)
            if tip.version != action.expected_env_version:
                raise AdapterError(
                    "environment precondition failed",
                    retryable=False,
                    expected=action.expected_env_version,
                    actual=tip.version,
                )
            tree = self._changed_tree(self._tree_of(tip), action)
            path = action.text("path")
            extra = {
                "Ratchet-Key": key,
                "Ratchet-Intent": intent_digest,
                "Ratchet-Op": "write" if action.kind is ActionKind.WRITE_FILE else "delete",
                "Ratchet-Path": path,
            }
            if action.kind is ActionKind.WRITE_FILE:
                extra["Ratchet-Sha256"] = content_sha(action.text("content").encode())
            if approval_digest is not None:
                extra["Ratchet-Approval"] = approval_digest
            commit = self._commit(
                tip, tree, f"ratchet: {extra['Ratchet-Op']} {path}", self._trailers(fence, extra)
            )
            self._hook("before_push")
            try:
                self._remote.push(tip.commit, commit.id)
            except BranchMoved:
                return self._after_push(key, intent_digest, moved=True)
            except PushUnknown:
                return self._after_push(key, intent_digest, moved=False)
            self._hook("after_push")
            entry = self._remote.entry(commit.id)
            return self._receipt(entry, tip.version + 1)

    def _after_push(self, key: str, intent_digest: str, *, moved: bool) -> Receipt:
        """The push did not report success: the branch, read again, says what happened."""
        tip = self._read()
        found = self._found(tip, key)
        if found is not None:
            return self._answer(found, intent_digest, key)
        if moved:
            raise AdapterError(
                "the run's branch moved before the write landed (nothing was written); "
                "the run observes it again",
                retryable=True,
                reason="branch_moved",
                idempotency_key=key,
            )
        raise AdapterError(
            "outcome unknown and the branch has no commit for the key yet; look the key "
            "up again before any retry",
            retryable=True,
            outcome="unknown",
            idempotency_key=key,
        )

    def lookup(self, idempotency_key: str) -> Receipt | None:
        """The commit for a key on the branch, as a receipt, or None.

        Raises:
            AdapterError: unreachable (retryable=True); a malformed receipt commit.
        """
        with self._lock:
            return self._found(self._read(), idempotency_key)

    # -- reads and verification ---------------------------------------------------------------

    def read(self, action: Action) -> ReadResult:
        """Read one allowed text file from the branch's tree.

        Raises:
            AdapterError: wrong kind, path not allowed, missing, too large or not UTF-8
                (retryable=False); unreachable (retryable=True).
        """
        if action.kind is not ActionKind.READ_FILE:
            raise AdapterError(
                "the git workspace reads read_file actions only",
                retryable=False,
                kind=str(action.kind),
            )
        path = action.text("path")
        if path not in self.allowed:
            raise AdapterError("path is outside the allowed paths", retryable=False, path=path)
        with self._lock:
            tip = self._read()
            found = self._lookup_path(self._tree_of(tip), path)
            if found is None or not stat.S_ISREG(found[0]):
                raise AdapterError("no such file", retryable=False, path=path)
            data = self._remote.blob(found[1]).as_raw_string()
            if len(data) > _MAX_READ_BYTES:
                raise UntrustedGroundError(
                    "the file is larger than a read returns",
                    path=path,
                    file_type="regular",
                    reason="too_large",
                )
            try:
                content = data.decode()
            except UnicodeDecodeError:
                raise AdapterError("file is not UTF-8 text", retryable=False, path=path) from None
            return ReadResult(content=content, env_version=tip.version)

    @property
    def root(self) -> Path:
        """The checkout the verifier runs on (written by :meth:`verify`)."""
        if self._checkout is None:
            raise AdapterError("the git workspace has no checkout yet", retryable=False)
        return self._checkout

    @property
    def state_dir(self) -> Path:
        """The verifier's home and temporary folders (never in the checkout)."""
        if self._state is None:
            raise AdapterError("the git workspace has no checkout yet", retryable=False)
        return self._state

    def _materialise(self, tree: bytes) -> None:
        """A fresh checkout of ``tree``: regular files and links only, every name one
        safe segment (never ``.git``), each file created new (never through a link)."""
        for folder in (self._checkout, self._state):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
        self._scratch.mkdir(parents=True, exist_ok=True, mode=0o755)
        name = f"{self._instance[4:20]}-{secrets.token_hex(6)}"
        checkout = self._scratch / name
        state = self._scratch / f"{name}.state"
        checkout.mkdir(mode=0o755)
        state.mkdir(mode=0o700)
        self._checkout, self._state = checkout, state
        self._write_tree(self._remote.tree(tree), checkout)

    def _write_tree(self, tree: Tree, folder: Path) -> None:
        for entry in tree.iteritems():
            name, mode, sha = entry.path, entry.mode, entry.sha
            if not _safe_name(name):
                raise UntrustedGroundError(
                    "the branch's tree has an entry a checkout may not create",
                    path=name.decode(errors="replace"),
                    file_type="tree_entry",
                    reason="unsafe_name",
                )
            target = folder / os.fsdecode(name)
            if stat.S_ISDIR(mode):
                target.mkdir(mode=0o755)
                self._write_tree(self._remote.tree(sha), target)
            elif mode == _LINK_MODE:
                os.symlink(os.fsdecode(self._remote.blob(sha).as_raw_string()), target)
            elif stat.S_ISREG(mode):
                data = self._remote.blob(sha).as_raw_string()
                if len(data) > _MAX_BLOB_BYTES:
                    raise UntrustedGroundError(
                        "a file on the branch is larger than a checkout writes",
                        path=str(target.relative_to(self._checkout or folder)),
                        file_type="regular",
                        reason="too_large",
                    )
                perms = 0o755 if mode & 0o100 else 0o644
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, perms)
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view) :]
                finally:
                    os.close(fd)
            # Submodules (gitlinks) are not checked out: their content is elsewhere.

    @property
    def last_verifier_run(self) -> VerifierRun | None:
        return self._verifier.last_run if self._verifier is not None else None

    def verify(self, target: str) -> VerifierReport:
        """Run the allow-listed verifier ``target`` on a fresh checkout of the branch,
        bound to the branch's state before and after.

        Raises:
            AdapterError: no verifier, unknown target, or the command could not be
                started; the remote is unreachable.
        """
        if self._verifier is None:
            raise AdapterError("no verifier is configured", retryable=False, target=target)
        with self._lock:
            tip = self._read()
            self._materialise(self._tree_of(tip))
        return self._verifier.run(self, target)
