"""A conformance suite any adapter can run against itself.

Describe the adapter under test with a :class:`ConformanceSubject` (the adapter, how to
build a write action for it, how to count its effects on its own side), then run the
named checks in :data:`CHECKS`. Each check gets a fresh subject from your factory, so
checks never see each other's writes. With pytest::

    import pytest
    from ratchet.testing.conformance import CHECKS, ConformanceCheck, run_check

    @pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.name)
    def test_my_adapter_conforms(check: ConformanceCheck, tmp_path) -> None:
        if not run_check(check, lambda: make_subject(tmp_path)):
            pytest.skip(f"the subject cannot {check.needs}")

Without pytest, :func:`run_conformance` runs them all and returns a verdict per name.

A failed check raises :class:`ratchet.errors.ConformanceError` whose ``check`` attribute
names it. What the checks pin down is written in :mod:`ratchet.adapters` (the contract).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ratchet.errors import (
    AdapterError,
    ConformanceError,
    FenceRejectedError,
    IdempotencyConflictError,
)
from ratchet.runtime.actions import Action
from ratchet.runtime.ports import Adapter, Fence, Receipt

__all__ = [
    "CHECKS",
    "ConformanceCheck",
    "ConformanceSubject",
    "SubjectFactory",
    "check_names",
    "run_check",
    "run_conformance",
]

_APPROVAL = "a" * 64


def _nothing() -> None:
    return None


@dataclass
class ConformanceSubject:
    """One adapter under test and what the checks need to drive it.

    ``make_write(key, variant, expected_env_version)`` returns a write action the adapter
    performs; different ``variant`` numbers must give different intents. ``effects()``
    counts the effects on the adapter's own side (a journal, a service counter).
    ``reopen()`` returns a second handle on the same environment, as another process
    would open it; ``drift()`` changes the environment behind the adapter's back. Both are
    optional: checks that need them are skipped without them. ``checks_precondition``
    says whether the adapter refuses an ``expected_env_version`` that is not current.
    ``receipt_namespace`` is the namespace receipts carry when it is not the adapter's
    own (a router passes on its parts' receipts); ``receipt_version`` likewise returns the
    version a receipt's ``env_version_after`` names (a router's part's, not the combined).
    """

    adapter: Adapter
    make_write: Callable[[str, int, int], Action]
    effects: Callable[[], int]
    run_id: str = "conformance-run"
    reopen: Callable[[], Adapter] | None = None
    drift: Callable[[], None] | None = None
    checks_precondition: bool = True
    receipt_namespace: str | None = None
    receipt_version: Callable[[], int] | None = None
    close: Callable[[], None] = field(default=_nothing)

    def fence(self, lease_version: int, state_version: int, run_id: str | None = None) -> Fence:
        return Fence(
            run_id=run_id or self.run_id, lease_version=lease_version, state_version=state_version
        )

    def write(self, key: str, variant: int = 0) -> Action:
        return self.make_write(key, variant, self.adapter.observe().version)

    def execute(self, action: Action, fence: Fence, approval: str | None = None) -> Receipt:
        return self.adapter.execute(action, action.intent_digest, fence, approval)


SubjectFactory = Callable[[], ConformanceSubject]


@dataclass(frozen=True, slots=True)
class ConformanceCheck:
    """A named check; ``needs`` names an optional subject capability it requires."""

    name: str
    run: Callable[[ConformanceSubject], None]
    needs: str | None = None

    @property
    def doc(self) -> str:
        return (self.run.__doc__ or "").strip()


def _fail(check: str, message: str, **context: Any) -> ConformanceError:
    return ConformanceError(f"{check}: {message}", check=check, **context)


def _refused(check: str, error: type[Exception], call: Callable[[], object]) -> Exception:
    try:
        call()
    except error as exc:
        return exc
    except Exception as exc:
        raise _fail(check, f"expected {error.__name__}, got {type(exc).__name__}") from exc
    raise _fail(check, f"expected {error.__name__}, the call succeeded")


def _same(check: str, what: str, got: object, want: object) -> None:
    if got != want:
        raise _fail(check, f"{what}: got {got!r}, want {want!r}")


# -- fences -------------------------------------------------------------------------------------


def fence_lower_than_seen_is_refused(s: ConformanceSubject) -> None:
    """After raise_fence((5, 10)), a write at (5, 9) or (4, 99) and a raise to (4, 0) are
    refused with FenceRejectedError, with no effect and no receipt."""
    name = "fence_lower_than_seen_is_refused"
    s.adapter.raise_fence(s.fence(5, 10))
    effects = s.effects()
    action = s.write("conf-fence-1")
    _refused(name, FenceRejectedError, lambda: s.execute(action, s.fence(5, 9)))
    _refused(name, FenceRejectedError, lambda: s.execute(action, s.fence(4, 99)))
    _refused(name, FenceRejectedError, lambda: s.adapter.raise_fence(s.fence(4, 0)))
    _same(name, "effects after refused writes", s.effects(), effects)
    _same(name, "receipt after refused writes", s.adapter.lookup("conf-fence-1"), None)


def stale_request_after_newer_request_is_refused(s: ConformanceSubject) -> None:
    """A write at (2, 1) succeeds; a later write from the old owner at (1, 50) is refused,
    although it arrives after the newer one."""
    name = "stale_request_after_newer_request_is_refused"
    effects = s.effects()
    s.execute(s.write("conf-new-owner"), s.fence(2, 1))
    late = s.write("conf-old-owner", 1)
    _refused(name, FenceRejectedError, lambda: s.execute(late, s.fence(1, 50)))
    _same(name, "effects", s.effects(), effects + 1)
    _same(name, "receipt of the refused write", s.adapter.lookup("conf-old-owner"), None)


def equal_fence_is_accepted_and_fences_are_per_run(s: ConformanceSubject) -> None:
    """The fence just raised is accepted for a write; another run's higher fence does not
    block this run."""
    s.adapter.raise_fence(s.fence(9, 9, run_id="conformance-other-run"))
    s.adapter.raise_fence(s.fence(3, 3))
    s.execute(s.write("conf-equal-fence"), s.fence(3, 3))


# -- idempotency and receipts ---------------------------------------------------------------------


def same_key_same_intent_returns_the_identical_receipt(s: ConformanceSubject) -> None:
    """Executing the same key and intent again (even under a newer fence, as a new owner
    would) returns the identical receipt and makes no second effect."""
    name = "same_key_same_intent_returns_the_identical_receipt"
    effects = s.effects()
    action = s.write("conf-replay")
    first = s.execute(action, s.fence(1, 1))
    again = s.execute(action, s.fence(2, 5))
    _same(name, "replayed receipt", again, first)
    _same(name, "effects", s.effects(), effects + 1)


def same_key_other_intent_conflicts_with_the_existing_receipt(s: ConformanceSubject) -> None:
    """The same key with another intent raises IdempotencyConflictError carrying the
    existing receipt as ``receipt``, with no effect."""
    name = "same_key_other_intent_conflicts_with_the_existing_receipt"
    first = s.execute(s.write("conf-conflict", 0), s.fence(1, 1))
    effects = s.effects()
    other = s.write("conf-conflict", 1)
    if other.intent_digest == first.intent_digest:
        raise _fail(name, "make_write gave the same intent for two variants")
    exc = _refused(name, IdempotencyConflictError, lambda: s.execute(other, s.fence(1, 2)))
    carried = exc.receipt if isinstance(exc, IdempotencyConflictError) else None
    _same(name, "receipt carried by the conflict", carried, first)
    _same(name, "effects", s.effects(), effects)


def lookup_returns_the_authoritative_receipt_or_none(s: ConformanceSubject) -> None:
    """lookup() is None for an unknown key and the executed receipt for a known one."""
    name = "lookup_returns_the_authoritative_receipt_or_none"
    _same(name, "lookup of an unknown key", s.adapter.lookup("conf-never-used"), None)
    receipt = s.execute(s.write("conf-lookup"), s.fence(1, 1))
    _same(name, "lookup after execute", s.adapter.lookup("conf-lookup"), receipt)


def receipts_carry_their_identity(s: ConformanceSubject) -> None:
    """A receipt names the adapter's namespace, a version, an id, the key, the intent
    digest, a result, a commit time, the version it produced and the approval digest
    sent with the write (None when none was sent)."""
    name = "receipts_carry_their_identity"
    action = s.write("conf-identity")
    receipt = s.execute(action, s.fence(1, 1), _APPROVAL)
    _same(name, "namespace", receipt.namespace, s.receipt_namespace or s.adapter.namespace)
    _same(name, "idempotency_key", receipt.idempotency_key, "conf-identity")
    _same(name, "intent_digest", receipt.intent_digest, action.intent_digest)
    _same(name, "approval_digest", receipt.approval_digest, _APPROVAL)
    produced = s.receipt_version() if s.receipt_version else s.adapter.observe().version
    _same(name, "env_version_after", receipt.env_version_after, produced)
    if receipt.receipt_version < 1 or receipt.committed_at <= 0 or not receipt.result:
        raise _fail(name, "receipt_version, committed_at and result must be set")
    plain = s.execute(s.write("conf-identity-2", 1), s.fence(1, 2))
    _same(name, "approval_digest without approval", plain.approval_digest, None)
    if plain.receipt_id == receipt.receipt_id:
        raise _fail(name, "two writes got the same receipt_id")


# -- observations ---------------------------------------------------------------------------------


def observe_after_a_write_equals_the_projection(s: ConformanceSubject) -> None:
    """project(action, observe()) predicts exactly what observe() returns after the write
    (instance, version, fingerprint and details), and the version moved on."""
    name = "observe_after_a_write_equals_the_projection"
    before = s.adapter.observe()
    action = s.make_write("conf-project", 0, before.version)
    predicted = s.adapter.project(action, before)
    if predicted is None:
        raise _fail(name, "project() gave no prediction from the current observation")
    s.execute(action, s.fence(1, 1))
    after = s.adapter.observe()
    _same(name, "observation after the write", after, predicted)
    if after.version <= before.version:
        raise _fail(name, "version did not move on after a write")


def projection_from_a_stale_observation_is_none(s: ConformanceSubject) -> None:
    """project() from an observation that is no longer current predicts nothing."""
    name = "projection_from_a_stale_observation_is_none"
    before = s.adapter.observe()
    s.execute(s.make_write("conf-stale-1", 0, before.version), s.fence(1, 1))
    stale = s.make_write("conf-stale-2", 1, before.version)
    _same(name, "projection from a stale observation", s.adapter.project(stale, before), None)


def reobservation_without_writes_is_stable(s: ConformanceSubject) -> None:
    """Two observations with nothing in between are equal, details included."""
    name = "reobservation_without_writes_is_stable"
    _same(name, "second observation", s.adapter.observe(), s.adapter.observe())


def stale_precondition_is_refused(s: ConformanceSubject) -> None:
    """A write planned against an older version is refused (AdapterError, not
    retryable) with no effect."""
    name = "stale_precondition_is_refused"
    old = s.adapter.observe().version
    s.execute(s.make_write("conf-pre-1", 0, old), s.fence(1, 1))
    effects = s.effects()
    late = s.make_write("conf-pre-2", 1, old)
    exc = _refused(name, AdapterError, lambda: s.execute(late, s.fence(1, 2)))
    if isinstance(exc, FenceRejectedError | IdempotencyConflictError):
        raise _fail(name, f"refused for the wrong reason: {type(exc).__name__}")
    _same(
        name,
        "retryable",
        exc.retryable if isinstance(exc, AdapterError) else None,
        False,
    )
    _same(name, "effects", s.effects(), effects)


def a_second_handle_sees_the_same_instance_receipts_and_fences(s: ConformanceSubject) -> None:
    """Another handle on the same environment (another process, a restart) sees the same
    instance, observation, receipts and fences."""
    name = "a_second_handle_sees_the_same_instance_receipts_and_fences"
    receipt = s.execute(s.write("conf-reopen"), s.fence(7, 1))
    if s.reopen is None:
        raise _fail(name, "the subject cannot reopen")
    other = s.reopen()
    _same(name, "observation", other.observe(), s.adapter.observe())
    _same(name, "receipt", other.lookup("conf-reopen"), receipt)
    _refused(name, FenceRejectedError, lambda: other.raise_fence(s.fence(6, 0)))


def drift_behind_the_adapter_changes_the_observation(s: ConformanceSubject) -> None:
    """A change made outside the adapter gives another state (same instance, another
    version or fingerprint), so recovery fails closed instead of replaying."""
    name = "drift_behind_the_adapter_changes_the_observation"
    before = s.adapter.observe()
    if s.drift is None:
        raise _fail(name, "the subject cannot drift")
    s.drift()
    after = s.adapter.observe()
    _same(name, "instance", after.instance_id, before.instance_id)
    if after.same_state(before) or after.version < before.version:
        raise _fail(name, "drift left the observation unchanged or moved the version back")


CHECKS: tuple[ConformanceCheck, ...] = (
    ConformanceCheck("fence_lower_than_seen_is_refused", fence_lower_than_seen_is_refused),
    ConformanceCheck(
        "stale_request_after_newer_request_is_refused", stale_request_after_newer_request_is_refused
    ),
    ConformanceCheck(
        "equal_fence_is_accepted_and_fences_are_per_run",
        equal_fence_is_accepted_and_fences_are_per_run,
    ),
    ConformanceCheck(
        "same_key_same_intent_returns_the_identical_receipt",
        same_key_same_intent_returns_the_identical_receipt,
    ),
    ConformanceCheck(
        "same_key_other_intent_conflicts_with_the_existing_receipt",
        same_key_other_intent_conflicts_with_the_existing_receipt,
    ),
    ConformanceCheck(
        "lookup_returns_the_authoritative_receipt_or_none",
        lookup_returns_the_authoritative_receipt_or_none,
    ),
    ConformanceCheck("receipts_carry_their_identity", receipts_carry_their_identity),
    ConformanceCheck(
        "observe_after_a_write_equals_the_projection", observe_after_a_write_equals_the_projection
    ),
    ConformanceCheck(
        "projection_from_a_stale_observation_is_none", projection_from_a_stale_observation_is_none
    ),
    ConformanceCheck(
        "reobservation_without_writes_is_stable", reobservation_without_writes_is_stable
    ),
    ConformanceCheck(
        "stale_precondition_is_refused", stale_precondition_is_refused, needs="check_preconditions"
    ),
    ConformanceCheck(
        "a_second_handle_sees_the_same_instance_receipts_and_fences",
        a_second_handle_sees_the_same_instance_receipts_and_fences,
        needs="reopen",
    ),
    ConformanceCheck(
        "drift_behind_the_adapter_changes_the_observation",
        drift_behind_the_adapter_changes_the_observation,
        needs="drift",
    ),
)


def check_names() -> list[str]:
    """The names of every check, in order."""
    return [c.name for c in CHECKS]


def _capable(check: ConformanceCheck, subject: ConformanceSubject) -> bool:
    if check.needs == "reopen":
        return subject.reopen is not None
    if check.needs == "drift":
        return subject.drift is not None
    if check.needs == "check_preconditions":
        return subject.checks_precondition
    return True


def run_check(check: ConformanceCheck | str, factory: SubjectFactory) -> bool:
    """Run one check on a fresh subject. Returns False when it was skipped because the
    subject lacks what it needs, True when it passed.

    Raises:
        ConformanceError: the adapter broke the contract (``check`` names the check).
        KeyError: no check has that name.
    """
    chosen = check if isinstance(check, ConformanceCheck) else {c.name: c for c in CHECKS}[check]
    subject = factory()
    try:
        if not _capable(chosen, subject):
            return False
        chosen.run(subject)
        return True
    finally:
        subject.close()


def run_conformance(factory: SubjectFactory) -> dict[str, str]:
    """Run every check; return ``{name: "passed" | "skipped" | "failed: <message>"}``.

    Errors other than ConformanceError (an adapter crashing) propagate.
    """
    verdicts: dict[str, str] = {}
    for check in CHECKS:
        try:
            verdicts[check.name] = "passed" if run_check(check, factory) else "skipped"
        except ConformanceError as exc:
            verdicts[check.name] = f"failed: {exc.message}"
    return verdicts
