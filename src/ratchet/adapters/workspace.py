"""The workspace adapter: a real directory whose writes are fenced, journaled and receipted.

Layout::

    <root>/                 the workspace; only the allowed paths are written and fingerprinted
    <root>/.ratchet/        the state folder (never written by actions, never fingerprinted)
        journal.sqlite3     instance id, version, fences, intents and receipts (WAL, FULL sync)
        write.lock          an flock held across each whole write, observation and recovery
        tmp/                temp files, renamed over their targets

One write, in order (each step durable before the next)::

    flock ─▶ recover ─▶ BEGIN IMMEDIATE: fence, key, precondition, intent ─▶ COMMIT
          ─▶ temp file + fsync ─▶ rename over the target + fsync folder
          ─▶ BEGIN IMMEDIATE: receipt, version + 1, fingerprint ─▶ COMMIT ─▶ unlock

Why the write happens inside the critical section: the journal must say "intent" before
the file changes and "committed" after, and nobody else may observe, fence or write in
between, or an observation could pair a new file with an old version. SQLite cannot keep
its write lock across two commits, so an ``flock`` on ``write.lock`` spans the sequence;
the kernel drops it when a process dies, so a killed writer never wedges the others, and
the next holder finds the dead writer's ``intent`` row and resolves it (see
:meth:`WorkspaceAdapter._recover`) before doing anything else.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from ratchet.adapters.files import (
    STATE_DIR,
    AllowedPaths,
    atomic_delete,
    atomic_replace,
    content_sha,
    file_sha,
    fingerprint,
    write_temp,
)
from ratchet.adapters.gitobjects import GIT_DIR
from ratchet.adapters.gitread import GitReader, GitState, blob_id, state_facts
from ratchet.adapters.ground import Ground, file_type
from ratchet.adapters.journal import BUSY_TIMEOUT_SECONDS, Journal, WriteIntent
from ratchet.errors import AdapterError, ConfigurationError, UntrustedGroundError
from ratchet.runtime.actions import Action, ActionKind
from ratchet.runtime.ports import Clock, Fence, Observation, ReadResult, Receipt, VerifierReport

if TYPE_CHECKING:
    from ratchet.adapters.verifier import CommandVerifier, VerifierRun

__all__ = ["SystemClock", "WorkspaceAdapter", "WriteHook"]

WriteHook = Callable[[str], None]
"""Called with ``"after_intent"``, ``"after_replace"`` and ``"after_receipt"`` during a
write: crash drills kill the process there."""

_MAX_READ_BYTES = 1 << 20


class SystemClock:
    """Wall-clock seconds from the operating system."""

    def now(self) -> int:
        return int(time.time())


def _no_hook(stage: str) -> None:
    return None


class WorkspaceAdapter:
    """A directory as an environment: see the module docstring for the write protocol.

    Args:
        root: the workspace directory (must exist).
        allowed_paths: relative files or folders that may be written; they, plus git HEAD
            and the dirty flag when the workspace is a git work tree, make up the
            fingerprint.
        git: whether the workspace is a git work tree (its ``.git`` folder at ``root``).
            A worker passes what the run's signed document (or its checkpoint) recorded at
            submit, never what the disk says now: agent-written code could have run
            ``git init`` since. None decides from the disk once, here (for a folder the
            caller trusts). The repository is read as data (:mod:`ratchet.adapters.gitread`):
            no ``git`` runs, so nothing the repository configures is executed.
        namespace: the receipt namespace.
        verifier: runs allow-listed commands for :meth:`verify`.
        clock: commit times for receipts (default: the system clock).
        hook: crash-drill hook, called at each stage of a write.
        busy_timeout_s: how long a call waits for the journal's lock while another
            process holds it; then the call fails with a retryable AdapterError.

    Raises (constructor):
        ConfigurationError: ``root`` is not a directory, or an allowed path is invalid.
        AdapterError: the journal cannot be opened (retryable=True).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        allowed_paths: Iterable[str],
        *,
        namespace: str = "workspace",
        verifier: CommandVerifier | None = None,
        clock: Clock | None = None,
        hook: WriteHook | None = None,
        busy_timeout_s: float = BUSY_TIMEOUT_SECONDS,
        git: bool | None = None,
    ) -> None:
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise ConfigurationError("workspace root is not a directory", root=str(root))
        self.allowed = AllowedPaths(allowed_paths)
        self.state_dir = self.root / STATE_DIR
        self._ground = Ground(self.root)
        _check_state_dir(self._ground)
        self._tmp = self.state_dir / "tmp"
        self._tmp.mkdir(parents=True, exist_ok=True)
        self._namespace = namespace
        self._verifier = verifier
        self._clock: Clock = clock or SystemClock()
        self._hook = hook or _no_hook
        if git is None:
            found = self._ground.lstat(GIT_DIR)
            git = found is not None and stat.S_ISDIR(found.st_mode)
        self._git = git
        self._reader = GitReader(self._ground) if git else None
        self._thread_lock = threading.Lock()
        self._last_fingerprint: tuple[object, str] | None = None
        self._last_observation: Observation | None = None
        self._lock_fd = os.open(self.state_dir / "write.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            self._journal = Journal(
                self.state_dir / "journal.sqlite3", busy_timeout_s=busy_timeout_s
            )
        except BaseException:
            os.close(self._lock_fd)
            raise
        with self._locked(sweep=True):
            pass  # resolves whatever a crashed writer left behind, sweeps the temp folder

    def __repr__(self) -> str:
        return f"WorkspaceAdapter(root={str(self.root)!r}, namespace={self._namespace!r})"

    @property
    def git(self) -> bool:
        """Whether this workspace is read as a git work tree (fixed at construction)."""
        return self._git

    def __enter__(self) -> WorkspaceAdapter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the journal and the lock file. The adapter is unusable afterwards."""
        if self._lock_fd >= 0:
            self._journal.close()
            os.close(self._lock_fd)
            self._lock_fd = -1

    @property
    def namespace(self) -> str:
        return self._namespace

    @property
    def instance_id(self) -> str:
        return self._journal.instance_id

    @property
    def effects(self) -> int:
        """Writes this workspace has committed, over its whole life (all processes)."""
        with self._locked():
            return self._journal.counters()[0]

    @property
    def refused_stale(self) -> int:
        """Calls refused because a newer fence had been seen."""
        with self._locked():
            return self._journal.counters()[1]

    # -- locking and recovery ----------------------------------------------------------------

    @contextmanager
    def _locked(self, *, sweep: bool = False) -> Iterator[None]:
        if self._lock_fd < 0:
            raise AdapterError("workspace adapter is closed", retryable=False)
        with self._thread_lock:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                self._recover(sweep=sweep)
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _recover(self, *, sweep: bool = False) -> None:
        """Resolve writes whose writer died between the intent and the receipt.

        Timeline: intent committed -> [died] -> file untouched: abort (no effect).
                  intent committed -> file replaced -> [died]: commit the receipt now.
        The file itself says which: it holds the intended content (or is gone, for a
        delete) exactly when the rename happened, because the rename is atomic.

        Temp files are swept when a write was resolved here (or with ``sweep``, when the
        adapter opens): a writer makes its temp file only after its intent is committed,
        and the intent stays unresolved until its rename is judged, so a temp file left by
        a dead or failed writer always comes with an intent this finds.
        """
        rows = self._journal.unresolved()
        for row in rows:
            try:
                current = file_sha(self._ground, row.path)
            except AdapterError:
                current = "not-a-file"  # never opened: a FIFO or a device is not a write
            done = current == row.new_sha if row.op == "write" else current is None
            if done:
                self._journal.commit_write(
                    row.idempotency_key,
                    namespace=self._namespace,
                    fingerprint=self._scan()[0],
                    committed_at=self._clock.now(),
                )
            else:
                self._journal.abort_write(row.idempotency_key)
        if rows or sweep:
            # Under the lock no write is in progress: every temp file is garbage.
            for leftover in self._tmp.iterdir():
                leftover.unlink(missing_ok=True)

    # -- observation ---------------------------------------------------------------------------

    def _scan(self) -> tuple[str, dict[str, str], GitState | None]:
        files = self.allowed.files(self._ground)
        git = self._reader.status() if self._reader is not None else None
        # The fingerprint is a digest of exactly these facts: the last one is reused
        # when they read the same (the usual case between two writes).
        key = (tuple(files.items()), None if git is None else (git.head, git.dirty))
        last = self._last_fingerprint
        if last is None or last[0] != key:
            last = self._last_fingerprint = (key, fingerprint(files, git))
        return last[1], files, git

    @staticmethod
    def _details(git: GitState | None) -> dict[str, str]:
        return dict(state_facts(git))

    def _predict_dirty(self, state: GitState, path: str, content: bytes | None) -> bool:
        """Whether the tree would be dirty after writing ``content`` to ``path`` (None
        deletes): the path is dirty afterwards when its index entry differs from HEAD's,
        or the new content differs from the index entry; an untracked path never counts.
        """
        if any(p != path for p in state.changed):
            return True
        if self._reader is None:  # for the type checker: only called for git workspaces
            return False
        head = None if state.head == "unborn" else state.head
        in_index, in_head = self._reader.blobs_at(path, head)
        if in_index is None and in_head is None:
            return False  # untracked
        if in_index != in_head or content is None:
            return True  # staged already, or deleting a tracked file
        return blob_id(content) != in_index

    def _observe_locked(self, known: tuple[str | None, str | None] | None = None) -> Observation:
        fp, _, git = self._scan()
        version = self._journal.note_fingerprint(fp, known=known)
        details = self._details(git)
        last = self._last_observation
        if (
            last is not None
            and last.version == version
            and last.fingerprint == fp
            and last.instance_id == self.instance_id
            and last.details == details
        ):
            return last  # the same facts, validated once: a frozen model is shared
        made = Observation(
            instance_id=self.instance_id, version=version, fingerprint=fp, details=details
        )
        self._last_observation = made
        return made

    def observe(self) -> Observation:
        """Instance id, durable version, fingerprint of the allowed files (+ git facts).

        A fingerprint that differs from the last one recorded (an edit made outside the
        adapter) moves the version on, so the same version never names two states.

        Raises:
            AdapterError: the journal or git failed (retryable=True).
        """
        if self._lock_fd < 0:
            raise AdapterError("workspace adapter is closed", retryable=False)
        with self._thread_lock:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                # One read says whether a dead writer left an intent (then recovery runs
                # as under _locked, and the observation reads the journal afresh) and
                # what the version and recorded fingerprint are; the lock keeps it true.
                version, recorded, unresolved = self._journal.glance()
                if unresolved:
                    self._recover()
                    return self._observe_locked()
                return self._observe_locked((version, recorded))
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def project(self, action: Action, before: Observation) -> Observation | None:
        """The observation ``action`` would produce from ``before``, or None when
        ``before`` is not the current state or the action changes no file."""
        if action.kind not in (ActionKind.WRITE_FILE, ActionKind.DELETE_FILE):
            return None
        path = action.text("path")
        if path not in self.allowed:
            return None
        with self._locked():
            fp, files, git = self._scan()
            version = self._journal.note_fingerprint(fp)
            if (before.instance_id, before.version, before.fingerprint) != (
                self.instance_id,
                version,
                fp,
            ):
                return None
            data: bytes | None = None
            if action.kind is ActionKind.WRITE_FILE:
                data = action.text("content").encode()
                files[path] = content_sha(data)
            elif path in files:
                del files[path]
            else:
                return None
            after_git = None
            if git is not None:
                dirty = self._predict_dirty(git, path, data)
                after_git = GitState(head=git.head, dirty=dirty, changed=git.changed)
            return Observation(
                instance_id=self.instance_id,
                version=version + 1,
                fingerprint=fingerprint(files, after_git),
                details=self._details(after_git),
            )

    # -- fences, writes, receipts -------------------------------------------------------------

    def raise_fence(self, fence: Fence) -> None:
        """Record a new owner's fence without writing.

        Raises:
            FenceRejectedError: a higher (lease_version, state_version) was seen.
        """
        with self._locked():
            self._journal.raise_fence(fence)

    def _target(self, path: str) -> Path:
        if path not in self.allowed:
            raise AdapterError("path is outside the allowed paths", retryable=False, path=path)
        current = self.root
        for part in path.split("/"):
            current = current / part
            if current.is_symlink():
                raise AdapterError("path goes through a symbolic link", retryable=False, path=path)
        return current

    def execute(
        self, action: Action, intent_digest: str, fence: Fence, approval_digest: str | None
    ) -> Receipt:
        """Write or delete one file under ``action.idempotency_key``, or refuse.

        Raises:
            FenceRejectedError: a newer fence was seen for the run.
            IdempotencyConflictError: the key has a receipt for another intent.
            AdapterError: wrong kind, path outside the allowed paths, nothing to delete,
                or the version is not ``action.expected_env_version`` (retryable=False);
                I/O or journal failure (retryable=True).
        """
        if action.kind not in (ActionKind.WRITE_FILE, ActionKind.DELETE_FILE):
            raise AdapterError(
                "the workspace performs write_file and delete_file only",
                retryable=False,
                kind=str(action.kind),
            )
        key = action.idempotency_key
        if key is None:
            raise AdapterError("writes need an idempotency key", retryable=False)
        path = action.text("path")
        target = self._target(path)
        data = action.text("content").encode() if action.kind is ActionKind.WRITE_FILE else None
        temp = self._tmp / hashlib.sha256(key.encode()).hexdigest()[:40]
        with self._locked():
            fp, _, _ = self._scan()
            intent = WriteIntent(
                idempotency_key=key,
                intent_digest=intent_digest,
                op="write" if data is not None else "delete",
                path=path,
                new_sha=content_sha(data) if data is not None else None,
                prior_sha=file_sha(self._ground, path),
                temp_name=temp.name,
                approval_digest=approval_digest,
            )
            existing = self._journal.begin_write(
                intent, fence, fingerprint=fp, expected_version=action.expected_env_version
            )
            if existing is not None:
                return existing  # same key, same intent: no second effect
            if data is None and intent.prior_sha is None:
                self._journal.abort_write(key)
                raise AdapterError("nothing to delete", retryable=False, path=path)
            self._hook("after_intent")
            try:
                if data is not None:
                    write_temp(temp, data)
                    atomic_replace(temp, target)
                else:
                    atomic_delete(target)
            except OSError as exc:
                # Left as an intent: recovery compares the file with the intent and
                # settles it (the rename either happened or it did not).
                raise AdapterError(
                    "workspace write failed", retryable=True, path=path, error=type(exc).__name__
                ) from None
            self._hook("after_replace")
            receipt = self._journal.commit_write(
                key,
                namespace=self._namespace,
                fingerprint=self._scan()[0],
                committed_at=self._clock.now(),
            )
            self._hook("after_receipt")
            return receipt

    def lookup(self, idempotency_key: str) -> Receipt | None:
        """The authoritative receipt for a key, or None (after resolving any crash)."""
        with self._locked():
            return self._journal.receipt(idempotency_key)

    # -- reads and verification --------------------------------------------------------------

    def read(self, action: Action) -> ReadResult:
        """Read one allowed text file.

        Raises:
            UntrustedGroundError: the path is not a regular file (a FIFO, a device, a
                socket...), lies behind a link, or is larger than 1 MiB; it is not opened
                (or not read past the cap).
            AdapterError: wrong kind, path not allowed, missing or not UTF-8
                (retryable=False).
        """
        if action.kind is not ActionKind.READ_FILE:
            raise AdapterError(
                "the workspace reads read_file actions only",
                retryable=False,
                kind=str(action.kind),
            )
        path = action.text("path")
        self._target(path)
        with self._locked():
            # Never blocks on a FIFO, never opens a device, never reads past the cap.
            data = self._ground.read(path, limit=_MAX_READ_BYTES)
            if data is None:
                raise AdapterError("no such file", retryable=False, path=path)
            try:
                content = data.decode()
            except UnicodeDecodeError:
                raise AdapterError("file is not UTF-8 text", retryable=False, path=path) from None
            return ReadResult(content=content, env_version=self._observe_locked().version)

    @property
    def last_verifier_run(self) -> VerifierRun | None:
        """The output and exit facts of this adapter's last verifier run, for operators
        (the report carries digests only); None before the first or without a verifier."""
        return self._verifier.last_run if self._verifier is not None else None

    def verify(self, target: str) -> VerifierReport:
        """Run the allow-listed verifier ``target`` (see :class:`CommandVerifier`).

        Raises:
            AdapterError: no verifier is configured or the target is unknown
                (retryable=False); the command could not be started (retryable=True).
        """
        if self._verifier is None:
            raise AdapterError("no verifier is configured", retryable=False, target=target)
        return self._verifier.run(self, target)


def _check_state_dir(ground: Ground) -> None:
    """The state folder and the files the adapter opens in it must be what they seem: a
    folder (not a link to elsewhere) and regular files (a FIFO would block SQLite's read).
    It is hidden from every sandbox, so only someone outside could have put anything else
    there; refuse rather than open it.

    Raises:
        UntrustedGroundError: a link or a non-regular file where the adapter keeps state.
    """
    info = ground.lstat(STATE_DIR)
    if info is None:
        return
    if not stat.S_ISDIR(info.st_mode):
        kind = file_type(info.st_mode)
        raise UntrustedGroundError(
            f"the workspace's state folder {STATE_DIR} is a {kind.replace('_', ' ')}, not a "
            "folder; it is not used",
            path=STATE_DIR,
            file_type=kind,
            reason="not_regular",
        )
    for name in (
        "journal.sqlite3",
        "journal.sqlite3-wal",
        "journal.sqlite3-shm",
        "write.lock",
        "tools.ledger",
        "tmp",
    ):
        found = ground.lstat(f"{STATE_DIR}/{name}")
        expected = stat.S_ISDIR if name == "tmp" else stat.S_ISREG
        if found is not None and not expected(found.st_mode):
            kind = file_type(found.st_mode)
            raise UntrustedGroundError(
                f"{STATE_DIR}/{name} is a {kind.replace('_', ' ')}; the workspace's state "
                "is not opened",
                path=f"{STATE_DIR}/{name}",
                file_type=kind,
                reason="not_regular",
            )
