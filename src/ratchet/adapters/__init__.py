"""Adapters: where side effects happen, with authoritative receipts and fence checks.

The adapter contract
====================

The protocol is :class:`ratchet.runtime.ports.Adapter`; this is what each method promises.
The conformance suite (:mod:`ratchet.testing.conformance`) checks it, for ours and yours.

``namespace``
    Names the adapter's receipts. Receipts from another namespace are never accepted as
    this adapter's.

``observe() -> Observation``
    ``instance_id`` names the environment for good: a reset workspace, a recreated
    service or another directory is another instance, even with the same content.
    ``version`` is the adapter's own durable, monotonic revision (never reused for two
    states). ``fingerprint`` digests the state that matters (allowed files, git HEAD and
    dirty flag, the service's identity and revision). ``details`` carry the facts an
    operator must see re-checked after recovery (HEAD, dirty flag, service id); they are
    already inside the fingerprint. Two observations with nothing in between are equal.

``project(action, before) -> Observation | None``
    The exact observation that ``action`` would produce from ``before`` (the one-commit
    state), or None when ``before`` is no longer current or the action changes nothing.
    After the write, ``observe()`` equals the projection. Recovery accepts only the
    checkpoint's state or this projection, so an adapter that cannot predict its own
    state cannot recover a write that crashed after the effect.

``raise_fence(fence)``
    Records a new owner's fence ``(run_id, lease_version, state_version)`` without
    writing anything, durably. From then on any lower ``(lease_version, state_version)``
    for that run is refused with :class:`~ratchet.errors.FenceRejectedError`, for writes
    and for fences, even when the stale request arrives after the newer one. Equal is
    accepted. Fences are per run.

``execute(action, intent_digest, fence, approval_digest) -> Receipt``
    Performs one write under ``action.idempotency_key`` or refuses, in this order: fence;
    idempotency (same key and same intent returns the identical stored receipt with no
    second effect; same key and another intent raises
    :class:`~ratchet.errors.IdempotencyConflictError` whose ``receipt`` is the stored
    one); precondition (adapters that can check it refuse an ``expected_env_version``
    that is not current: ``AdapterError(retryable=False)``); then the effect and the
    receipt, atomically as seen from outside. ``AdapterError.retryable`` says whether a
    retry can help; an outcome the adapter cannot know is never guessed: it looks the
    key up and answers from the receipt, or raises ``retryable=True``.

``lookup(idempotency_key) -> Receipt | None``
    The authoritative receipt for a key, identical in every field to what ``execute``
    returned, or None. The runtime's own copy is a cache; this is the evidence.

Receipts carry ``namespace``, ``receipt_version``, ``receipt_id``, ``idempotency_key``,
``intent_digest``, ``result``, ``committed_at`` (the adapter's own commit time),
``env_version_after`` (the version the write produced) and ``approval_digest`` (the
approval sent with the write, bound by the adapter; None when none was sent).

``read(action)`` and ``verify(target)`` are read-only; a verifier report is bound to the
instance, version and fingerprint it ran against, and fails closed when the environment
changed during the run.

The trust boundary
------------------

An adapter that other callers can reach (anything but a same-process stand-in) must bind
the approval digest and its own commit time in the receipt. The runtime reconciles an
approved write automatically only when the receipt binds that approval and was committed
before the approval expired; otherwise the run waits in ``needs_review``
(``approval_unbound``). The adapters here bind whatever approval digest arrives with the
write; a receipt minted for a call that came without one (another caller used the key)
therefore does not bind, and is reviewed rather than trusted.

What is here
============

* :class:`WorkspaceAdapter` (:mod:`.workspace`): a real directory with a SQLite journal,
  atomic writes, crash recovery, fences and git facts.
* :class:`CommandVerifier` (:mod:`.verifier`): allow-listed commands, clean environment,
  timeout, output limit, bound reports.
* :class:`HttpAdapter` (:mod:`.http`); the reference orders API it is tested against is
  part of the chaos harness (:mod:`ratchet.chaos.orders`).
* :class:`RouterAdapter` (:mod:`.router`): files to the workspace, external calls to HTTP.
The checks above, runnable against any adapter, are the conformance kit in
:mod:`ratchet.testing.conformance`; the in-memory workspace used by the core's tests lives
in :mod:`ratchet.testing.memory`.
"""

from ratchet.adapters.http import HttpAdapter
from ratchet.adapters.router import RouterAdapter
from ratchet.adapters.verifier import CommandVerifier, VerifierCommand, VerifierRun
from ratchet.adapters.workspace import SystemClock, WorkspaceAdapter

__all__ = [
    "CommandVerifier",
    "HttpAdapter",
    "RouterAdapter",
    "SystemClock",
    "VerifierCommand",
    "VerifierRun",
    "WorkspaceAdapter",
]
