"""The declared tools' ledger of a run, in the run's own keys: the store's side.

Four scripts (one slot: the run's hash tag), each with its header in ``lua/``:

* ``ledger_init``: make the ledger once (instance id, version 1); no lease needed;
* ``ledger_admit``: a new owner's fence or a call, admitted only for the run's live lease
  at its current generation (storage-side fencing), judged (key, intent, precondition),
  with the call's ``started`` row written when asked;
* ``ledger_record``: what became of a call: ``committed`` with its receipt (the version
  moves on by one) or ``aborted``;
* ``ledger_pin``: the signed live contract of a run's declared-server tools, kept once
  (:mod:`ratchet.fleet.mcp_servers`).

Replies are turned into :class:`LedgerReply` here; what they mean for a tool call is
:mod:`ratchet.tools.store_ledger`'s business. Durability is the commit's: every script
write goes through the AOF like a commit (``appendfsync always`` in the supported set-up),
and with ``RATCHET_MIN_REPLICAS_ACK`` a write is confirmed by replicas like a commit.

``ledger_admit`` and ``ledger_record`` run twice per tool call, so they take the commit's
hot path (:class:`~ratchet.leasing.scripts.ScriptRunner`: the runner's own connection,
arguments packed by hiredis as text), not the pool's bookkeeping around every call.

:class:`ratchet.leasing.store.RedisStore` holds one :class:`LedgerRecords` as
``store.ledger``, built on the store's client, script runner and acknowledgement rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ratchet.errors import AdapterError, StoreProtocolError
from ratchet.leasing.acks import ReplicaAcks
from ratchet.leasing.keyspace import check_id, run_keys
from ratchet.leasing.plumbing import call
from ratchet.leasing.scripts import ScriptName, ScriptRunner

__all__ = ["LedgerMeta", "LedgerRecords", "LedgerReply"]


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


@dataclass(frozen=True, slots=True)
class LedgerReply:
    """A ledger script's reply: its status and the rest as text."""

    status: str
    values: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class LedgerMeta:
    """What the ledger hash says (None fields: never set)."""

    instance_id: str
    version: int
    store_epoch: str | None
    effects: int
    refused_stale: int
    refused_epoch: int
    contract: str | None = None  # the pinned live contract of declared-server tools


def _no_ledger(run_id: str) -> AdapterError:
    return AdapterError(
        "the run's tool ledger is missing from the store",
        retryable=False,
        reason="ledger_missing",
        run_id=run_id,
    )


