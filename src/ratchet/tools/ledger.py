"""The tool ledger: the record that makes a set of declared tools an environment.

A declared tool (a payments API, a ticket service) usually has no state ratchet can
observe, yet a run needs an environment with an instance, a version that one write moves
on by exactly one, fences and receipts. The ledger is that environment's record, kept
next to the tools (one file per environment; a fleet shares it the way it shares the
workspace). Per idempotency key it records:

* ``started``: written *before* the tool is called, with the fence and the intent, for a
  tool whose recovery is ``review``: a key with no row was provably never sent to it;
* ``committed``: the tool returned; the row holds the receipt, the version moved on;
* ``aborted``: the tool refused with no effect (or a lookup showed it never happened).

A tool with a lookup, or one whose service dedupes by key, needs no ``started`` row: its
recovery asks the tool, so its call is recorded once, when it returned.

The file. An append-only log of JSON lines (``meta``, ``fence``, ``refused``, ``start``,
``commit``, ``abort``), folded into the state above; every process that opens it reads
what the others appended before it acts, under an exclusive ``flock`` for anything that
writes. A line only counts once it ends in a newline: a line torn by an operating-system
crash is cut off when the file is next opened. Why a log and not SQLite: a call costs one
``write`` here (measured in BENCHMARKS.md, ``durable_steps.py``'s ``ratchet_tool``); the
ledger's queries are all by key, and the state is small.

Durability. A ``started`` row matters after an operating-system crash only for a tool
whose recovery is ``review`` (it is the one proof that a key was never sent), and a raised
fence is what refuses a stale owner later: both are ``fdatasync``'d before they count.
``commit`` and ``abort`` lines are written through (they survive the process) but not
synced: a committed line lost to a power cut makes the ledger's version fall behind the
checkpoint's, and the restore then fails closed on the drift; it never runs on a version
used twice.

Fences are checked and raised like the workspace journal's (the highest
``(lease_version, state_version)`` per run, and the store epoch bound on first use), so
the ledger refuses a stale owner's call before the tool sees it; a tool that checks
fences itself refuses it at its own storage as well (docs/tools.md says the difference).
"""

from __future__ import annotations

import fcntl
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import orjson

from ratchet.adapters.journal import epoch_refusal
from ratchet.errors import AdapterError, FenceRejectedError, IdempotencyConflictError
from ratchet.runtime.ports import Fence, Receipt

__all__ = ["CallIntent", "CallLedger", "CallRow", "ToolLedger"]


@dataclass(frozen=True, slots=True)
class CallIntent:
    """A call recorded only once it returned: which tool, intent, approval and fence."""

    tool: str
    intent_digest: str
    approval_digest: str | None
    fence: Fence | None  # None: found by the tool's lookup, not sent under a fence now


@dataclass(frozen=True, slots=True)
class CallRow:
    """One key's row: which tool, which intent, where it stands."""

    idempotency_key: str
    tool: str
    intent_digest: str
    status: str
    attempts: int
    receipt: Receipt | None


class CallLedger(Protocol):
    """What :class:`~ratchet.tools.adapter.ToolsAdapter` needs of a ledger: this module's
    file ledger, or the run's ledger in the store (:mod:`ratchet.tools.store_ledger`)."""

    @property
    def path(self) -> Any: ...

    @property
    def instance_id(self) -> str: ...

    @property
    def version(self) -> int: ...

    @property
    def store_epoch(self) -> str | None: ...

    def counters(self) -> tuple[int, int]: ...

    def status(self, key: str) -> str | None: ...

    def row(self, key: str) -> CallRow | None: ...

    def raise_fence(self, fence: Fence) -> None: ...

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
        fresh: bool = False,
    ) -> Receipt | None: ...

    def commit_call(
        self,
        key: str,
        *,
        namespace: str,
        result: dict[str, str | int],
        committed_at: int,
        call: CallIntent | None = None,
    ) -> Receipt: ...

    def abort_call(self, key: str, call: CallIntent | None = None) -> None: ...

    def close(self) -> None: ...


@dataclass(slots=True)
class _Row:
    tool: str
    intent: str
    approval: str | None
    status: str
    attempts: int = 0
    # The receipt's JSON: one object per row, parsed on demand (a long-lived ledger holds
    # a row per call; nested dicts would make every garbage collection walk them).
    receipt: bytes | None = None


