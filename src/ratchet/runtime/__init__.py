"""The contract core: pure, typed, no I/O. See DESIGN section 3 and each module's docstring.

Time, identity and the outside world arrive as arguments or through the ports in
:mod:`ratchet.runtime.ports`; nothing here imports redis, sockets, threads, clocks or
randomness (enforced by import-linter).
"""

from ratchet.runtime.actions import (
    KIND_SPECS,
    Action,
    ActionKind,
    Risk,
    derive_idempotency_key,
    intent_digest,
    parse_action,
)
from ratchet.runtime.canonical import canonical_json, digest, strict_json_loads
from ratchet.runtime.checkpoint import CheckpointPayload, seal_checkpoint
from ratchet.runtime.effects import CrashWindow, Effect, Hooks, Performer
from ratchet.runtime.engine import RunEngine, StepResult
from ratchet.runtime.evidence import (
    ApprovalClaims,
    ApprovalEvidence,
    RebaselineClaims,
    RebaselineDecision,
    ReviewDecision,
    ReviewDecisionClaims,
    ReviewVerdict,
    TrustRoots,
    sign_approval,
    sign_rebaseline,
    sign_review_decision,
)
from ratchet.runtime.ports import (
    Adapter,
    Advance,
    Clock,
    Fence,
    GenerationStore,
    Observation,
    ReadResult,
    Receipt,
    RunKey,
    StoredCheckpoint,
    VerifierReport,
)
from ratchet.runtime.restore import Restored, restore_checkpoint
from ratchet.runtime.scenario import Budgets, Scenario, VerifierSpec, load_scenario
from ratchet.runtime.signing import KeyRing, SecretKey
from ratchet.runtime.state import (
    TRANSITIONS,
    Event,
    Phase,
    ReviewReason,
    RunState,
    TraceOutcome,
    check_invariants,
    transition,
)

__all__ = [
    "KIND_SPECS",
    "TRANSITIONS",
    "Action",
    "ActionKind",
    "Adapter",
    "Advance",
    "ApprovalClaims",
    "ApprovalEvidence",
    "Budgets",
    "CheckpointPayload",
    "Clock",
    "CrashWindow",
    "Effect",
    "Event",
    "Fence",
    "GenerationStore",
    "Hooks",
    "KeyRing",
    "Observation",
    "Performer",
    "Phase",
    "ReadResult",
    "RebaselineClaims",
    "RebaselineDecision",
    "Receipt",
    "Restored",
    "ReviewDecision",
    "ReviewDecisionClaims",
    "ReviewReason",
    "ReviewVerdict",
    "Risk",
    "RunEngine",
    "RunKey",
    "RunState",
    "Scenario",
    "SecretKey",
    "StepResult",
    "StoredCheckpoint",
    "TraceOutcome",
    "TrustRoots",
    "VerifierReport",
    "VerifierSpec",
    "canonical_json",
    "check_invariants",
    "derive_idempotency_key",
    "digest",
    "intent_digest",
    "load_scenario",
    "parse_action",
    "restore_checkpoint",
    "seal_checkpoint",
    "sign_approval",
    "sign_rebaseline",
    "sign_review_decision",
    "strict_json_loads",
    "transition",
]
