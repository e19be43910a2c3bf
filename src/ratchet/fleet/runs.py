"""What a submitted run is made of, as stored in Redis beside its checkpoints.

A :class:`RunDocument` holds the scenario (the task contract), which agent proposes the
actions (and its configuration), and where its environment is: the workspace root, the
verifier commands, an HTTP API. It is stored in the run's ``scenario`` slot by the same
script call that stores generation 1, so a run never exists without it.

It decides what a worker builds and runs, so it is signed like a checkpoint: at submit,
:func:`seal_document` signs ``{"run_id", "document"}`` (canonical JSON) with the
checkpoint key ring under its own domain (``ratchet/document/v1``, so a document's MAC
never verifies as a checkpoint's), and the document's digest (:func:`document_digest`)
goes into the first state and so into every checkpoint. A worker opens it with
:func:`open_document` (the MAC, then the run id, then a strict parse) and compares its
digest with the verified checkpoint's **before** it builds an adapter, loads an agent or
resolves a verifier command: a rewritten, swapped or forged document is refused with
``IntegrityError(reason="document")`` and nothing of it is used.
"""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    Field,
    SerializerFunctionWrapHandler,
    Strict,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from ratchet.adapters.gitobjects import GIT_DIR
from ratchet.adapters.ground import Ground
from ratchet.errors import CheckpointError, ConfigurationError, ContractError, IntegrityError
from ratchet.fleet.mcp_servers import SERVER_NAME
from ratchet.fleet.settings import HOST_PATTERN
from ratchet.runtime import (
    ApprovalEvidence,
    KeyRing,
    Observation,
    ReviewDecision,
    RunState,
    Scenario,
)
from ratchet.runtime.canonical import (
    Domain,
    canonical_json,
    constant_time_equal,
    model_digest,
    strict_json_loads,
)
from ratchet.runtime.catalog import TOOL_NAME_PATTERN
from ratchet.runtime.signing import open_envelope, seal_envelope
from ratchet.runtime.types import Frozen, JsonObject, StrictBool, exact_version

__all__ = [
    "EnvironmentSpec",
    "GitRemoteSpec",
    "McpServerSpec",
    "RunDocument",
    "ToolCheckSpec",
    "VerifierSpec",
    "check_document_binding",
    "decide_environment",
    "document_digest",
    "open_document",
    "parse_evidence",
    "seal_document",
    "workspace_is_git",
]

# A git branch name or commit id as a task may write it (see _check_ref for the rest).
_REF_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/+-]*$"


def _check_ref(value: str | None) -> str | None:
    """A branch name git itself would accept (the rules of ``git check-ref-format`` that
    the pattern does not cover): no ``..`` or ``//``, no segment starting with ``.``, no
    ``.lock`` segment end, not ending in ``/`` or ``.``."""
    if value is None:
        return value
    bad = (
        ".." in value
        or "//" in value
        or value.endswith(("/", "."))
        or any(part.startswith(".") or part.endswith(".lock") for part in value.split("/"))
    )
    if bad:
        raise ValueError(f"{value!r} is not a valid git branch name or commit")
    return value


# Paths, argv items, agent names, URLs: a NUL would only fail later, inside the OS.
_Text = Annotated[str, Strict(), Field(min_length=1, max_length=4096, pattern=r"^[^\x00]*$")]


class VerifierSpec(Frozen):
    """An allow-listed verifier command for one target."""

    argv: tuple[_Text, ...] = Field(min_length=1)
    timeout_seconds: Annotated[int, Strict(), Field(ge=1, le=24 * 3600)] = 300
    # The command runs sandboxed with no network unless the task allows it here.
    network: StrictBool = False


