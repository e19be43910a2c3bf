"""The workspace journal: a SQLite file in the workspace's state folder that is the
authoritative record of what the workspace adapter did.

It holds the instance id (minted on first use), the durable environment version and the
fingerprint it was last seen at, the highest fence per run, and one row per idempotency
key: ``intent`` (recorded before the file is replaced), then ``committed`` with the
receipt, or ``aborted`` when recovery found the file was never replaced.

Every method runs its own ``BEGIN IMMEDIATE`` transaction, so two processes never
interleave a fence check with another's intent. The caller additionally holds the
workspace's writer lock (see :mod:`ratchet.adapters.workspace`) across a whole write.

SQLite failing under a call (the file locked by another process past the busy timeout,
the disk full, an I/O error) is an :class:`~ratchet.errors.AdapterError` with
``retryable=True`` and the SQLite error's name (``SQLITE_BUSY``, ``SQLITE_FULL``, ...):
the transaction rolled back, so nothing it was about to record is recorded, and a retry
later can succeed. A write whose file was replaced but whose receipt could not be
written stays an ``intent``, which the next call's recovery settles.
"""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from ratchet.errors import AdapterError, FenceRejectedError, IdempotencyConflictError
from ratchet.runtime.canonical import model_json
from ratchet.runtime.ports import Fence, Receipt

