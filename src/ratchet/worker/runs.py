"""What a submitted run is made of, as stored in Redis beside its checkpoints.

A :class:`RunDocument` holds the scenario (the task contract), which agent proposes the
actions, and where its environment is. It is stored, canonical JSON, in the run's
``scenario`` slot by the same script call that stores generation 1, so a run never exists
without it. It is not trusted blindly: every restore compares the scenario's fingerprint
with the one inside the signed checkpoint, and the environment's instance id with the one
the checkpoint recorded, so a rewritten document fails closed.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, Strict, ValidationError

from ratchet.adapters.http import HttpAdapter
from ratchet.adapters.router import RouterAdapter
from ratchet.adapters.verifier import CommandVerifier, VerifierCommand
from ratchet.adapters.workspace import WorkspaceAdapter
from ratchet.errors import ConfigurationError, ContractError
from ratchet.runtime import Adapter, ApprovalEvidence, ReviewDecision, Scenario
from ratchet.runtime.canonical import model_json, strict_json_loads
from ratchet.runtime.types import Frozen, JsonObject

__all__ = [
    "EnvironmentSpec",
    "RunDocument",
    "VerifierSpec",
    "build_adapter",
    "parse_evidence",
]

_Text = Annotated[str, Strict(), Field(min_length=1, max_length=4096)]


class VerifierSpec(Frozen):
    """An allow-listed verifier command for one target."""

    argv: tuple[_Text, ...] = Field(min_length=1)
    timeout_seconds: Annotated[int, Strict(), Field(ge=1, le=24 * 3600)] = 300


class EnvironmentSpec(Frozen):
    """Where a run's side effects happen: a workspace directory, and optionally an HTTP
    API for ``external_call`` actions."""

    kind: Literal["workspace"] = "workspace"
    root: _Text
    verifiers: dict[Annotated[str, Strict()], VerifierSpec] = Field(default_factory=dict)
    http_base_url: _Text | None = None


class RunDocument(Frozen):
    schema_version: Literal[1] = 1
    scenario: Scenario
    agent: _Text
    agent_config: JsonObject = Field(default_factory=dict)
    environment: EnvironmentSpec

    def to_bytes(self) -> bytes:
        return model_json(self)

    @classmethod
    def from_bytes(cls, data: bytes) -> RunDocument:
        """Raises ContractError naming the first bad field."""
        try:
            return cls.model_validate(strict_json_loads(data))
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "document"
            raise ContractError(f"run document field {field}: {first['msg']}",
                                field=field) from None


def build_adapter(document: RunDocument) -> Adapter:
    """The adapter for a run's environment.

    Raises ConfigurationError (missing workspace, bad verifier, bad URL), AdapterError.
    """
    env = document.environment
    scenario = document.scenario
    missing = set(scenario.allowed_verifier_targets) - set(env.verifiers)
    if missing:
        raise ConfigurationError("the environment has no command for verifier targets "
                                 f"{sorted(missing)}", field="environment.verifiers")
    verifier = CommandVerifier({
        target: VerifierCommand(argv=spec.argv, timeout_seconds=float(spec.timeout_seconds))
        for target, spec in env.verifiers.items()
    })
    files = WorkspaceAdapter(env.root, scenario.allowed_paths, verifier=verifier)
    if env.http_base_url is None:
        return files
    calls: Any = HttpAdapter(env.http_base_url)
    return RouterAdapter(files, calls)


def parse_evidence(raw: bytes) -> ApprovalEvidence | ReviewDecision | None:
    """Evidence from an inbox entry, or None if it is neither kind (it is then ignored)."""
    for model in (ApprovalEvidence, ReviewDecision):
        try:
            return model.model_validate_json(raw)
        except ValidationError:
            continue
    return None
