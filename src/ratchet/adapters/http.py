"""The HTTP adapter: ``external_call`` actions sent to an idempotent HTTP API.

Every write carries an ``Idempotency-Key`` header (the action's key), the fence
(``Ratchet-Run-Id``, ``Ratchet-Lease-Version``, ``Ratchet-State-Version``), the intent
digest and, when approved, the approval digest. The service's answers map to the
runtime's outcomes:

==========================  ==================================================================
answer                      outcome
==========================  ==================================================================
201 / 200 + receipt         :class:`~ratchet.runtime.ports.Receipt` (a receipt for another
                            intent raises IdempotencyConflictError carrying it)
422 + existing receipt      :class:`~ratchet.errors.IdempotencyConflictError` (``receipt``)
409 (in flight)             :class:`~ratchet.errors.AdapterError`, ``retryable=True``
412 (stale fence)           :class:`~ratchet.errors.FenceRejectedError`
other 4xx                   :class:`~ratchet.errors.AdapterError`, ``retryable=False``
5xx, timeout, reset, a      outcome unknown: **look the key up** (never resend blindly);
malformed reply             the receipt found is the answer, none found raises
                            AdapterError(``retryable=True``, ``outcome="unknown"``)
a reply past the byte cap   outcome unknown: **look the key up**; the receipt found is the
                            answer, none found (or a lookup past the cap too) raises
                            :class:`~ratchet.errors.OutcomeUnknownError` (review: never sent
                            again)
==========================  ==================================================================

Every reply is read as it streams in, at most ``max_reply_bytes`` (by default the
worker's ``RATCHET_MAX_PEER_BYTES``, :mod:`ratchet.limits`); reading stops past it and
the connection is dropped. A read past it (the identity, a receipt lookup) is refused
with :class:`~ratchet.errors.PeerAnswerTooLargeError`, never retried.

The observation is the service's identity and revision: ``instance_id`` is the service id
(a reset service gets a new one), ``version`` its revision (every committed order moves it
on by one), and the fingerprint digests both with the namespace. Any other caller's order
therefore changes the observation too: between a checkpoint and its recovery that fails
closed, as it must for an environment others can reach.
"""

from __future__ import annotations

import http.client
import threading
from collections.abc import Mapping
from contextlib import suppress
from typing import Any
from urllib.parse import quote, urlsplit

from pydantic import ValidationError

from ratchet.errors import (
    AdapterError,
    ConfigurationError,
    ContractError,
    FenceRejectedError,
    IdempotencyConflictError,
    OutcomeUnknownError,
    PeerAnswerTooLargeError,
)
from ratchet.limits import AnswerBudget, peer_cap
from ratchet.runtime.actions import Action, ActionKind
from ratchet.runtime.canonical import Domain, canonical_json, digest, strict_json_loads
from ratchet.runtime.ports import Fence, Observation, ReadResult, Receipt, VerifierReport

__all__ = ["DEFAULT_OPERATIONS", "HttpAdapter"]

DEFAULT_OPERATIONS: Mapping[str, str] = {"place-order": "/v1/orders"}
_READ_CHUNK = 1 << 16


def _seen(payload: Any) -> Any:
    return payload.get("seen") if isinstance(payload, dict) else None


class _OutcomeUnknown(Exception):  # noqa: N818 - internal signal, never escapes
    """The request may or may not have been applied."""


def _cut_off(key: str, refusal: PeerAnswerTooLargeError) -> OutcomeUnknownError:
    return OutcomeUnknownError(
        f"{refusal.message}; the write may have happened and the service shows no receipt "
        "that can be read: whether it happened is for a reviewer to find out",
        idempotency_key=key,
        peer=refusal.peer,
        limit_bytes=refusal.limit_bytes,
        seen_bytes=refusal.seen_bytes,
    )


