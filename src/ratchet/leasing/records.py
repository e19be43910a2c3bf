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

:class:`ratchet.leasing.store.RedisStore` holds one :class:`RunRecords` as
``store.records``.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from ratchet.errors import ContractError
from ratchet.leasing.keyspace import run_keys
from ratchet.leasing.plumbing import call, check_blob, run_script
from ratchet.leasing.replies import decode_counted, decode_replaced
from ratchet.leasing.scripts import ScriptName, ScriptRunner
from ratchet.runtime.canonical import strict_json_loads
from ratchet.runtime.seals import seal_record
from ratchet.runtime.signing import KeyRing

__all__ = ["RunRecords"]

EVIDENCE_MAX_BYTES = 64 * 1024


class RunRecords:
    """Incidents and the evidence inbox of each run (see the module docstring), on the
    store's ``client`` and script ``runner``; a replaced document is capped at
    ``max_document_bytes`` (the store's ``max_scenario_bytes``)."""

    def __init__(
        self,
        client: Any,
        runner: ScriptRunner,
        *,
        max_document_bytes: int,
        keyring: KeyRing | None = None,
    ) -> None:
        self._client = client
        self._runner = runner
        self._max_document_bytes = max_document_bytes
        #: Seals each incident as it is written (None: written unsigned). A fleet sets it
        #: to its key ring once it has loaded it.
        self.keyring = keyring

    def record_incident(self, run_id: str, record: dict[str, Any], *, keep: int = 50) -> int:
        """Append an operator-facing incident (JSON) to the run, with an ``id``
        (``inc-...``) unless the record names one, sealed for the run when there is a
        ``keyring`` (floats then stored as text); returns Redis' time (ms).

        Raises RunNotFoundError, StoreUnavailableError, StoreProtocolError, ContractError
        (a record JSON cannot hold).
        """
        keys = run_keys(run_id)
        # Each incident has an id, so a decision that resolves one can name it.
        record = {"id": f"inc-{secrets.token_hex(6)}", **record}
        if self.keyring is not None:
            record = seal_record(self.keyring, run_id, record)
        text = json.dumps(record, sort_keys=True, separators=(",", ":"))
        reply = run_script(
            self._runner,
            ScriptName.RECORD_INCIDENT,
            run_id,
            [keys.incidents, keys.state],
            [text, keep],
        )
        return decode_counted(reply, run_id, script="record_incident", ok="recorded")

    def incidents(self, run_id: str, *, limit: int = 50) -> list[dict[str, Any]]:
        """The run's incidents, newest first, each with ``at_ms``."""
        keys = run_keys(run_id)
        raw = call("incidents", run_id, lambda: self._client.lrange(keys.incidents, 0, limit - 1))
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
        check_blob(evidence, run_id, "evidence", EVIDENCE_MAX_BYTES)
        reply = run_script(
            self._runner,
            ScriptName.POST_EVIDENCE,
            run_id,
            [keys.inbox, keys.state],
            [evidence, keep],
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
        check_blob(new, run_id, "scenario", self._max_document_bytes)
        reply = run_script(
            self._runner,
            ScriptName.REPLACE_DOCUMENT,
            run_id,
            [keys.scenario, keys.state],
            [old, new],
        )
        return decode_replaced(reply, run_id)

    def inbox(self, run_id: str, *, limit: int = 20) -> list[bytes]:
        """Evidence waiting in the run's inbox, newest first."""
        keys = run_keys(run_id)
        raw = call("inbox", run_id, lambda: self._client.lrange(keys.inbox, 0, limit - 1))
        return [item if isinstance(item, bytes) else str(item).encode() for item in raw]
