"""One adapter over several parts: a workspace for files, reads and the verifier
(``files``), an HTTP API for ``external_call`` (``calls``, optional), and the declared
tools (``tools``, optional: :class:`ratchet.tools.ToolsAdapter`). A run gets one adapter
object; this is it.

The combined observation (over the parts present, in that order):

* ``instance_id``: ``router-`` and a digest of the parts' instance ids (any part being
  replaced is a new environment);
* ``version``: the sum of the parts' versions (each is monotonic, and one write moves
  exactly one part on by one, so the sum moves on by one);
* ``fingerprint``: a digest over every part's instance, version and fingerprint;
* ``details``: each part's instance, version, fingerprint and details, prefixed with
  the part's name (``files.``, ``calls.``, ``tools.``), so an operator sees which part
  drifted.

An action's ``expected_env_version`` is a combined version; before a part sees it, the
router subtracts the other parts' current versions, so the part's own precondition check
still refuses a write planned against a state that has moved on. Receipts come from the
part that wrote, in that part's namespace, unchanged.
"""

from __future__ import annotations

import contextlib
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

_VERIFIER_DOMAIN = b"ratchet/router-verifier/v1"
_RECENT = 4  # combined observations kept (see RouterAdapter._combined)


class RouterAdapter:
    """Route file kinds and verification to ``files``, ``external_call`` to ``calls``,
    declared tools to ``tools``."""

    def __init__(
        self,
        files: Adapter,
        calls: Adapter | None = None,
        *,
        tools: Adapter | None = None,
        namespace: str = "router",
    ) -> None:
        self.files = files
        self.calls = calls
        self.tools = tools
        self._namespace = namespace
        named: dict[str, Adapter | None] = {"files": files, "calls": calls, "tools": tools}
        self._named: dict[str, Adapter] = {k: v for k, v in named.items() if v is not None}
        self._recent: dict[tuple[object, ...], Observation] = {}

    def __repr__(self) -> str:
        parts = ", ".join(f"{name}={part!r}" for name, part in self._named.items())
        return f"RouterAdapter({parts})"

    @property
    def namespace(self) -> str:
        return self._namespace

    def close(self) -> None:
        """Close every part that can be closed (the workspace's journal and lock, the
        HTTP API's kept connection, the tools' connections and ledger), each one even when
        an earlier one failed; the first failure is raised once all were tried."""
        failure: Exception | None = None
        for part in self._named.values():
            close = getattr(part, "close", None)
            if not callable(close):
                continue
            try:
                close()
            except Exception as exc:  # every part is closed first
                failure = failure or exc
        if failure is not None:
            raise failure

    def _route(self, action: Action) -> str:
        if not action.is_builtin:
            name = "tools"
        elif action.kind is ActionKind.EXTERNAL_CALL:
            name = "calls"
        else:
            name = "files"
        if name not in self._named:
            raise AdapterError(
                f"this environment has no {name} part for {action.kind!s}",
                retryable=False,
                kind=str(action.kind),
            )
        return name

    # -- observation -----------------------------------------------------------------------------

    def _parts(self) -> dict[str, Observation]:
        return {name: part.observe() for name, part in self._named.items()}

    def _combined(self, parts: dict[str, Observation]) -> Observation:
        """:meth:`combine`, answered from the last few combinations when the parts read
        the same (a step combines the same parts up to four times: the projection's check,
        the live check, the projection and the observation after the write). The key is
        every field the combination reads, so an answer is only ever reused for equal
        inputs; a changed part (a version moved on, another fingerprint) is combined anew.
        """
        key = tuple(
            (name, obs.instance_id, obs.version, obs.fingerprint, tuple(obs.details.items()))
            for name, obs in parts.items()
        )
        found = self._recent.get(key)
        if found is None:
            found = self.combine(parts)
            with contextlib.suppress(RuntimeError, StopIteration, KeyError):
                while len(self._recent) >= _RECENT:  # another thread may evict meanwhile
                    self._recent.pop(next(iter(self._recent)))
            self._recent[key] = found
        return found

    @staticmethod
    def combine(parts: dict[str, Observation]) -> Observation:
        """The combined observation of the parts (see the module docstring)."""
        instance = hashlib.sha256("\x00".join(obs.instance_id for obs in parts.values()).encode())
        details: dict[str, str] = {}
        for name, obs in parts.items():
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
                    "instance_id": obs.instance_id,
                    "version": obs.version,
                    "fingerprint": obs.fingerprint,
                }
                for name, obs in parts.items()
            },
        )
        return Observation(
            instance_id="router-" + instance.hexdigest()[:40],
            version=sum(obs.version for obs in parts.values()),
            fingerprint=fingerprint,
            details=details,
        )

    @property
    def enforces_preconditions(self) -> bool:
        """Only when every part declares it (see docs/adapters.md)."""
        return all(
            getattr(part, "enforces_preconditions", False) is True for part in self._named.values()
        )

    def observe(self) -> Observation:
        """Every part observed and combined. Raises AdapterError from any part."""
        return self._combined(self._parts())

    def _others(self, name: str, parts: dict[str, Observation] | None = None) -> int:
        """The sum of the versions of every part but ``name`` (observed now if not given)."""
        if parts is None:
            return sum(p.observe().version for n, p in self._named.items() if n != name)
        return sum(obs.version for n, obs in parts.items() if n != name)

    def _translated(self, action: Action, others: int) -> Action:
        return action.model_copy(
            update={"expected_env_version": action.expected_env_version - others}
        )

    def project(self, action: Action, before: Observation) -> Observation | None:
        """The combined observation after ``action``, or None (see each part's project)."""
        parts = self._parts()
        if self._combined(parts) != before:
            return None
        name = self._route(action)
        others = self._others(name, parts)
        if action.expected_env_version < others:
            return None
        predicted = self._named[name].project(self._translated(action, others), parts[name])
        if predicted is None:
            return None
        return self._combined({**parts, name: predicted})

    # -- fences and writes --------------------------------------------------------------------

    def raise_fence(self, fence: Fence) -> None:
        """Raise the fence on every part.

        Raises:
            FenceRejectedError: a part has seen a newer fence.
        """
        for part in self._named.values():
            part.raise_fence(fence)

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
        name = self._route(action)
        part = self._named[name]
        others = self._others(name)
        if action.expected_env_version < others:
            # Another part moved on since the plan. A stale owner is the likeliest cause
            # (its successor wrote there): let the target part judge the fence first, so a
            # late write is refused for what it is, not only for the drift it caused.
            part.raise_fence(fence)
            raise AdapterError(
                "environment precondition failed",
                retryable=False,
                expected=action.expected_env_version,
            )
        return part.execute(self._translated(action, others), intent_digest, fence, approval_digest)

    def lookup(self, idempotency_key: str) -> Receipt | None:
        """The receipt from whichever part holds the key (in part order), or None.

        Raises:
            AdapterError: a part could not be asked.
        """
        for part in self._named.values():
            found = part.lookup(idempotency_key)
            if found is not None:
                return found
        return None

    def lookup_for(self, action: Action) -> Receipt | None:
        """The receipt for ``action``'s key from the part its writes go to, or None.

        Raises:
            AdapterError: that part could not be asked; OutcomeUnknownError (tools).
        """
        key = action.idempotency_key or ""
        if action.is_builtin:
            return self.lookup(key)
        tools = self._named.get("tools")
        if tools is None:
            return None
        routed = getattr(tools, "lookup_for", None)
        found: Receipt | None = routed(action) if routed is not None else tools.lookup(key)
        return found

    # -- reads and verification ------------------------------------------------------------------

    def read(self, action: Action) -> ReadResult:
        """Read through the action's part; the version is the combined one.

        Raises:
            AdapterError: from the part.
        """
        name = self._route(action)
        result = self._named[name].read(action)
        return ReadResult(
            content=result.content, env_version=result.env_version + self._others(name)
        )

    def verify(self, target: str) -> VerifierReport:
        """Run the files part's verifier, bound to the combined observation.

        If any part changed while it ran, the report fails closed (``passed=False``).

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
        combined = self._combined(before)
        output_digest = digest(_VERIFIER_DOMAIN, {"part": report.output_digest, "bound": bound})
        return VerifierReport(
            target=target,
            passed=report.passed and bound,
            env_instance_id=combined.instance_id,
            env_version=combined.version,
            env_fingerprint=combined.fingerprint,
            output_digest=output_digest,
        )