@dataclass
class _State:
    instance_id: str = ""
    version: int = 1
    store_epoch: str | None = None
    refused_stale: int = 0
    refused_epoch: int = 0
    fences: dict[str, tuple[int, int]] = field(default_factory=dict)
    rows: dict[str, _Row] = field(default_factory=dict)

    def raise_to(self, run_id: str, seen: tuple[int, int]) -> None:
        if seen > self.fences.get(run_id, (-1, -1)):
            self.fences[run_id] = seen

    def apply(self, record: dict[str, Any]) -> None:
        kind = record["t"]
        if kind == "meta":
            self.instance_id = str(record["instance"])
        elif kind == "fence":
            self.raise_to(str(record["run"]), (int(record["lv"]), int(record["sv"])))
            if record.get("epoch") is not None and self.store_epoch is None:
                self.store_epoch = str(record["epoch"])
        elif kind == "refused":
            if record.get("why") == "epoch":
                self.refused_epoch += 1
            else:
                self.refused_stale += 1
        elif kind in ("start", "commit", "abort"):
            self._apply_call(kind, record)

    def _apply_call(self, kind: str, record: dict[str, Any]) -> None:
        key = str(record["k"])
        row = self.rows.get(key)
        if row is None:
            row = self.rows[key] = _Row(
                str(record.get("tool", "")),
                str(record.get("intent", "")),
                record.get("approval"),
                "aborted",
            )
        if record.get("run") is not None:
            self.raise_to(str(record["run"]), (int(record["lv"]), int(record["sv"])))
        if kind == "start":
            row.status, row.attempts = "started", row.attempts + 1
        elif kind == "commit":
            row.status = "committed"
            row.receipt = orjson.dumps(record["receipt"], option=orjson.OPT_SORT_KEYS)
            row.attempts = max(row.attempts, 1)
            self.version += 1
        elif row.status != "committed":
            row.status = "aborted"

    def committed(
        self,
        key: str,
        tool: str,
        intent: str,
        approval: str | None,
        fence: Fence | None,
        receipt_json: bytes,
    ) -> None:
        """Our own ``commit`` line, folded in without parsing it back (what
        :meth:`apply` makes of the same line read from the file)."""
        row = self.rows.get(key)
        if row is None:
            row = self.rows[key] = _Row(tool, intent, approval, "aborted")
        if fence is not None:
            self.raise_to(fence.run_id, (fence.lease_version, fence.state_version))
        row.status, row.receipt = "committed", receipt_json
        row.attempts = max(row.attempts, 1)
        self.version += 1


def _fence_fields(fence: Fence | None) -> dict[str, Any]:
    if fence is None:
        return {}
    return {"run": fence.run_id, "lv": fence.lease_version, "sv": fence.state_version}


