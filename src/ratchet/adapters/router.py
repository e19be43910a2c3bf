"""One adapter over two: a workspace for files, reads and the verifier, and another
adapter (an HTTP API) for ``external_call``. A run gets one adapter object; this is it.

The combined observation:

* ``instance_id``: ``router-`` and a digest of both parts' instance ids (either part
  being replaced is a new environment);
* ``version``: the sum of both parts' versions (each is monotonic, and one write moves
  exactly one part on by one, so the sum moves on by one);
* ``fingerprint``: a digest over both parts' instance, version and fingerprint;
* ``details``: each part's instance, version, fingerprint and details, prefixed with
  ``files.`` or ``calls.``, so an operator sees which part drifted.

An action's ``expected_env_version`` is a combined version; before a part sees it, the
router subtracts the other part's current version, so the part's own precondition check
still refuses a write planned against a state that has moved on. Receipts come from the
part that wrote, in that part's namespace, unchanged.
"""

from __future__ import annotations

import hashlib

from ratchet.errors import AdapterError
from ratchet.runtime.actions import Action, ActionKind
from ratchet.runtime.canonical import Domain, digest
from ratchet.runtime.ports import (
    Adapter,
    Fence,
    Observation,
    ReadResult,
    Receipt,
    VerifierReport,
)

__all__ = ["RouterAdapter"]

_PARTS = ("files", "calls")
_VERIFIER_DOMAIN = b"ratchet/router-verifier/v1"


class RouterAdapter:
    """Route file kinds and verification to ``files``, ``external_call`` to ``calls``."""

    def __init__(self, files: Adapter, calls: Adapter, *, namespace: str = "router") -> None:
        self.files = files
        self.calls = calls
        self._namespace = namespace

    def __repr__(self) -> str:
        return f"RouterAdapter(files={self.files!r}, calls={self.calls!r})"

    @property
    def namespace(self) -> str:
        return self._namespace

    def _part(self, action: Action) -> tuple[str, Adapter, Adapter]:
        if action.kind is ActionKind.EXTERNAL_CALL:
            return "calls", self.calls, self.files
        return "files", self.files, self.calls

    # -- observation -----------------------------------------------------------------------------

    def _parts(self) -> dict[str, Observation]:
        return {"files": self.files.observe(), "calls": self.calls.observe()}

    @staticmethod
    def combine(parts: dict[str, Observation]) -> Observation:
        """The combined observation of both parts (see the module docstring)."""
        instance = hashlib.sha256("\x00".join(parts[p].instance_id for p in _PARTS).encode())
        details: dict[str, str] = {}
        for name in _PARTS:
            obs = parts[name]
            details |= {
                f"{name}.instance_id": obs.instance_id,
                f"{name}.version": str(obs.version),
                f"{name}.fingerprint": obs.fingerprint,
            }
            details |= {f"{name}.{k}": v for k, v in obs.details.items()}
        fingerprint = digest(
            Domain.ENVIRONMENT,
            {
                name: {
                    "instance_id": parts[name].instance_id,
                    "version": parts[name].version,
                    "fingerprint": parts[name].fingerprint,
                }
                for name in _PARTS
            },
        )
        return Observation(
            instance_id="router-" + instance.hexdigest()[:40],
            version=sum(parts[p].version for p in _PARTS),
            fingerprint=fingerprint,
            details=details,
        )

    @property
    def enforces_preconditions(self) -> bool:
        """Only when both parts declare it (see docs/adapters.md)."""
        return all(
            getattr(part, "enforces_preconditions", False) is True
            for part in (self.files, self.calls)
        )

    def observe(self) -> Observation:
        """Both parts observed and combined. Raises AdapterError from either part."""
        return self.combine(self._parts())

    def _translated(self, action: Action, other: Observation) -> Action:
        return action.model_copy(
            update={"expected_env_version": action.expected_env_version - other.version}
        )

    def project(self, action: Action, before: Observation) -> Observation | None:
        """The combined observation after ``action``, or None (see each part's project)."""
        parts = self._parts()
        if self.combine(parts) != before:
            return None
        name, part, _ = self._part(action)
        other = parts["files" if name == "calls" else "calls"]
        if action.expected_env_version < other.version:
            return None
        predicted = part.project(self._translated(action, other), parts[name])
        if predicted is None:
            return None
        return self.combine({**parts, name: predicted})

    # -- fences and writes --------------------------------------------------------------------

    def raise_fence(self, fence: Fence) -> None:
        """Raise the fence on both parts.

        Raises:
            FenceRejectedError: either part has seen a newer fence.
        """
        self.files.raise_fence(fence)
        self.calls.raise_fence(fence)

    def execute(
        self, action: Action, intent_digest: str, fence: Fence, approval_digest: str | None
    ) -> Receipt:
        """Send the write to its part, with the expected version translated.

        Raises:
            FenceRejectedError: the target part has seen a newer fence (checked before a
                failed precondition is reported).
            IdempotencyConflictError, AdapterError (from the part, or a precondition that
            cannot hold: retryable=False).
        """
        _, part, other_part = self._part(action)
        other = other_part.observe()
        if action.expected_env_version < other.version:
            # The other part moved on since the plan. A stale owner is the likeliest cause
            # (its successor wrote there): let the target part judge the fence first, so a
            # late write is refused for what it is, not only for the drift it caused.
            part.raise_fence(fence)
            raise AdapterError(
                "environment precondition failed",
                retryable=False,
                expected=action.expected_env_version,
            )
        return part.execute(self._translated(action, other), intent_digest, fence, approval_digest)

    def lookup(self, idempotency_key: str) -> Receipt | None:
        """The receipt from whichever part holds the key (files first), or None.

        Raises:
            AdapterError: a part could not be asked.
        """
        found = self.files.lookup(idempotency_key)
        return found if found is not None else self.calls.lookup(idempotency_key)

    # -- reads and verification ------------------------------------------------------------------

    def read(self, action: Action) -> ReadResult:
        """Read through the files part; the version is the combined one.

        Raises:
            AdapterError: from the files part.
        """
        result = self.files.read(action)
        calls = self.calls.observe()
        return ReadResult(content=result.content, env_version=result.env_version + calls.version)

    def verify(self, target: str) -> VerifierReport:
        """Run the files part's verifier, bound to the combined observation.

        If either part changed while it ran, the report fails closed (``passed=False``).

        Raises:
            AdapterError: from the files part.
        """
        before = self._parts()
        report = self.files.verify(target)
        after = self._parts()
        files_before = before["files"]
        bound = (
            before == after
            and report.env_instance_id == files_before.instance_id
            and report.env_version == files_before.version
            and report.env_fingerprint == files_before.fingerprint
        )
        combined = self.combine(before)
        output_digest = digest(_VERIFIER_DOMAIN, {"part": report.output_digest, "bound": bound})
        return VerifierReport(
            target=target,
            passed=report.passed and bound,
            env_instance_id=combined.instance_id,
            env_version=combined.version,
            env_fingerprint=combined.fingerprint,
            output_digest=output_digest,
        )
