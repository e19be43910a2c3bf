"""The declared tools' ledger in the store: a run's tool calls recorded in its own keys.

The file ledger (:mod:`ratchet.tools.ledger`) lives in the workspace folder, on one host's
disk: a run with declared tools could only continue on that host, a lost host took the
only proof of which calls were sent with it, and a disk restored from a backup said "no
row, so never sent" of a call that was. :class:`StoreLedger` keeps the same record
(instance, version, fences, a row per idempotency key: ``started``, ``committed``,
``aborted``) in the run's own Redis keys (``ratchet:{<run>}:ledger`` and ``:calls``,
one Cluster slot), written by scripts that are durable like a commit (AOF, and the replica
rule when it is on):

* **Storage-side fencing.** A new owner's fence and a call (its ``started`` row, or the
  check a tool without one gets before it is called) are admitted only for the run's live
  lease at its current generation, judged by the script against the run's lease and
  state hashes by Redis' clock: a worker that lost its lease is refused at the store,
  whatever it believes (``ledger_admit``).
* **Facts are kept.** What became of an admitted call (its receipt, or that it had no
  effect) is recorded whoever reports it, a worker whose lease lapsed during the call
  included: refusing it would lose the only record of an effect (``ledger_record``).
* **Any host.** Every worker reads the same record, so a run whose environment has no
  host-local part is continued by any worker on any host.
* **Unseen is not absent.** A ledger that is gone is an error, never an empty ledger:
  only the submitter makes one (``ledger_init``); a worker that finds none refuses.

It answers the same calls as :class:`~ratchet.tools.ledger.ToolLedger`, so
:class:`~ratchet.tools.adapter.ToolsAdapter` takes either.
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson

from ratchet.adapters.journal import epoch_refusal
from ratchet.errors import AdapterError, FenceRejectedError, IdempotencyConflictError
from ratchet.leasing import RedisStore
from ratchet.leasing.ledger import LedgerReply
from ratchet.runtime.ports import Fence, Receipt
from ratchet.tools.ledger import CallIntent, CallRow

__all__ = ["StoreLedger"]


def _receipt(text: str) -> Receipt:
    return Receipt.model_validate_json(text)


class StoreLedger:
    """The ledger of run ``run_id``'s declared tools, in ``store`` (see the module
    docstring). ``create``: make it when it does not exist (the submitter, before the run's
    first observation); a worker never does.

    Raises (constructor):
        AdapterError: no ledger exists and ``create`` is false (retryable=False): the run's
            record of its tool calls is gone, which proves nothing about them.
        StoreUnavailableError: the store could not be reached.
    """

    def __init__(self, store: RedisStore, run_id: str, *, create: bool = False) -> None:
        self._store = store
        self.run_id = run_id
        # The version as the store last answered it (every script reply carries it). An
        # observation answers from it: a call is admitted only at the version it was
        # planned against, judged by the store itself, so a version moved behind this
        # handle's back is refused there (a precondition failure), never acted on.
        self._version: int | None = None
        if create:
            self._instance, self._version = store.ledger.init(run_id, "tools-" + uuid.uuid4().hex)
        else:
            meta = store.ledger.meta(run_id)
            if meta is None:
                raise AdapterError(
                    "the run's tool ledger is missing from the store: its record of the "
                    "calls it sent is gone, which proves nothing about them",
                    retryable=False,
                    reason="ledger_missing",
                    run_id=run_id,
                )
            self._instance = meta.instance_id

    def __repr__(self) -> str:
        return f"StoreLedger(run_id={self.run_id!r})"

    @property
    def path(self) -> str:
        """Where the ledger lives (for reprs and messages)."""
        return f"store:{self.run_id}"

    def close(self) -> None:
        """Nothing to close: the store's connection is the fleet's."""

    # -- facts --------------------------------------------------------------------------

    def _meta(self) -> Any:
        meta = self._store.ledger.meta(self.run_id)
        if meta is None or meta.instance_id != self._instance:
            raise AdapterError(
                "the run's tool ledger is gone or another one replaced it",
                retryable=False,
                reason="ledger_missing",
                run_id=self.run_id,
            )
        return meta

    @property
    def instance_id(self) -> str:
        return self._instance

    @property
    def version(self) -> int:
        if self._version is None:
            self._version = int(self._meta().version)
        return self._version

    def refresh(self) -> int:
        """The version as the store has it now (a read, not the cached answer)."""
        self._version = int(self._meta().version)
        return self._version

    @property
    def store_epoch(self) -> str | None:
        value = self._meta().store_epoch
        return str(value) if value is not None else None

    def counters(self) -> tuple[int, int]:
        """``(effects, refused_stale)``: committed calls and refused stale callers."""
        meta = self._meta()
        return int(meta.effects), int(meta.refused_stale)

    def row(self, key: str) -> CallRow | None:
        """The key's row, or None: the key was never recorded."""
        raw = self._store.ledger.row(self.run_id, key)
        if raw is None:
            return None
        data = orjson.loads(raw)
        receipt = data.get("receipt")
        return CallRow(
            key,
            str(data["tool"]),
            str(data["intent"]),
            str(data["status"]),
            int(data.get("attempts") or 0),
            _receipt(receipt) if isinstance(receipt, str) else None,
        )

    def status(self, key: str) -> str | None:
        """The key's status (``started``, ``committed``, ``aborted``), or None."""
        found = self.row(key)
        return None if found is None else found.status

    # -- fences and calls ---------------------------------------------------------------

    def _admit(self, op: str, fence: Fence, rest: list[str | bytes | int]) -> LedgerReply:
        reply = self._store.ledger.admit(
            self.run_id,
            [op, fence.lease_version, fence.state_version, fence.store_epoch or "", *rest],
        )
        if reply.status == "lease":
            raise FenceRejectedError(
                "the store refused the call: the caller does not hold the run's live lease "
                "at its current generation",
                run_id=fence.run_id,
                fence=fence.key(),
                reason=reply.values[0] if reply.values else "lost",
            )
        if reply.status == "stale":
            raise FenceRejectedError(
                "fence is older than one already seen",
                run_id=fence.run_id,
                fence=fence.key(),
                seen=tuple(int(v) for v in reply.values[:2]),
            )
        if reply.status == "epoch":
            raise epoch_refusal(fence, reply.values[0])
        if reply.status == "no_ledger":
            raise AdapterError(
                "the run's tool ledger is missing from the store",
                retryable=False,
                reason="ledger_missing",
                run_id=self.run_id,
            )
        if reply.status in ("ok", "precondition") and reply.values:
            self._version = int(reply.values[0])
        return reply

    def raise_fence(self, fence: Fence) -> None:
        """Record ``fence`` as the run's highest, admitted only under the run's live lease.

        Raises:
            FenceRejectedError: the caller does not hold the run's live lease at its
                generation, or a higher fence (or another store's epoch) was seen.
        """
        self._admit("fence", fence, [])

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
        """:meth:`ToolLedger.begin_call`'s contract, judged by the store: the lease and
        fence, the key, the precondition, then (``durable``) the ``started`` row, all in
        one script call. ``fresh`` changes nothing here (every call reads the store)."""
        reply = self._admit(
            "start" if durable else "check",
            fence,
            [
                key,
                tool,
                intent_digest,
                approval_digest or "",
                expected_version,
                "1" if again else "",
            ],
        )
        if reply.status == "ok":
            return None
        if reply.status == "committed":
            return _receipt(reply.values[0])
        if reply.status == "conflict":
            row = orjson.loads(reply.values[0])
            receipt = row.get("receipt")
            raise IdempotencyConflictError(
                "key was used for another intent",
                idempotency_key=key,
                receipt=_receipt(receipt) if isinstance(receipt, str) else None,
            )
        if reply.status == "unresolved":
            raise AdapterError(
                "a previous call for this key is unresolved",
                retryable=True,
                idempotency_key=key,
                reason="unresolved",
            )
        if reply.status == "precondition":
            raise AdapterError(
                "environment precondition failed",
                retryable=False,
                expected=expected_version,
                actual=int(reply.values[0]),
            )
        raise AdapterError(f"unexpected ledger reply {reply.status!r}", retryable=True)

    def commit_call(
        self,
        key: str,
        *,
        namespace: str,
        result: dict[str, str | int],
        committed_at: int,
        call: CallIntent | None = None,
    ) -> Receipt:
        """:meth:`ToolLedger.commit_call`'s contract: the receipt recorded (the version
        moves on by one), or the one the key already has.

        Raises:
            AdapterError: no call is recorded for the key and none is described
                (retryable=False).
        """
        if call is not None:
            intent, approval = call.intent_digest, call.approval_digest
        else:
            raw = self._store.ledger.row(self.run_id, key)
            if raw is None:
                raise AdapterError(
                    "no recorded call to commit", retryable=False, idempotency_key=key
                )
            data = orjson.loads(raw)
            intent = str(data.get("intent", ""))
            found = data.get("approval")
            approval = found if isinstance(found, str) else None
        fields = {
            "namespace": namespace,
            "receipt_version": 1,
            "idempotency_key": key,
            "intent_digest": intent,
            "result": result,
            "committed_at": committed_at,
            "approval_digest": approval,
        }
        fence = call.fence if call is not None else None
        reply = self._store.ledger.record(
            self.run_id,
            [
                "commit",
                key,
                "1" if call is not None else "0",
                call.tool if call is not None else "",
                call.intent_digest if call is not None else "",
                (call.approval_digest or "") if call is not None else "",
                orjson.dumps(fields, option=orjson.OPT_SORT_KEYS),
                f"{fence.lease_version}:{fence.state_version}" if fence is not None else "",
                (fence.store_epoch or "") if fence is not None else "",
            ],
        )
        if reply.status == "committed":
            if len(reply.values) > 1:
                self._version = int(reply.values[1])
            return _receipt(reply.values[0])
        if reply.status == "no_call":
            raise AdapterError("no recorded call to commit", retryable=False, idempotency_key=key)
        raise AdapterError(
            f"the run's tool ledger refused the receipt ({reply.status})",
            retryable=False,
            idempotency_key=key,
        )

    def abort_call(self, key: str, call: CallIntent | None = None) -> None:
        """The tool refused the call with no effect, or a lookup showed it never happened:
        the key may be sent again. ``call`` records the refusal of a call with no row."""
        self._store.ledger.record(
            self.run_id,
            [
                "abort",
                key,
                "1" if call is not None else "0",
                call.tool if call is not None else "",
                call.intent_digest if call is not None else "",
                (call.approval_digest or "") if call is not None else "",
                "",
                "",
                "",
            ],
        )
