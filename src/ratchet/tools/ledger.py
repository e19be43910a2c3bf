"""The tool ledger: the SQLite record that makes a set of declared tools an environment.

A declared tool (a payments API, a ticket service) usually has no state ratchet can
observe, yet a run needs an environment with an instance, a version that one write moves
on by exactly one, fences and receipts. The ledger is that environment's record, kept
next to the tools (one file per environment; a fleet shares it the way it shares the
workspace). Its rows, one per idempotency key:

* ``started``: recorded (durably) *before* the tool is called, with the fence and the
  intent. A key with no row was provably never sent to the tool;
* ``committed``: the tool returned; the row holds the receipt, the version moved on;
* ``aborted``: the tool refused with no effect (or a lookup showed it never happened).

A ``started`` row found later is a call whose outcome a crash hid: the tool's recovery
(:class:`ratchet.runtime.tools.Recovery`) settles it, in :class:`ToolsAdapter`.

Durability. A ``started`` row matters after an operating-system crash only for a tool
whose recovery is ``review``: there it is the one proof that a key was never sent, so
it is fsync'd before the call (``durable=True``). For a tool with a lookup or a key the
service dedupes, recovery asks the tool, and a lost row only means asking it; so the
ledger's other transactions are written through (they survive the process: SQLite WAL
with ``synchronous=NORMAL``) but not fsync'd. A committed row lost to a power cut makes
the ledger's version fall behind the checkpoint's: the restore then fails closed on the
drift, never runs on a version used twice. Raised fences are fsync'd.

Fences are checked and raised here like the workspace journal's (the highest
``(lease_version, state_version)`` per run, and the store epoch bound on first use), so
the ledger refuses a stale owner's call before the tool sees it; a tool that checks
fences itself refuses it at its own storage as well (docs/tools.md says the difference).
"""

from __future__ import annotations

from dataclasses import dataclass

from ratchet.adapters.journal import FencedJournal, _EpochRefused
from ratchet.errors import AdapterError, IdempotencyConflictError
from ratchet.runtime.canonical import model_json
from ratchet.runtime.ports import Fence, Receipt

__all__ = ["CallRow", "ToolLedger"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS calls (
    idempotency_key TEXT PRIMARY KEY,
    tool TEXT NOT NULL,
    intent_digest TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('started', 'committed', 'aborted')),
    approval_digest TEXT,
    run_id TEXT NOT NULL,
    lease_version INTEGER NOT NULL,
    state_version INTEGER NOT NULL,
    attempts INTEGER NOT NULL,
    receipt TEXT,
    seq INTEGER
);
"""


@dataclass(frozen=True, slots=True)
class CallRow:
    """One key's row: which tool, which intent, where it stands."""

    idempotency_key: str
    tool: str
    intent_digest: str
    status: str
    attempts: int
    receipt: Receipt | None