class LedgerRecords:
    """The run-ledger scripts and reads of a store (see the module docstring): reads on
    ``client``, scripts on ``runner`` through ``acks``, so a ledger write is acknowledged
    like a commit."""

    def __init__(self, client: Any, runner: ScriptRunner, acks: ReplicaAcks) -> None:
        self._client = client
        self._runner = runner
        self._acks = acks

    def _write(
        self, name: ScriptName, run_id: str, keys: Sequence[str], args: Sequence[str | bytes | int]
    ) -> tuple[Any, int | None]:
        # Integers as their decimal text (what redis-py would send for them), so hiredis
        # packs the whole command at once.
        wire = [str(a) if type(a) is int else a for a in args]
        return call(name.value, run_id, lambda: self._acks.run(name, keys, wire))

    def _reply(self, name: ScriptName, run_id: str, raw: Any) -> LedgerReply:
        if not isinstance(raw, list) or not raw:
            raise StoreProtocolError(f"unexpected reply from {name.value}", run_id=run_id)
        return LedgerReply(_text(raw[0]), tuple(_text(v) for v in raw[1:] if v is not None))

    def init(self, run_id: str, instance_id: str) -> tuple[str, int]:
        """Make run ``run_id``'s ledger if it has none; its ``(instance id, version)``.

        Raises StoreUnavailableError, StoreProtocolError.
        """
        check_id(instance_id, "instance_id")
        raw, counted = self._write(
            ScriptName.LEDGER_INIT, run_id, [run_keys(run_id).ledger], [instance_id]
        )
        if not isinstance(raw, list) or len(raw) != 2 or raw[0] is None:
            raise StoreProtocolError("unexpected reply from ledger_init", run_id=run_id)
        self._acks.check(run_id, counted, wrote=True)
        return _text(raw[0]), int(raw[1])

    def admit(self, run_id: str, args: list[str | bytes | int]) -> LedgerReply:
        """``ledger_admit`` with ``args`` (its header's ARGV). Raises StoreUnavailableError,
        StoreProtocolError."""
        keys = run_keys(run_id)
        raw, counted = self._write(
            ScriptName.LEDGER_ADMIT, run_id, [keys.ledger, keys.calls, keys.lease, keys.state], args
        )
        reply = self._reply(ScriptName.LEDGER_ADMIT, run_id, raw)
        if reply.status == "ok" and args and args[0] in ("start", "fence"):
            self._acks.check(run_id, counted, wrote=True)
        return reply

    def record(self, run_id: str, args: list[str | bytes | int]) -> LedgerReply:
        """``ledger_record`` with ``args`` (its header's ARGV). Raises
        StoreUnavailableError, StoreProtocolError."""
        keys = run_keys(run_id)
        raw, counted = self._write(
            ScriptName.LEDGER_RECORD, run_id, [keys.ledger, keys.calls], args
        )
        reply = self._reply(ScriptName.LEDGER_RECORD, run_id, raw)
        if reply.status in ("committed", "aborted"):
            self._acks.check(run_id, counted, wrote=True)
        return reply

    def pin_contract(self, run_id: str, signed: str | None) -> str | None:
        """The run's pinned tool contract: ``signed`` pinned now when none is (``ledger_pin``),
        or only read when ``signed`` is None. None: nothing is pinned (only when reading).

        Raises:
            AdapterError: the run has no ledger (retryable=False).
            StoreUnavailableError, StoreProtocolError.
        """
        if signed is None:
            meta = self.meta(run_id)
            if meta is None:
                raise _no_ledger(run_id)
            return meta.contract
        raw, counted = self._write(
            ScriptName.LEDGER_PIN, run_id, [run_keys(run_id).ledger], [signed]
        )
        reply = self._reply(ScriptName.LEDGER_PIN, run_id, raw)
        if reply.status == "missing":
            raise _no_ledger(run_id)
        if reply.status != "ok" or len(reply.values) != 1:
            raise StoreProtocolError("unexpected reply from ledger_pin", run_id=run_id)
        self._acks.check(run_id, counted, wrote=True)
        return reply.values[0]

    def meta(self, run_id: str) -> LedgerMeta | None:
        """The ledger's instance, version, bound epoch and counters (None: no ledger).

        Raises StoreUnavailableError, StoreProtocolError.
        """
        key = run_keys(run_id).ledger
        fields = [
            "instance",
            "version",
            "epoch",
            "effects",
            "refused_stale",
            "refused_epoch",
            "contract",
        ]
        raw = call("ledger", run_id, lambda: self._client.hmget(key, fields))
        if not isinstance(raw, list) or len(raw) != len(fields):
            raise StoreProtocolError("unexpected ledger record", run_id=run_id)
        if raw[0] is None:
            return None
        try:
            return LedgerMeta(
                instance_id=_text(raw[0]),
                version=int(raw[1]),
                store_epoch=_text(raw[2]) or None if raw[2] is not None else None,
                effects=int(raw[3] or 0),
                refused_stale=int(raw[4] or 0),
                refused_epoch=int(raw[5] or 0),
                contract=_text(raw[6]) if raw[6] is not None else None,
            )
        except (TypeError, ValueError):
            raise StoreProtocolError("the ledger record is malformed", run_id=run_id) from None

    def row(self, run_id: str, key: str) -> bytes | None:
        """The JSON row of idempotency key ``key`` (None: never recorded).

        Raises StoreUnavailableError.
        """
        calls = run_keys(run_id).calls
        raw = call("ledger", run_id, lambda: self._client.hmget(calls, [key]))
        value = raw[0] if isinstance(raw, list) and raw else None
        return value if isinstance(value, bytes) else None