class ToolLedger:
    """The ledger of one tool environment (see the module docstring). Not thread-safe:
    the adapter serialises its own calls; other processes are kept out by ``flock``.

    Raises (constructor):
        AdapterError: the file cannot be opened or read (retryable=True).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._state = _State()
        self._offset = 0
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError as exc:
            raise AdapterError(
                "tool ledger cannot be opened", retryable=True, error=type(exc).__name__
            ) from None
        try:
            with self._locked(repair=True):
                if not self._state.instance_id:
                    self._append({"t": "meta", "instance": "tools-" + uuid.uuid4().hex}, True)
        except BaseException:
            os.close(self._fd)
            raise

    def close(self) -> None:
        os.close(self._fd)

    # -- the log ------------------------------------------------------------------------

    def _refresh(self) -> None:
        """Fold in what was appended since the last read (complete lines only)."""
        size = os.fstat(self._fd).st_size
        if size <= self._offset:
            return
        data = os.pread(self._fd, size - self._offset, self._offset)
        end = data.rfind(b"\n")
        if end < 0:
            return
        for line in data[: end + 1].splitlines():
            if line:
                self._state.apply(orjson.loads(line))
        self._offset += end + 1

    def _lock(self, *, repair: bool = False) -> None:
        """Take the exclusive lock and fold in what others appended; the caller unlocks
        (``fcntl.flock(fd, LOCK_UN)``) in a ``finally``. Raises AdapterError (retryable),
        unlocked, when the file cannot be locked or read."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except OSError as exc:
            raise AdapterError(
                "tool ledger cannot be locked", retryable=True, error=type(exc).__name__
            ) from None
        try:
            self._refresh()
            if repair and os.fstat(self._fd).st_size > self._offset:
                # A line torn by a crash (no newline): it never counted; cut it off.
                os.ftruncate(self._fd, self._offset)
        except (OSError, ValueError, KeyError, orjson.JSONDecodeError) as exc:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            raise AdapterError(
                "tool ledger cannot be read", retryable=True, error=type(exc).__name__
            ) from None

    @contextmanager
    def _locked(self, *, repair: bool = False) -> Iterator[None]:
        self._lock(repair=repair)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _append(self, record: dict[str, Any], durable: bool) -> None:
        """Write ``record`` as the log's next line (see :meth:`_write`), then fold it in."""
        self._write(record, durable)
        self._state.apply(record)

    def _write(self, record: dict[str, Any], durable: bool) -> None:
        """Write ``record`` as the log's next line (``fdatasync``'d when ``durable``); the
        caller holds the lock and folds the record into the state."""
        line = orjson.dumps(record, option=orjson.OPT_SORT_KEYS | orjson.OPT_APPEND_NEWLINE)
        try:
            written = os.write(self._fd, line)
            if durable and written == len(line):
                os.fdatasync(self._fd)
        except OSError as exc:
            # A full disk, an I/O error: the call fails. A line that reached the page cache
            # before its sync failed counts when it is read back: a started row then makes
            # the key's outcome unknown (review), a fence only refuses more; never less.
            raise AdapterError(
                "tool ledger cannot be written", retryable=True, error=type(exc).__name__
            ) from None
        if written != len(line):
            raise AdapterError("tool ledger write was cut short", retryable=True)
        self._offset += written

    def _read(self) -> _State:
        self._refresh()
        return self._state

    # -- facts --------------------------------------------------------------------------

    @property
    def instance_id(self) -> str:
        return self._state.instance_id

    @property
    def version(self) -> int:
        return self._read().version

    @property
    def store_epoch(self) -> str | None:
        """The store epoch this environment is bound to (the first one a fence carried)."""
        return self._read().store_epoch

    def counters(self) -> tuple[int, int]:
        """``(effects, refused_stale)``: committed calls and refused stale fences."""
        state = self._read()
        return sum(r.status == "committed" for r in state.rows.values()), state.refused_stale

    def status(self, key: str) -> str | None:
        """The key's status (``started``, ``committed``, ``aborted``), or None."""
        found = self._read().rows.get(key)
        return None if found is None else found.status

    def row(self, key: str) -> CallRow | None:
        """The key's row, or None: the key was never recorded."""
        self._refresh()
        return self._row_of(key)

    def _row_of(self, key: str) -> CallRow | None:
        found = self._state.rows.get(key)
        if found is None:
            return None
        receipt = Receipt.model_validate_json(found.receipt) if found.receipt is not None else None
        return CallRow(key, found.tool, found.intent, found.status, found.attempts, receipt)

    # -- fences -------------------------------------------------------------------------

    def _fence_refusal(self, fence: Fence) -> FenceRejectedError | None:
        """Under the lock: the refusal ``fence`` earns (counted), or None."""
        state = self._state
        bound = state.store_epoch
        if fence.store_epoch is not None and bound is not None and bound != fence.store_epoch:
            self._append({"t": "refused", "why": "epoch"}, False)
            return epoch_refusal(fence, bound)
        seen = state.fences.get(fence.run_id)
        if seen is not None and fence.key() < seen:
            self._append({"t": "refused", "why": "stale"}, False)
            return FenceRejectedError(
                "fence is older than one already seen",
                run_id=fence.run_id,
                fence=fence.key(),
                seen=seen,
            )
        return None

    def _refused_now(self, fence: Fence) -> bool:
        """Whether ``fence`` would be refused by the state as read (no lock, no count)."""
        state = self._state
        bound = state.store_epoch
        if fence.store_epoch is not None and bound is not None and bound != fence.store_epoch:
            return True
        seen = state.fences.get(fence.run_id)
        return seen is not None and fence.key() < seen

    def raise_fence(self, fence: Fence) -> None:
        """Record ``fence`` as the run's highest (durably), or refuse it.

        Raises:
            FenceRejectedError: a higher fence (or another store's epoch) was seen; the
                refusal is counted.
        """
        with self._locked():
            refusal = self._fence_refusal(fence)
            if refusal is None:
                record = {"t": "fence", "epoch": fence.store_epoch, **_fence_fields(fence)}
                self._append(record, True)
        if refusal is not None:
            raise refusal

    # -- calls --------------------------------------------------------------------------

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
        fresh: bool = False,
    ) -> Receipt | None:
        """Fence, idempotency and precondition, then (``durable``) the ``started`` row,
        fsync'd before this returns. Without ``durable`` nothing is written unless a
        fence is refused: :meth:`commit_call` records the call once it returned; with
        ``fresh`` (the caller read the ledger just before, e.g. :meth:`status`) those
        checks read the state as that read left it.

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
        if not durable:
            if not fresh:
                self._refresh()
            return self._check_only(key, tool, intent_digest, fence, expected_version, again)
        with self._locked():
            refusal: AdapterError | None = self._fence_refusal(fence)
            existing: Receipt | None = None
            if refusal is None:
                refusal, existing = self._judge(key, tool, intent_digest, again=again)
            if refusal is None and existing is None:
                if self._state.version != expected_version:
                    refusal = AdapterError(
                        "environment precondition failed",
                        retryable=False,
                        expected=expected_version,
                        actual=self._state.version,
                    )
                elif durable:
                    record = {
                        "t": "start",
                        "k": key,
                        "tool": tool,
                        "intent": intent_digest,
                        "approval": approval_digest,
                        **_fence_fields(fence),
                    }
                    self._append(record, True)
        if refusal is not None:
            raise refusal
        return existing

    def _check_only(
        self,
        key: str,
        tool: str,
        intent_digest: str,
        fence: Fence,
        expected_version: int,
        again: bool,
    ) -> Receipt | None:
        """:meth:`begin_call`'s checks without a row: nothing is written unless a fence is
        refused, so they read the state as last refreshed (a refusal takes the lock, to be
        judged again and counted)."""
        if self._refused_now(fence):
            with self._locked():
                stale = self._fence_refusal(fence)
            if stale is not None:
                raise stale
        refusal, existing = self._judge(key, tool, intent_digest, again=again)
        if refusal is None and existing is None and self._state.version != expected_version:
            refusal = AdapterError(
                "environment precondition failed",
                retryable=False,
                expected=expected_version,
                actual=self._state.version,
            )
        if refusal is not None:
            raise refusal
        return existing

    def _judge(
        self, key: str, tool: str, intent_digest: str, *, again: bool
    ) -> tuple[AdapterError | None, Receipt | None]:
        """What an existing row says about a new call of ``key``: a refusal, the receipt
        to return, or (None, None): the call may go (reads the state as last refreshed)."""
        row = self._row_of(key)
        if row is not None and (row.intent_digest != intent_digest or row.tool != tool):
            return (
                IdempotencyConflictError(
                    "key was used for another intent", idempotency_key=key, receipt=row.receipt
                ),
                None,
            )
        if row is not None and row.status == "committed":
            return None, row.receipt
        if row is not None and row.status == "started" and not again:
            return (
                AdapterError(
                    "a previous call for this key is unresolved",
                    reason="unresolved",
                    retryable=True,
                    idempotency_key=key,
                ),
                None,
            )
        return None, None

    def commit_call(
        self,
        key: str,
        *,
        namespace: str,
        result: dict[str, str | int],
        committed_at: int,
        call: CallIntent | None = None,
    ) -> Receipt:
        """The tool returned ``result`` for ``key``: write the receipt, move the version on
        by one and record the call's fence (never lowering one seen). A key already
        committed returns its receipt. ``call`` describes a call that has no ``started``
        row (a tool whose recovery does not need one).

        Raises:
            AdapterError: no call is recorded for the key and none is described
                (retryable=False).
        """
        # The lock by hand, not through _locked(): this runs once per call.
        self._lock()
        try:
            state = self._state
            row = state.rows.get(key)
            if row is not None and row.status == "committed" and row.receipt is not None:
                return Receipt.model_validate_json(row.receipt)
            if row is None and call is None:
                raise AdapterError(
                    "no recorded call to commit", retryable=False, idempotency_key=key
                )
            tool, intent, approval = (
                (call.tool, call.intent_digest, call.approval_digest)
                if call is not None
                else (row.tool, row.intent, row.approval)  # type: ignore[union-attr]
            )
            version = state.version + 1
            fields: dict[str, Any] = {
                "namespace": namespace,
                "receipt_version": 1,
                "receipt_id": f"{state.instance_id}/{version - 1}",
                "idempotency_key": key,
                "intent_digest": intent,
                "result": result,
                "committed_at": committed_at,
                "env_version_after": version,
                "approval_digest": approval,
            }
            receipt = Receipt.model_validate(fields)
            fence = call.fence if call is not None else None
            if fence is not None and fence.store_epoch is not None and not state.store_epoch:
                self._append(
                    {"t": "fence", "epoch": fence.store_epoch, **_fence_fields(fence)}, False
                )
            # The receipt is serialised once: its bytes go into the line as they are and
            # into the row the state keeps.
            receipt_json = orjson.dumps(fields, option=orjson.OPT_SORT_KEYS)
            record = {
                "t": "commit",
                "k": key,
                "tool": tool,
                "intent": intent,
                "approval": approval,
                "receipt": orjson.Fragment(receipt_json),
                **_fence_fields(fence),
            }
            self._write(record, False)
            state.committed(key, tool, intent, approval, fence, receipt_json)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        return receipt

    def abort_call(self, key: str, call: CallIntent | None = None) -> None:
        """The tool refused the call with no effect, or a lookup showed it never
        happened: the key may be sent again (with its intent). ``call`` records the
        refusal of a call that has no ``started`` row."""
        with self._locked():
            row = self._state.rows.get(key)
            if row is not None and row.status != "started":
                return
            if row is None and call is None:
                return
            record: dict[str, Any] = {"t": "abort", "k": key}
            if row is None and call is not None:
                record |= {
                    "tool": call.tool,
                    "intent": call.intent_digest,
                    "approval": call.approval_digest,
                    **_fence_fields(call.fence),
                }
            self._append(record, False)