class ToolLedger(FencedJournal):
    """The ledger of one tool environment (see the module docstring).

    Raises (constructor):
        AdapterError: the database cannot be opened or initialised (retryable=True).
    """

    _SCHEMA = _SCHEMA
    _PREFIX = "tools-"
    _WHAT = "tool ledger"
    _SYNCHRONOUS = "NORMAL"  # see the module docstring: durable where recovery needs it

    @property
    def version(self) -> int:
        return self._int("version")

    def counters(self) -> tuple[int, int]:
        """``(effects, refused_stale)``: committed calls and refused stale fences."""
        row = self._db.execute("SELECT count(*) FROM calls WHERE status = 'committed'")
        return int(row.fetchone()[0]), self._int("refused_stale")

    def row(self, key: str) -> CallRow | None:
        """The key's row, or None: the key was never sent to a tool."""
        found = self._db.execute(
            "SELECT idempotency_key, tool, intent_digest, status, attempts, receipt "
            "FROM calls WHERE idempotency_key = ?",
            (key,),
        ).fetchone()
        if found is None:
            return None
        receipt = Receipt.model_validate_json(found[5]) if found[5] else None
        return CallRow(found[0], found[1], found[2], found[3], int(found[4]), receipt)

    def begin_call(
        self,
        *,
        key: str,
        tool: str,
        intent_digest: str,
        approval_digest: str | None,
        fence: Fence,
        expected_version: int,
        again: bool,
        durable: bool = True,
    ) -> Receipt | None:
        """One transaction: fence, idempotency, precondition, then the ``started`` row
        (fsync'd before this returns when ``durable``; see the module docstring).

        Returns the committed receipt when the key already has one for this intent
        (nothing is recorded, the tool is not called); None when the call may go now.
        ``again`` allows a call over a ``started`` row (recovery decided the tool may be
        called again with the same key); without it such a row is refused.

        Raises:
            FenceRejectedError: a newer fence was seen for the run (or another store's).
            IdempotencyConflictError: the key belongs to another intent or tool.
            AdapterError: the environment version is not ``expected_version``
                (retryable=False), or a ``started`` row exists and ``again`` is false
                (retryable=True: recovery settles it first).
        """
        refusal: AdapterError | None = None
        try:
            with self._durable_txn() if durable else self._txn():
                if not self._check_fence(fence):
                    refusal = self._stale(fence)
                else:
                    refusal, existing = self._begin_locked(
                        key, tool, intent_digest, approval_digest, fence, expected_version, again
                    )
                    if existing is not None:
                        return existing
        except _EpochRefused as refused:
            self._count_epoch_refusal()
            raise refused.error(fence) from None
        if refusal is not None:
            raise refusal
        return None

    def _begin_locked(
        self,
        key: str,
        tool: str,
        intent_digest: str,
        approval_digest: str | None,
        fence: Fence,
        expected_version: int,
        again: bool,
    ) -> tuple[AdapterError | None, Receipt | None]:
        row = self.row(key)
        if row is not None and (row.intent_digest != intent_digest or row.tool != tool):
            return (
                IdempotencyConflictError(
                    "key was used for another intent",
                    idempotency_key=key,
                    receipt=row.receipt,
                ),
                None,
            )
        if row is not None and row.status == "committed":
            return None, row.receipt
        if row is not None and row.status == "started" and not again:
            return (
                AdapterError(
                    "a previous call for this key is unresolved",
                    retryable=True,
                    idempotency_key=key,
                ),
                None,
            )
        version = self._int("version")
        if version != expected_version:
            return (
                AdapterError(
                    "environment precondition failed",
                    retryable=False,
                    expected=expected_version,
                    actual=version,
                ),
                None,
            )
        attempts = 1 if row is None else row.attempts + 1
        self._db.execute(
            "INSERT INTO calls (idempotency_key, tool, intent_digest, status, approval_digest, "
            "run_id, lease_version, state_version, attempts) "
            "VALUES (?, ?, ?, 'started', ?, ?, ?, ?, ?) ON CONFLICT (idempotency_key) DO UPDATE "
            "SET status = 'started', run_id = excluded.run_id, "
            "lease_version = excluded.lease_version, state_version = excluded.state_version, "
            "attempts = excluded.attempts",
            (
                key,
                tool,
                intent_digest,
                approval_digest,
                fence.run_id,
                fence.lease_version,
                fence.state_version,
                attempts,
            ),
        )
        return None, None

    def commit_call(
        self, key: str, *, namespace: str, result: dict[str, str | int], committed_at: int
    ) -> Receipt:
        """One transaction: the tool returned ``result`` for ``key``; write the receipt and
        move the version on by one. A key already committed returns its receipt.

        Raises:
            AdapterError: no call is recorded for the key (retryable=False).
        """
        with self._txn():
            row = self.row(key)
            if row is not None and row.status == "committed" and row.receipt is not None:
                return row.receipt
            found = self._db.execute(
                "SELECT intent_digest, approval_digest FROM calls WHERE idempotency_key = ?",
                (key,),
            ).fetchone()
            if found is None:
                raise AdapterError(
                    "no recorded call to commit", retryable=False, idempotency_key=key
                )
            version = self._int("version") + 1
            seq = self._int("seq") + 1
            receipt = Receipt(
                namespace=namespace,
                receipt_version=1,
                receipt_id=f"{self.instance_id}/{seq}",
                idempotency_key=key,
                intent_digest=found[0],
                result=result,
                committed_at=committed_at,
                env_version_after=version,
                approval_digest=found[1],
            )
            self._set("version", str(version))
            self._set("seq", str(seq))
            self._db.execute(
                "UPDATE calls SET status = 'committed', receipt = ?, seq = ? "
                "WHERE idempotency_key = ?",
                (model_json(receipt).decode(), seq, key),
            )
        return receipt

    def abort_call(self, key: str) -> None:
        """The tool refused the call with no effect, or a lookup showed it never
        happened: the key may be sent again."""
        with self._txn():
            self._db.execute(
                "UPDATE calls SET status = 'aborted' WHERE idempotency_key = ? "
                "AND status = 'started'",
                (key,),
            )