class HttpAdapter:
    """An HTTP API as an environment of irreversible external calls.

    Args:
        base_url: ``http://host:port`` (or https) of the service.
        namespace: the receipt namespace the service uses; receipts in another namespace
            are refused.
        operations: allow-listed operation names mapped to request paths.
        timeout_seconds: per request (connect and read).
        max_reply_bytes: the most one reply may carry (None: the process's cap,
            ``RATCHET_MAX_PEER_BYTES``).

    Raises (constructor):
        ConfigurationError: the URL is not http(s) with a host, a path is not absolute,
            or the cap is out of range.
    """

    def __init__(
        self,
        base_url: str,
        *,
        namespace: str = "orders-api",
        operations: Mapping[str, str] = DEFAULT_OPERATIONS,
        timeout_seconds: float = 10.0,
        token: str | None = None,
        max_reply_bytes: int | None = None,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigurationError("base_url must be http(s)://host[:port]", base_url=base_url)
        for name, path in operations.items():
            if not path.startswith("/"):
                raise ConfigurationError("operation paths must start with '/'", operation=name)
        self._scheme = parts.scheme
        self._host = parts.hostname
        self._port = parts.port
        self._prefix = parts.path.rstrip("/")
        self._namespace = namespace
        self._operations = dict(operations)
        self._timeout = timeout_seconds
        self._limit = peer_cap(max_reply_bytes)
        port = f":{parts.port}" if parts.port else ""
        self._peer = f"HTTP service ({parts.scheme}://{parts.hostname}{port}{self._prefix})"
        # A bearer token sent with every mutating request (raising a fence, a write);
        # never in a repr, a log line or an error.
        self._auth = {"Authorization": f"Bearer {token}"} if token else {}
        # The connection the last read left open (reads only; see _send): one thread
        # at a time takes it, under the lock.
        self._kept: http.client.HTTPConnection | None = None
        self._kept_lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"HttpAdapter(host={self._host!r}, port={self._port!r}, namespace={self._namespace!r})"
        )

    @property
    def namespace(self) -> str:
        return self._namespace

    # -- transport --------------------------------------------------------------------------

    def _connection(self) -> http.client.HTTPConnection:
        conn_type = (
            http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
        )
        return conn_type(self._host, self._port, timeout=self._timeout)

    def _exchange(
        self,
        conn: http.client.HTTPConnection,
        method: str,
        path: str,
        body: bytes | None,
        headers: Mapping[str, str],
    ) -> tuple[int, bytes, bool]:
        """One request and its whole reply: (status, body, whether the server keeps the
        connection open). The reply is read as it arrives, at most the cap.

        Raises:
            _OutcomeUnknown: a transport failure.
            PeerAnswerTooLargeError: the reply went past the cap (``conn`` is closed).
        """
        try:
            conn.request(method, self._prefix + path, body=body, headers=dict(headers))
            response = conn.getresponse()
            budget = AnswerBudget(self._peer, self._limit)
            raw = bytearray()
            while chunk := response.read(_READ_CHUNK):
                budget.take(len(chunk))
                raw += chunk
            return response.status, bytes(raw), not response.will_close
        except PeerAnswerTooLargeError:
            conn.close()  # the rest is never read: the connection cannot be reused
            raise
        except (OSError, http.client.HTTPException) as exc:
            raise _OutcomeUnknown(type(exc).__name__) from None

    def _send(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, Any]:
        """One request. A mutating one goes on a fresh connection of its own, so a
        transport failure is about that request alone. A read (GET) reuses the connection
        the last read left open, and is sent once more on a fresh one when that kept
        connection fails (the server may close an idle connection at any time; a read
        changes nothing, so sending it again is safe). A service should answer with
        ``TCP_NODELAY`` set, as common servers do: one that writes a reply's headers and
        body separately with Nagle's algorithm on holds the body back until the client's
        delayed ACK, about 40 ms per read on a kept connection. Raises _OutcomeUnknown on any
        transport failure or unreadable reply."""
        sent = dict(headers or {})
        if method != "GET":
            sent.update(self._auth)
            conn = self._connection()
            try:
                status, raw, _ = self._exchange(conn, method, path, body, sent)
            finally:
                conn.close()
        else:
            with self._kept_lock:
                kept, self._kept = self._kept, None
            status = -1
            if kept is not None:
                try:
                    status, raw, keep = self._exchange(kept, method, path, body, sent)
                except _OutcomeUnknown:
                    kept.close()
                    kept = None
            if kept is None:
                kept = self._connection()
                try:
                    status, raw, keep = self._exchange(kept, method, path, body, sent)
                except _OutcomeUnknown:
                    kept.close()
                    raise
            with self._kept_lock:
                if keep and self._kept is None:
                    self._kept, kept = kept, None
            if kept is not None:
                kept.close()
        try:
            return status, strict_json_loads(raw) if raw else {}
        except ContractError:
            raise _OutcomeUnknown("reply is not strict JSON") from None

    def __del__(self) -> None:
        # An adapter dropped without close() still closes its kept connection.
        with suppress(Exception):
            self.close()

    def close(self) -> None:
        """Close the connection kept for reads, if any. The adapter stays usable."""
        with self._kept_lock:
            kept, self._kept = self._kept, None
        if kept is not None:
            kept.close()

    def _get(self, path: str) -> tuple[int, Any]:
        try:
            return self._send("GET", path)
        except _OutcomeUnknown as exc:
            raise AdapterError(
                "service unreachable or reply unreadable", retryable=True, error=str(exc)
            ) from None

    def _receipt(self, payload: Any) -> Receipt:
        try:
            receipt = Receipt.model_validate(payload)
        except ValidationError:
            raise _OutcomeUnknown("malformed receipt") from None
        if receipt.namespace != self._namespace:
            raise AdapterError(
                "receipt is from another namespace", retryable=False, namespace=receipt.namespace
            )
        return receipt

    # -- observation ----------------------------------------------------------------------------

    def observe(self) -> Observation:
        """The service's identity and revision.

        Raises:
            AdapterError: unreachable or malformed (retryable=True), other namespace
                (retryable=False).
            PeerAnswerTooLargeError: the reply went past the byte cap.
        """
        status, payload = self._get("/v1/identity")
        if status != 200 or not isinstance(payload, dict):
            raise AdapterError("identity request failed", retryable=status >= 500, status=status)
        service_id, revision = payload.get("service_id"), payload.get("revision")
        if payload.get("namespace") != self._namespace:
            raise AdapterError("service is in another namespace", retryable=False)
        if (
            not isinstance(service_id, str)
            or not isinstance(revision, int)
            or isinstance(revision, bool)
        ):
            raise AdapterError("identity reply is malformed", retryable=True)
        return self._observation(service_id, revision)

    def _observation(self, service_id: str, revision: int) -> Observation:
        fingerprint = digest(
            Domain.ENVIRONMENT,
            {"service_id": service_id, "namespace": self._namespace, "revision": revision},
        )
        return Observation(
            instance_id=service_id,
            version=revision,
            fingerprint=fingerprint,
            details={"service_id": service_id, "namespace": self._namespace},
        )

    def project(self, action: Action, before: Observation) -> Observation | None:
        """One committed call moves the revision on by one; None when ``before`` is not
        current or the action is not an allow-listed external call."""
        if action.kind is not ActionKind.EXTERNAL_CALL:
            return None
        if action.text("operation") not in self._operations:
            return None
        current = self.observe()
        if current != before:
            return None
        return self._observation(current.instance_id, current.version + 1)

    # -- fences and writes ----------------------------------------------------------------------

    def raise_fence(self, fence: Fence) -> None:
        """Record a new owner's fence at the service.

        Raises:
            FenceRejectedError: the service has seen a higher fence for the run.
            AdapterError: unreachable (retryable=True) or refused (retryable=False).
        """
        try:
            status, payload = self._send(
                "POST",
                "/v1/fences",
                canonical_json(fence.model_dump()),
                {"Content-Type": "application/json"},
            )
        except _OutcomeUnknown as exc:
            raise AdapterError(
                "fence could not be raised", retryable=True, error=str(exc)
            ) from None
        if status == 412:
            raise FenceRejectedError(
                "service has seen a newer fence",
                run_id=fence.run_id,
                fence=fence.key(),
                seen=_seen(payload),
            )
        if status != 200:
            raise AdapterError("fence request failed", retryable=status >= 500, status=status)

    def execute(
        self, action: Action, intent_digest: str, fence: Fence, approval_digest: str | None
    ) -> Receipt:
        """Send one external call under ``action.idempotency_key``; see the module table.

        Raises:
            FenceRejectedError, IdempotencyConflictError, AdapterError; OutcomeUnknownError:
            the reply went past the byte cap and no receipt for the key can be read.
        """
        if action.kind is not ActionKind.EXTERNAL_CALL:
            raise AdapterError(
                "the HTTP adapter performs external_call only",
                retryable=False,
                kind=str(action.kind),
            )
        path = self._operations.get(action.text("operation"))
        if path is None:
            raise AdapterError(
                "operation is not configured", retryable=False, operation=action.text("operation")
            )
        key = action.idempotency_key
        if key is None:
            raise AdapterError("writes need an idempotency key", retryable=False)
        headers = {
            "Content-Type": "application/json",
            "Idempotency-Key": key,
            "Ratchet-Run-Id": fence.run_id,
            "Ratchet-Lease-Version": str(fence.lease_version),
            "Ratchet-State-Version": str(fence.state_version),
            "Ratchet-Intent-Digest": intent_digest,
        }
        if fence.store_epoch is not None:
            headers["Ratchet-Store-Epoch"] = fence.store_epoch
        if approval_digest is not None:
            headers["Ratchet-Approval-Digest"] = approval_digest
        receipt: Receipt | None = None
        try:
            status, payload = self._send("POST", path, action.text("body").encode(), headers)
            if status >= 500:
                raise _OutcomeUnknown(f"status {status}")
            if status in (200, 201):
                receipt = self._receipt(payload)
            elif status == 422:
                receipt = self._receipt(
                    payload.get("receipt") if isinstance(payload, dict) else None
                )
        except _OutcomeUnknown:
            # Timeline: request sent -> [reply lost] -> the service may have committed.
            # Never resend blindly: the key's receipt (or its absence) is the answer.
            return self._after_unknown(key, intent_digest)
        except PeerAnswerTooLargeError as cut:
            # Timeline: request sent -> the reply went past the cap -> reading stopped.
            # The same: the key's receipt is the answer; without one, a reviewer decides
            # (sending again would be answered the same way).
            return self._after_unknown(key, intent_digest, cut)
        if status == 412:
            raise FenceRejectedError(
                "service has seen a newer fence",
                run_id=fence.run_id,
                fence=fence.key(),
                seen=_seen(payload),
            )
        if status == 409:
            raise AdapterError(
                "a request with this key is in flight", retryable=True, idempotency_key=key
            )
        if receipt is not None:
            if status == 422 or receipt.intent_digest != intent_digest:
                raise IdempotencyConflictError(
                    "key was used for another intent", idempotency_key=key, receipt=receipt
                )
            if receipt.idempotency_key != key:
                raise AdapterError(
                    "receipt names another key", retryable=False, idempotency_key=key
                )
            return receipt
        raise AdapterError("service refused the call", retryable=False, status=status)

    def _after_unknown(
        self, key: str, intent_digest: str, cut: PeerAnswerTooLargeError | None = None
    ) -> Receipt:
        try:
            receipt = self.lookup(key)
        except PeerAnswerTooLargeError as exc:
            raise _cut_off(key, exc) from exc
        if receipt is None and cut is not None:
            raise _cut_off(key, cut) from cut
        if receipt is None:
            raise AdapterError(
                "outcome unknown and the service has no receipt yet; look "
                "the key up again before any retry",
                retryable=True,
                outcome="unknown",
                idempotency_key=key,
            )
        if receipt.intent_digest != intent_digest:
            raise IdempotencyConflictError(
                "key was used for another intent", idempotency_key=key, receipt=receipt
            )
        return receipt

    def lookup(self, idempotency_key: str) -> Receipt | None:
        """The service's receipt for a key, or None.

        Raises:
            AdapterError: unreachable, malformed, or the key is in flight (retryable=True).
            PeerAnswerTooLargeError: the reply went past the byte cap.
        """
        status, payload = self._get("/v1/receipts/" + quote(idempotency_key, safe=""))
        if status == 404:
            return None
        if status == 409:
            raise AdapterError(
                "a request with this key is in flight",
                retryable=True,
                idempotency_key=idempotency_key,
            )
        if status != 200:
            raise AdapterError("receipt lookup failed", retryable=status >= 500, status=status)
        try:
            return self._receipt(payload)
        except _OutcomeUnknown:
            raise AdapterError(
                "receipt is malformed", retryable=True, idempotency_key=idempotency_key
            ) from None

    def read(self, action: Action) -> ReadResult:
        """Raises AdapterError: the HTTP adapter performs no reads."""
        raise AdapterError(
            "the HTTP adapter performs no reads", retryable=False, kind=str(action.kind)
        )

    def verify(self, target: str) -> VerifierReport:
        """Raises AdapterError: the HTTP adapter has no verifier."""
        raise AdapterError("the HTTP adapter has no verifier", retryable=False, target=target)

    def stats(self) -> dict[str, int]:
        """The reference service's counters (``effects``, ``refused_stale``, ``revision``).

        Raises:
            AdapterError: unreachable or not a reference service.
        """
        status, payload = self._get("/v1/stats")
        if status != 200 or not isinstance(payload, dict):
            raise AdapterError("stats request failed", retryable=status >= 500, status=status)
        return {k: int(v) for k, v in payload.items() if isinstance(v, int)}