class ToolCheckSpec(Frozen):
    """A verifier target answered by a read-only declared tool (an environment of tools
    only, ``kind: tools``, has no folder to run a command in): the tool is called with
    ``arguments`` and the check passes when its output holds ``expect`` (every key of it,
    recursively; lists and values compared whole). The tool must be one the scenario
    permits. ``contains``: texts the output must also contain."""

    tool: Annotated[str, Strict(), Field(pattern=TOOL_NAME_PATTERN)]
    arguments: JsonObject = Field(default_factory=dict)
    expect: JsonObject = Field(default_factory=dict)
    # Texts the output must contain (a server that answers in prose, such as the git
    # reference server's log, is checked by what it says). Left out of the JSON when
    # empty, so documents signed before the field existed digest as they did.
    contains: tuple[Annotated[str, Strict(), Field(min_length=1, max_length=4096)], ...] = Field(
        default=(), max_length=32
    )

    @model_serializer(mode="wrap")
    def _without_unset_contains(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if not self.contains and isinstance(data, dict):
            data.pop("contains", None)
        return data

    @model_validator(mode="after")
    def _something_to_check(self) -> ToolCheckSpec:
        if not self.expect and not self.contains:
            raise ValueError("a check has expect, contains, or both")
        return self


class McpServerSpec(Frozen):
    """An MCP server whose tools a run may call, named ``prefix`` + the MCP tool name:
    either by address (``url``, streamable HTTP) or by the name of a stdio server the
    operator declares in the workers' settings (``server``, ``RATCHET_MCP_SERVERS``,
    :mod:`ratchet.fleet.mcp_servers`). A document never spells a command: a worker starts
    only what its own settings declare. ``credential`` (with ``url`` only) names one of
    the worker's credentials (``RATCHET_CREDENTIALS``, :mod:`ratchet.fleet.credentials`)
    sent as a bearer token: the worker's map says which secret that is and whether it may
    go to ``url``; a declared server's credentials are the declaration's.

    ``token_env`` (an environment variable the document chose) is no longer read: it
    parses, so documents signed before ``credential`` existed open and digest as they
    did, and a document that sets it is refused at submit and at job start. For the same
    reason ``credential`` is left out of the JSON when unset (``server`` likewise)."""

    url: (
        Annotated[str, Strict(), Field(min_length=1, max_length=2048, pattern=r"^https?://")] | None
    ) = None
    server: Annotated[str, Strict(), Field(pattern=SERVER_NAME)] | None = Field(
        default=None,
        description="The name of a stdio MCP server the workers' RATCHET_MCP_SERVERS "
        "declares (instead of url).",
    )
    prefix: Annotated[
        str, Strict(), Field(max_length=32, pattern=r"^([A-Za-z][A-Za-z0-9_-]*)?$")
    ] = ""
    token_env: (
        Annotated[
            str,
            Strict(),
            Field(
                pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$",
                description="No longer read: refused at submit and at job start; name a "
                "credential instead.",
                json_schema_extra={"deprecated": True},
            ),
        ]
        | None
    ) = None
    credential: Annotated[str, Strict(), Field(min_length=1, max_length=128)] | None = Field(
        default=None,
        description="The name of one of the worker's credentials (RATCHET_CREDENTIALS), "
        "sent as a bearer token when its destinations cover url.",
    )

    @model_serializer(mode="wrap")
    def _without_unset_credential(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if isinstance(data, dict):
            for name in ("credential", "server", "url"):
                if getattr(self, name) is None:
                    data.pop(name, None)
        return data

    @model_validator(mode="after")
    def _one_way(self) -> McpServerSpec:
        if (self.url is None) == (self.server is None):
            raise ValueError("an MCP server is named by url or by server, exactly one")
        if self.server is not None and (self.credential is not None or self.token_env):
            raise ValueError(
                "a declared server's credentials are its declaration's: no credential here"
            )
        return self


class GitRemoteSpec(Frozen):
    """A git workspace's remote (``environment.kind: git``; docs/adapters.md, "Git
    workspaces"): the run's files live on a branch of it, which any worker on any host
    reaches. ``base`` is what the run starts from: a task file may name a branch or a
    commit; submit resolves it to the commit and signs that. ``branch`` is the run's own
    branch, made at submit (``ratchet/<run id>`` unless the task file names one) at the
    base. ``credential`` names one of the worker's credentials (``RATCHET_CREDENTIALS``),
    sent over ``http(s)://`` as the password of basic authentication with ``username``."""

    url: Annotated[
        str, Strict(), Field(min_length=1, max_length=2048, pattern=r"^(file|git|https?)://")
    ]
    base: Annotated[str, Strict(), Field(min_length=1, max_length=200, pattern=_REF_PATTERN)]
    branch: (
        Annotated[str, Strict(), Field(min_length=1, max_length=200, pattern=_REF_PATTERN)] | None
    ) = None
    credential: Annotated[str, Strict(), Field(min_length=1, max_length=128)] | None = None
    username: Annotated[str, Strict(), Field(min_length=1, max_length=128)] = "ratchet"

    _refs = field_validator("base", "branch")(_check_ref)

    @field_validator("url")
    @classmethod
    def _no_secret_in_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if "@" in parts.netloc or any(ord(c) < 0x21 for c in value):
            raise ValueError(
                "the remote URL carries no user, password or whitespace: name one of the "
                "worker's credentials in environment.remote.credential instead"
            )
        if parts.scheme != "file" and not parts.hostname:
            raise ValueError("the remote URL names no host")
        if parts.scheme == "file" and (parts.netloc or not parts.path.startswith("/")):
            raise ValueError("a file:// remote is an absolute path: file:///path/to/repo.git")
        return value


class EnvironmentSpec(Frozen):
    """Where a run's side effects happen: a workspace directory (``kind: workspace``,
    ``root``) or a branch of a git remote (``kind: git``, ``remote``), and optionally an
    HTTP API for ``external_call`` actions and MCP servers whose tools the scenario
    permits."""

    kind: Literal["workspace", "git", "tools"] = "workspace"
    root: _Text | None = None
    remote: GitRemoteSpec | None = None
    # Whether the workspace is a git work tree (its .git folder at the root): fixed at
    # submit, from the submitter's disk or the task file, and signed with the document. A
    # worker never decides it again from the disk, where agent-written code could have
    # run `git init`. None only in documents signed before the field existed: their
    # checkpoint's recorded environment decides (see workspace_is_git).
    git: StrictBool | None = None
    # The host whose disk holds the workspace (the worker setting RATCHET_HOST of the
    # machine it was submitted on, unless the task file names one): the workspace is
    # host-local, so only that host's workers open the run, and every path that enqueues
    # it sends it to that host's queue. Fixed at submit and signed. None only in documents
    # signed before the field existed: any worker may take them, as then.
    host: Annotated[str, Strict(), Field(pattern=HOST_PATTERN)] | None = None
    # Where the declared tools' ledger lives: "store" (the run's own Redis keys, fenced at
    # the store by the run's lease and reachable from every host: what submit picks) or
    # "workspace" (a file in the workspace's state folder, on its host's disk). None only
    # in documents signed before the field existed: the file, as then.
    tools_ledger: Literal["store", "workspace"] | None = None

    @model_serializer(mode="wrap")
    def _without_unset_later_fields(self, handler: SerializerFunctionWrapHandler) -> Any:
        # Left out of the JSON when unset, so a document signed before these fields
        # existed seals and digests as it did.
        data = handler(self)
        if isinstance(data, dict):
            for name in ("git", "host", "tools_ledger", "root", "remote"):
                if getattr(self, name) is None:
                    data.pop(name, None)
            if not self.checks:
                data.pop("checks", None)
        return data

    @model_validator(mode="after")
    def _one_place(self) -> EnvironmentSpec:
        if self.kind == "workspace" and (self.root is None or self.remote is not None):
            raise ValueError("a workspace environment has a root and no remote")
        if self.kind == "git" and (self.remote is None or self.root is not None):
            raise ValueError("a git environment has a remote and no root")
        if self.kind == "git" and self.git is not None:
            raise ValueError("environment.git is for a workspace folder; a git environment is one")
        if self.kind == "tools" and (
            self.root is not None or self.remote is not None or self.git is not None
        ):
            raise ValueError("a tools environment has no root, remote or git: only its tools")
        if self.kind == "tools" and self.verifiers:
            raise ValueError(
                "a tools environment runs no verifier command (no folder to run it in): "
                "answer its targets with environment.checks"
            )
        if self.kind != "tools" and self.checks:
            raise ValueError("environment.checks belong to a tools environment (kind: tools)")
        return self

    @property
    def local_parts(self) -> tuple[str, ...]:
        """The parts of this environment that live on one host's disk (the workspace
        folder, and the declared tools' ledger kept in it); the rest (a git remote, HTTP
        APIs, MCP servers reached over the network) every host reaches."""
        return ("workspace",) if self.kind == "workspace" else ()

    @property
    def workspace_root(self) -> str:
        """The workspace folder (a ``workspace`` environment's root).

        Raises:
            ConfigurationError: the environment is a git remote, which has no folder.
        """
        if self.root is None:
            raise ConfigurationError(
                "the run's environment is a git remote: it has no workspace folder",
                field="environment.root",
            )
        return self.root

    verifiers: dict[Annotated[str, Strict()], VerifierSpec] = Field(default_factory=dict)
    # kind: tools: verifier targets answered by read tools (left out of the JSON when
    # empty, so documents signed before the field existed digest as they did).
    checks: dict[Annotated[str, Strict()], ToolCheckSpec] = Field(default_factory=dict)
    http_base_url: _Text | None = None
    mcp: dict[
        Annotated[str, Strict(), Field(pattern=r"^[A-Za-z][A-Za-z0-9_-]{0,31}$")], McpServerSpec
    ] = Field(default_factory=dict)


class RunDocument(Frozen):
    """A run as submitted: the scenario, the agent and its configuration, the environment."""

    schema_version: Literal[1] = 1
    scenario: Scenario
    agent: _Text
    agent_config: JsonObject = Field(default_factory=dict)
    environment: EnvironmentSpec

    _exact_version = field_validator("schema_version", mode="before")(exact_version)


def document_digest(document: RunDocument) -> str:
    """The digest every checkpoint of the run binds (over its canonical JSON)."""
    return model_digest(Domain.DOCUMENT, document)


def decide_environment(document: RunDocument, *, host: str) -> RunDocument:
    """``document`` with ``environment.git`` and ``environment.host`` fixed, as submit
    signs it: what the task said, else whether the workspace root holds a ``.git`` folder
    now (the submitter's disk, the one decision that is made from it) and ``host`` (the
    submitter's own host: the disk the workspace was read from). A git environment
    (``kind: git``) has neither: it is bound to no host.

    Raises:
        ConfigurationError: the task says git but the root has no ``.git`` folder, or asks
            for the file tool ledger (kept only for runs submitted before the store one).
    """
    env = document.environment
    update: dict[str, Any] = {}
    if env.kind == "workspace":
        root = env.workspace_root
        found = Ground(root).lstat(GIT_DIR) if Path(root).is_dir() else None
        is_repo = found is not None and stat.S_ISDIR(found.st_mode)
        if env.git and not is_repo:
            raise ConfigurationError(
                f"environment.git is true but {root} has no .git folder",
                field="environment.git",
            )
        if env.git is None:
            update["git"] = is_repo
        if env.host is None:
            update["host"] = host
    elif env.host is not None:
        # A git environment lives on its remote, a tools environment in the store and its
        # services: every host reaches them, so neither is bound to a host, and a task
        # that names one is refused rather than half obeyed.
        raise ConfigurationError(
            f"environment.host: a {env.kind} environment is reached from every host and "
            "is bound to no host",
            field="environment.host",
        )
    if env.tools_ledger == "workspace":
        raise ConfigurationError(
            "environment.tools_ledger: the file ledger is kept only for runs submitted "
            "before the store ledger (a restored disk could make it forget a call); new "
            "runs keep it in the store",
            field="environment.tools_ledger",
        )
    if env.tools_ledger is None:
        update["tools_ledger"] = "store"
    if not update:
        return document
    return document.model_copy(update={"environment": env.model_copy(update=update)})


def workspace_is_git(document: RunDocument, recorded: Observation | None) -> bool:
    """Whether the run's workspace is read as a git work tree: the signed document says,
    or (a document signed before it could) the environment its checkpoint recorded.
    Never the disk as it is now.

    Raises:
        ConfigurationError: neither says (a document that was never submitted).
    """
    if document.environment.git is not None:
        return document.environment.git
    if recorded is None:
        raise ConfigurationError(
            "the run document does not say whether its workspace is a git repository "
            "(submit fixes it)",
            field="environment.git",
        )
    return "git_head" in recorded.details


def seal_document(keyring: KeyRing, run_id: str, document: RunDocument) -> bytes:
    """The signed bytes stored for run ``run_id``: an envelope (HMAC under the ring's
    signing key, document domain) over ``{"document": ..., "run_id": ...}``."""
    body = canonical_json({"document": document.model_dump(mode="json"), "run_id": run_id})
    return seal_envelope(keyring, body, domain=Domain.DOCUMENT)


def _refused(message: str, run_id: str, **context: Any) -> IntegrityError:
    return IntegrityError(
        f"run document refused: {message}", reason="document", run_id=run_id, **context
    )


def open_document(keyring: KeyRing, run_id: str, blob: bytes) -> RunDocument:
    """Verify and parse run ``run_id``'s stored document. Nothing of it is read before
    its MAC verifies.

    Raises:
        IntegrityError: ``reason="document"`` (``check`` says which: the envelope's own
            reasons, ``run_id``, ``schema``).
    """
    try:
        body = open_envelope(keyring, blob, domain=Domain.DOCUMENT)
    except CheckpointError as exc:
        raise _refused(
            f"it does not verify ({exc.reason or 'malformed'})",
            run_id,
            check=exc.reason or "malformed",
        ) from None
    try:
        data = strict_json_loads(body)
    except ContractError:
        raise _refused("its signed body is not strict JSON", run_id, check="schema") from None
    if not isinstance(data, dict) or set(data) != {"document", "run_id"}:
        raise _refused("its signed body has the wrong fields", run_id, check="schema")
    if data["run_id"] != run_id:
        raise _refused("it was signed for another run", run_id, check="run_id")
    try:
        return RunDocument.model_validate(data["document"])
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "document"
        raise _refused(f"field {field}: {first['msg']}", run_id, check="schema") from None


def check_document_binding(state: RunState, document: RunDocument) -> None:
    """The verified checkpoint must bind exactly this document.

    Raises:
        IntegrityError: ``reason="document"``, ``check="digest"``.
    """
    expected = state.document_digest
    if expected is None or not constant_time_equal(expected, document_digest(document)):
        raise _refused(
            "the checkpoint binds another document"
            if expected is not None
            else "the checkpoint binds no document",
            state.run_id,
            check="digest",
        )


def parse_evidence(raw: bytes) -> ApprovalEvidence | ReviewDecision | None:
    """Evidence from an inbox entry, or None if it is neither kind (it is then ignored)."""
    for model in (ApprovalEvidence, ReviewDecision):
        try:
            return model.model_validate_json(raw)
        except ValidationError:
            continue
    return None
