"""A run's operator-facing records beside its checkpoint: incidents (why a restore was
refused, evidence that did not verify) and the inbox of signed evidence (approvals,
reviewer decisions) that ``ratchet approve`` / ``ratchet review`` leave for a waiting run.

Both are bounded lists in the run's slot, appended by one script each (``record_incident``,
``post_evidence``) that refuses an unknown run.

Incidents are sealed as they are written when the store has a key ring
(``record_keyring``: every store a :class:`~ratchet.fleet.context.Fleet` builds has the
fleet's), so an export tells them from records pushed into Redis by hand
(:mod:`ratchet.runtime.seals`; the store's time stamp beside each stays outside the seal).
Readers get the ``seal`` field with the record.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from ratchet.errors import ContractError
from ratchet.leasing.keyspace import run_keys
from ratchet.leasing.plumbing import StorePlumbing
from ratchet.leasing.replies import decode_counted, decode_replaced
from ratchet.leasing.scripts import ScriptName
from ratchet.runtime.canonical import strict_json_loads
from ratchet.runtime.seals import seal_record
from ratchet.runtime.signing import KeyRing

__all__ = ["RunRecords"]

EVIDENCE_MAX_BYTES = 64 * 1024


class RunRecords(StorePlumbing):
    """Incidents and the evidence inbox of one run (see the module docstring)."""

    max_scenario_bytes: int  # set by RedisStore: the cap a document is stored under
    #: Seals each incident as it is written (set by RedisStore; None: written unsigned).
    record_keyring: KeyRing | None = None

    def record_incident(self, run_id: str, record: dict[str, Any], *, keep: int = 50) -> int:
        """Append an operator-facing incident (JSON) to the run, with an ``id``
        (``inc-...``) unless the record names one, sealed for the run when the store has
        a ``record_keyring`` (floats then stored as text); returns Redis' time (ms).

        Raises RunNotFoundError, StoreUnavailableError, StoreProtocolError, ContractError
        (a record JSON cannot hold).
        """
        keys = run_keys(run_id)
        # Each incident has an id, so a decision that resolves one can name it.
        record = {"id": f"inc-{secrets.token_hex(6)}", **record}
        if self.record_keyring is not None:
            record = seal_record(self.record_keyring, run_id, record)
        text = json.dumps(record, sort_keys=True, separators=(",", ":"))
        reply = self._run(
            ScriptName.RECORD_INCIDENT, run_id, [keys.incidents, keys.state], [text, keep]
        )
        return decode_counted(reply, run_id, script="record_incident", ok="recorded")

    def incidents(self, run_id: str, *, limit: int = 50) -> list[dict[str, Any]]:
        """The run's incidents, newest first, each with ``at_ms``."""
        keys = run_keys(run_id)
        raw = self._call(
            "incidents", run_id, lambda: self._client.lrange(keys.incidents, 0, limit - 1)
        )
        out: list[dict[str, Any]] = []
        for item in raw:
            text = item.decode("utf-8", "replace") if isinstance(item, bytes) else str(item)
            at, _, body = text.partition("|")
            try:  # by shape: an object, nested at most once (a refusal's evidence)
                parsed = strict_json_loads(body, max_depth=2)
            except ContractError:
                parsed = None
            if isinstance(parsed, dict):
                record = parsed
            else:
                record = {"kind": "unreadable", "malformed": body[:200]}
            record["at_ms"] = int(at) if at.isdigit() else None
            out.append(record)
        return out

    def post_evidence(self, run_id: str, evidence: bytes, *, keep: int = 20) -> int:
        """Leave signed evidence (JSON) in the run's inbox; returns the inbox length.

        Raises RunNotFoundError, StoreUnavailableError, StoreProtocolError.
        """
        keys = run_keys(run_id)
        self._check_blob(evidence, run_id, "evidence", EVIDENCE_MAX_BYTES)
        reply = self._run(
            ScriptName.POST_EVIDENCE, run_id, [keys.inbox, keys.state], [evidence, keep]
        )
        return decode_counted(reply, run_id, script="post_evidence", ok="posted")

    def replace_document(self, run_id: str, old: bytes, new: bytes) -> bool:
        """Swap the run's stored document for ``new`` if it is still exactly ``old``
        (compare-and-set). Returns False when it changed meanwhile (nothing written).

        The caller verified ``old`` and made ``new`` by signing the very same document
        again; this only makes the swap atomic. Raises RunNotFoundError,
        StoreUnavailableError, StoreProtocolError.
        """
        keys = run_keys(run_id)
        self._check_blob(new, run_id, "scenario", self.max_scenario_bytes)
        reply = self._run(
            ScriptName.REPLACE_DOCUMENT, run_id, [keys.scenario, keys.state], [old, new]
        )
        return decode_replaced(reply, run_id)

    def inbox(self, run_id: str, *, limit: int = 20) -> list[bytes]:
        """Evidence waiting in the run's inbox, newest first."""
        keys = run_keys(run_id)
        raw = self._call("inbox", run_id, lambda: self._client.lrange(keys.inbox, 0, limit - 1))
        return [item if isinstance(item, bytes) else str(item).encode() for item in raw]