__all__ = ["IntentRow", "Journal", "WriteIntent", "epoch_refusal"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS fences (
    run_id TEXT PRIMARY KEY,
    lease_version INTEGER NOT NULL,
    state_version INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS writes (
    idempotency_key TEXT PRIMARY KEY,
    intent_digest TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('intent', 'committed', 'aborted')),
    op TEXT NOT NULL,
    path TEXT NOT NULL,
    new_sha TEXT,
    prior_sha TEXT,
    temp_name TEXT,
    approval_digest TEXT,
    run_id TEXT NOT NULL,
    lease_version INTEGER NOT NULL,
    state_version INTEGER NOT NULL,
    receipt TEXT,
    seq INTEGER
);
"""

#: How long a call waits for a lock another process holds before it gives up (retryable).
BUSY_TIMEOUT_SECONDS = 30.0


def _failure(exc: sqlite3.Error) -> AdapterError:
    name = getattr(exc, "sqlite_errorname", None) or type(exc).__name__
    return AdapterError(
        "workspace journal failed", retryable=True, error=name, detail=str(exc)[:200]
    )


@contextmanager
def _sqlite_errors() -> Iterator[None]:
    """SQLite's own errors as the adapter's retryable error (see the module docstring)."""
    try:
        yield
    except sqlite3.Error as exc:
        raise _failure(exc) from None


@dataclass(frozen=True, slots=True)
class WriteIntent:
    """What a write is about to do, recorded before the file is touched."""

    idempotency_key: str
    intent_digest: str
    op: str  # "write" or "delete"
    path: str
    new_sha: str | None  # None for a delete
    prior_sha: str | None  # None when the file did not exist
    temp_name: str | None
    approval_digest: str | None


@dataclass(frozen=True, slots=True)
class IntentRow:
    """A write recorded as ``intent`` and not yet resolved (found by recovery)."""

    idempotency_key: str
    op: str
    path: str
    new_sha: str | None
    prior_sha: str | None
    temp_name: str | None


class _EpochRefused(Exception):  # noqa: N818 - an internal signal, turned into the error
    def __init__(self, bound: str) -> None:
        super().__init__(bound)
        self.bound = bound

    def error(self, fence: Fence) -> FenceRejectedError:
        return epoch_refusal(fence, self.bound)


def epoch_refusal(fence: Fence, bound: str) -> FenceRejectedError:
    """The refusal of a fence from another store than the one an environment is bound to
    (the workspace journal's and the tool ledger's)."""
    return FenceRejectedError(
        "this environment serves another store (its epoch differs): a run of a wiped "
        "or re-initialised store may not write here; reset the environment to use it "
        "with this store",
        run_id=fence.run_id,
        reason="store_epoch",
        bound_epoch=bound,
        fence_epoch=fence.store_epoch,
    )


class Journal:
    """The SQLite journal of one workspace. Not thread-safe: the adapter serialises.

    Raises (constructor):
        AdapterError: the database cannot be opened or initialised (retryable=True).
    """

    def __init__(self, path: Path, *, busy_timeout_s: float = BUSY_TIMEOUT_SECONDS) -> None:
        self.path = path
        try:
            with _sqlite_errors():
                self._db = sqlite3.connect(
                    path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
                )
                # WAL with synchronous=FULL: every COMMIT is durable before it returns.
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=FULL")
            with self._txn():
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        self._db.execute(statement)
                if self._meta("instance_id") is None:
                    self._set("instance_id", "ws-" + uuid.uuid4().hex)
                    self._set("version", "1")
                    self._set("fingerprint", "")
                    self._set("refused_stale", "0")
                    self._set("seq", "0")
                self._instance_id = self._meta("instance_id") or ""
        except AdapterError as exc:
            self._close_quietly()
            raise AdapterError(
                "workspace journal cannot be opened",
                retryable=True,
                error=exc.context.get("error"),
            ) from None

    def _close_quietly(self) -> None:
        db = getattr(self, "_db", None)
        if db is not None:
            with suppress(sqlite3.Error):
                db.close()

    def close(self) -> None:
        self._db.close()

    @contextmanager
    def _txn(self) -> Iterator[None]:
        """One ``BEGIN IMMEDIATE`` transaction; rolled back on any exception, SQLite's
        own turned into the retryable :class:`AdapterError`."""
        with _sqlite_errors():
            self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
            self._db.execute("COMMIT")
        except BaseException as exc:
            if self._db.in_transaction:
                with suppress(sqlite3.Error):
                    self._db.execute("ROLLBACK")
            if isinstance(exc, sqlite3.Error):
                raise _failure(exc) from None
            raise

    def _meta(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def _set(self, key: str, value: str) -> None:
        self._db.execute(
            "INSERT INTO meta (key, value) VALUES (?, ?) "
            "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            (key, value),
        )

    def _int(self, key: str) -> int:
        return int(self._meta(key) or "0")

    # -- facts ------------------------------------------------------------------------------

    @property
    def instance_id(self) -> str:
        return self._instance_id

    def counters(self) -> tuple[int, int]:
        """``(effects, refused_stale)``: committed writes and refused stale fences."""
        with _sqlite_errors():
            row = self._db.execute("SELECT count(*) FROM writes WHERE status = 'committed'")
            return int(row.fetchone()[0]), self._int("refused_stale")

    def glance(self) -> tuple[str | None, str | None, bool]:
        """``(version, fingerprint last recorded, whether a write is unresolved)`` in one
        read: what an observation needs to know before and after it scans the files.
        Meaningful only to a caller that holds the workspace lock (every writer does), so
        it stays true until that caller writes."""
        with _sqlite_errors():
            version, recorded, unresolved = self._db.execute(
                "SELECT (SELECT value FROM meta WHERE key = 'version'), "
                "(SELECT value FROM meta WHERE key = 'fingerprint'), "
                "EXISTS (SELECT 1 FROM writes WHERE status = 'intent')"
            ).fetchone()
        return version, recorded, bool(unresolved)

    def note_fingerprint(
        self, fingerprint: str, *, known: tuple[str | None, str | None] | None = None
    ) -> int:
        """Record the fingerprint seen now and return the environment version.

        A fingerprint other than the last recorded one is a change made outside the
        adapter: the version moves on by one, so versions stay monotonic and every
        distinct state seen gets its own version. ``known`` is the ``(version,
        fingerprint)`` :meth:`glance` read under the same hold of the workspace lock.
        """
        # The common case, a state already recorded, is one read and no write lock (a
        # reader never waits for, or holds up, another process's write). The caller holds
        # the workspace lock, so the row cannot change between this read and the write
        # transaction below.
        if known is None:
            with _sqlite_errors():
                known = self._db.execute(
                    "SELECT (SELECT value FROM meta WHERE key = 'version'), "
                    "(SELECT value FROM meta WHERE key = 'fingerprint')"
                ).fetchone()
        version, recorded = known
        if recorded and recorded == fingerprint:
            return int(version or "0")
        with self._txn():
            return self._note(fingerprint)

    def _note(self, fingerprint: str) -> int:
        version = self._int("version")
        recorded = self._meta("fingerprint")
        if recorded == "":
            self._set("fingerprint", fingerprint)
        elif recorded != fingerprint:
            version += 1
            self._set("version", str(version))
            self._set("fingerprint", fingerprint)
        return version

    def _check_fence(self, fence: Fence) -> bool:
        epoch = fence.store_epoch
        if epoch is not None:
            bound = self._meta("store_epoch")
            if bound is None:
                self._set("store_epoch", epoch)
            elif bound != epoch:
                # Another store than the one this workspace serves (wiped, re-initialised,
                # or another fleet's): nothing of it is accepted (the refusal is counted
                # by the caller, once this transaction rolled back).
                raise _EpochRefused(bound)
        row = self._db.execute(
            "SELECT lease_version, state_version FROM fences WHERE run_id = ?", (fence.run_id,)
        ).fetchone()
        if row is not None and fence.key() < (int(row[0]), int(row[1])):
            self._set("refused_stale", str(self._int("refused_stale") + 1))
            return False
        self._db.execute(
            "INSERT INTO fences (run_id, lease_version, state_version) "
            "VALUES (?, ?, ?) ON CONFLICT (run_id) DO UPDATE SET "
            "lease_version = excluded.lease_version, "
            "state_version = excluded.state_version",
            (fence.run_id, fence.lease_version, fence.state_version),
        )
        return True

    def _count_epoch_refusal(self) -> None:
        # The refusing transaction rolled back: count it in one of its own.
        with self._txn():
            self._set("refused_epoch", str(self._int("refused_epoch") + 1))

    @property
    def store_epoch(self) -> str | None:
        """The store epoch this workspace is bound to (the first one a fence carried)."""
        with _sqlite_errors():
            return self._meta("store_epoch")

    def _seen(self, run_id: str) -> tuple[int, int] | None:
        row = self._db.execute(
            "SELECT lease_version, state_version FROM fences WHERE run_id = ?", (run_id,)
        ).fetchone()
        return None if row is None else (int(row[0]), int(row[1]))

    def raise_fence(self, fence: Fence) -> None:
        """Record ``fence`` as the run's highest, or refuse it.

        Raises:
            FenceRejectedError: a higher fence was seen (the refusal is counted).
        """
        try:
            with self._txn():
                accepted = self._check_fence(fence)
                seen = self._seen(fence.run_id)
        except _EpochRefused as refused:
            self._count_epoch_refusal()
            raise refused.error(fence) from None
        if not accepted:
            raise FenceRejectedError(
                "fence is older than one already seen",
                run_id=fence.run_id,
                fence=fence.key(),
                seen=seen,
            )

    def receipt(self, key: str) -> Receipt | None:
        """The committed receipt for ``key``, or None."""
        with _sqlite_errors():
            row = self._db.execute(
                "SELECT receipt FROM writes WHERE idempotency_key = ? AND status = 'committed'",
                (key,),
            ).fetchone()
        return None if row is None else Receipt.model_validate_json(row[0])

    # -- the write protocol ---------------------------------------------------------------------

    def begin_write(
        self, intent: WriteIntent, fence: Fence, *, expected_version: int, fingerprint: str
    ) -> Receipt | None:
        """Step 1, one transaction: fence check, idempotency check, precondition, intent.

        Returns the existing receipt when the key was already executed with the same
        intent (nothing is recorded); None when the intent is now recorded and the caller
        must replace the file and then call :meth:`commit_write`.

        Raises:
            FenceRejectedError: a newer fence was seen for the run.
            IdempotencyConflictError: the key has a receipt for another intent (carried as
                ``receipt``).
            AdapterError: the environment version is not ``expected_version``
                (retryable=False), or a previous intent for the key is unresolved
                (retryable=True).
        """
        refusal: AdapterError | None = None
        try:
            with self._txn():
                if not self._check_fence(fence):
                    refusal = FenceRejectedError(
                        "fence is older than one already seen",
                        run_id=fence.run_id,
                        fence=fence.key(),
                        seen=self._seen(fence.run_id),
                    )
                else:
                    row = self._db.execute(
                        "SELECT status, intent_digest, receipt FROM writes "
                        "WHERE idempotency_key = ?",
                        (intent.idempotency_key,),
                    ).fetchone()
                    if row is not None and row[0] == "committed":
                        existing = Receipt.model_validate_json(row[2])
                        if row[1] == intent.intent_digest:
                            return existing
                        refusal = IdempotencyConflictError(
                            "key was used for another intent",
                            idempotency_key=intent.idempotency_key,
                            receipt=existing,
                        )
                    elif row is not None and row[0] == "intent":
                        refusal = AdapterError(
                            "a previous write for this key is unresolved",
                            retryable=True,
                            idempotency_key=intent.idempotency_key,
                        )
                    else:
                        version = self._note(fingerprint)
                        if version != expected_version:
                            refusal = AdapterError(
                                "environment precondition failed",
                                retryable=False,
                                expected=expected_version,
                                actual=version,
                            )
                        else:
                            self._db.execute(
                                "DELETE FROM writes WHERE idempotency_key = ?",
                                (intent.idempotency_key,),
                            )
                            self._db.execute(
                                "INSERT INTO writes (idempotency_key, intent_digest, status, "
                                "op, path, new_sha, prior_sha, temp_name, approval_digest, "
                                "run_id, lease_version, state_version) "
                                "VALUES (?, ?, 'intent', ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                                (
                                    intent.idempotency_key,
                                    intent.intent_digest,
                                    intent.op,
                                    intent.path,
                                    intent.new_sha,
                                    intent.prior_sha,
                                    intent.temp_name,
                                    intent.approval_digest,
                                    fence.run_id,
                                    fence.lease_version,
                                    fence.state_version,
                                ),
                            )
        except _EpochRefused as refused:
            self._count_epoch_refusal()
            raise refused.error(fence) from None

        if refusal is not None:
            raise refusal
        return None

    def commit_write(
        self, key: str, *, namespace: str, fingerprint: str, committed_at: int
    ) -> Receipt:
        """Step 3, one transaction: the file is in place; write the receipt.

        The version moves on by one and the new fingerprint is recorded with it.

        Raises:
            AdapterError: no intent is recorded for the key (retryable=False).
        """
        with self._txn():
            row = self._db.execute(
                "SELECT intent_digest, path, approval_digest, op, new_sha FROM writes "
                "WHERE idempotency_key = ? AND status = 'intent'",
                (key,),
            ).fetchone()
            if row is None:
                raise AdapterError(
                    "no recorded intent to commit", retryable=False, idempotency_key=key
                )
            version = self._int("version") + 1
            seq = self._int("seq") + 1
            result: dict[str, str | int] = {"path": row[1], "op": row[3]}
            if row[4] is not None:
                result["sha256"] = row[4]
            receipt = Receipt(
                namespace=namespace,
                receipt_version=1,
                receipt_id=f"{self.instance_id}/{seq}",
                idempotency_key=key,
                intent_digest=row[0],
                result=result,
                committed_at=committed_at,
                env_version_after=version,
                approval_digest=row[2],
            )
            self._set("version", str(version))
            self._set("seq", str(seq))
            self._set("fingerprint", fingerprint)
            self._db.execute(
                "UPDATE writes SET status = 'committed', receipt = ?, seq = ?, "
                "temp_name = NULL WHERE idempotency_key = ?",
                (model_json(receipt).decode(), seq, key),
            )
        return receipt

    def abort_write(self, key: str) -> None:
        """Recovery: the file was never replaced; the intent had no effect."""
        with self._txn():
            self._db.execute(
                "UPDATE writes SET status = 'aborted', temp_name = NULL "
                "WHERE idempotency_key = ? AND status = 'intent'",
                (key,),
            )

    def unresolved(self) -> list[IntentRow]:
        """Writes recorded as ``intent`` whose writer died before the receipt."""
        with _sqlite_errors():
            rows = self._db.execute(
                "SELECT idempotency_key, op, path, new_sha, prior_sha, "
                "temp_name FROM writes WHERE status = 'intent'"
            ).fetchall()
        return [IntentRow(*row) for row in rows]
