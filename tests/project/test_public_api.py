"""The public surface is pinned: changing it is a visible decision."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import ratchet
import ratchet.errors
import ratchet.runtime


def test_the_runtime_public_names_are_pinned() -> None:
    assert sorted(ratchet.runtime.__all__) == sorted(
        [
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
            "KIND_SPECS",
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
            "TRANSITIONS",
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
    )
    for name in ratchet.runtime.__all__:
        assert hasattr(ratchet.runtime, name)


def test_every_error_derives_from_one_root() -> None:
    for name in ratchet.errors.__all__:
        cls = getattr(ratchet.errors, name)
        assert issubclass(cls, ratchet.errors.RatchetError)


def test_errors_carry_their_context_as_attributes() -> None:
    err = ratchet.errors.LeaseLostError("lost", run_id="r-1", lease_version=4)
    assert (err.run_id, err.lease_version) == ("r-1", 4)  # type: ignore[attr-defined]
    assert "r-1" in repr(err)


def test_the_fields_callers_decide_on_are_typed_and_context_keeps_what_was_given() -> None:
    errors = ratchet.errors
    failed = errors.AdapterError("down", retryable=True, tool="t")
    assert (failed.retryable, failed.reason) == (True, None)
    assert failed.context == {"retryable": True, "tool": "t"}
    refused = errors.UntrustedGroundError("no", reason="too_large", file_type="fifo", path="p")
    assert (refused.retryable, refused.reason, refused.file_type) == (False, "too_large", "fifo")
    assert refused.context == {
        "retryable": False,
        "reason": "too_large",
        "file_type": "fifo",
        "path": "p",
    }
    assert errors.ConfigurationError("bad").field is None
    assert errors.ConfigurationError("bad").context == {}
    assert errors.ConfigurationError("bad", field="redis_url").field == "redis_url"
    assert errors.ScenarioError("bad", field="budgets").field == "budgets"
    bad_mac = errors.CheckpointError("forged", reason="bad_mac", run_id="r-1")
    assert (bad_mac.reason, bad_mac.field, bad_mac.context["run_id"]) == ("bad_mac", None, "r-1")
    full = errors.StoreFullError("oom", reason="oom")
    assert full.reason == full.context["reason"] == "oom"
    unreadable = errors.HighWaterUnavailableError("x", run_id="r", cause="StoreUnavailableError")
    assert (unreadable.cause, unreadable.reason) == ("StoreUnavailableError", None)
    assert unreadable.context == {"run_id": "r", "cause": "StoreUnavailableError"}
    receipt = object()
    assert errors.IdempotencyConflictError("k", receipt=receipt).receipt is receipt
    assert errors.IdempotencyConflictError("k").receipt is None


def test_the_version_is_the_newest_release_of_the_changelog() -> None:
    root = Path(__file__).resolve().parents[2]
    releases = re.findall(
        r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$",
        (root / "CHANGELOG.md").read_text(encoding="utf-8"),
        re.MULTILINE,
    )
    project = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert releases, "the changelog names no release"
    assert releases[0] == project["version"] == ratchet.__version__
    assert (root / "src" / "ratchet" / "py.typed").exists()


PINNED: dict[str, list[str]] = {
    "ratchet": [
        "Adapter", "Agent", "AgentStep", "AgentView", "Risk", "Tool", "ToolCall", "Toolbox",
        "__version__", "tool",
    ],
    "ratchet.tools": [
        "ENTRY_POINT_GROUP", "Found", "FunctionTool", "RecordedCall", "Recovery", "Tool",
        "ToolCall", "ToolCatalog", "ToolLedger", "ToolSpec", "Toolbox", "ToolsAdapter",
        "load_entry_point_tool", "output_result", "tool",
    ],
    "ratchet.leasing": [
        "Acquired", "CommitResult", "DEFAULT_MAX_CHECKPOINT_BYTES", "EXPIRY_INDEX", "Lease",
        "LeaseHolder", "LeasedRun", "PreparedCommit", "RUNS_INDEX",
        "ReapClaim", "RedisStore", "Released", "RunCreated", "RunCreator", "RunKeys",
        "RunSnapshot", "new_commit_id", "nonce_key", "run_keys",
    ],
    "ratchet.entrypoints": ["installed_entry_points"],
    "ratchet.redis_server": ["RedisServer", "find_redis_cli", "find_redis_server", "free_port"],
    "ratchet.adapters": [
        "CommandVerifier", "HttpAdapter", "RouterAdapter", "SystemClock", "VerifierCommand",
        "VerifierRun", "WorkspaceAdapter",
    ],
    "ratchet.testing.conformance": [
        "CHECKS", "ConformanceCheck", "ConformanceSubject", "SubjectFactory", "check_names",
        "run_check", "run_conformance",
    ],
    "ratchet.testing.memory": [
        "LeasedMemoryStore", "ManualClock", "MemoryGenerationStore", "MemoryWorkspace",
        "ObserveFailsAfterWrite", "files_fingerprint",
    ],
    "ratchet.testing.cluster": ["LocalCluster"],
    "ratchet.agents": [
        "ENTRY_POINT_GROUP", "Agent", "AgentFactory", "AgentPolicy", "AgentStep", "AgentView",
        "GreetingAgent", "ScriptedAgent", "ToolCallingAgent", "build_agent", "load_agent",
    ],
    "ratchet.ops": [
        "Attached", "CancelPosted", "Posted", "RunView", "approve", "attach", "cancel",
        "create_run", "inspect_run",
        "load_private_key", "post_approval", "post_review_decision", "rebaseline", "retry",
        "review", "review_claims", "submit",
    ],
    "ratchet.fleet": [],
    "ratchet.worker": [],
    "ratchet.chaos": [],
    "ratchet.testing": [],
    "ratchet.demo": [],
    "ratchet.console": ["CSP", "ConsoleData", "ConsoleServer", "serve_console", "waiting_runs"],
    "ratchet.langgraph": [
        "DEFAULT_LEASE_TTL_MS", "LEASE_KEY", "LeaseInfo", "RatchetSaver", "Takeover",
        "ThreadKeys", "ThreadLease", "ThreadWriter", "default_serde", "thread_keys", "thread_tag",
    ],
    "ratchet.cli": ["app", "main"],
    "ratchet.integrations": [],
    "ratchet.integrations.pydantic_ai": [
        "PYDANTIC_AI_VERSION", "PydanticAIAgent", "PydanticAIConfig", "PydanticAIState",
        "PydanticAITool", "RatchetAgent", "current_call",
    ],
    "ratchet.integrations.openai_agents": [
        "OPENAI_AGENTS_VERSION", "OpenAIAgentsAgent", "OpenAIAgentsConfig", "OpenAIAgentsState",
        "OpenAIAgentsTool", "RatchetAgent", "current_call",
    ],
}  # fmt: skip


def test_the_names_at_the_top_are_the_ones_where_they_live_and_load_on_first_use() -> None:
    homes = {
        "Adapter": "ratchet.runtime", "Agent": "ratchet.agents", "AgentStep": "ratchet.agents",
        "AgentView": "ratchet.agents", "Risk": "ratchet.runtime", "Tool": "ratchet.tools",
        "ToolCall": "ratchet.tools", "Toolbox": "ratchet.tools", "tool": "ratchet.tools",
    }  # fmt: skip
    assert sorted(homes) == sorted(set(ratchet.__all__) - {"__version__"})
    for name, home in homes.items():
        assert getattr(ratchet, name) is getattr(importlib.import_module(home), name), name
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, ratchet; print(*sorted(sys.modules), sep='\\n')"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert "ratchet" in loaded
    assert [m for m in loaded if m.startswith("ratchet.")] == []


@pytest.mark.parametrize("package", sorted(PINNED))
def test_each_packages_public_names_are_pinned(package: str) -> None:
    module = importlib.import_module(package)
    assert sorted(module.__all__) == sorted(PINNED[package])
    for name in module.__all__:
        assert hasattr(module, name), name
