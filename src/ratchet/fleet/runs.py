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
from collections.abc import Callable, Mapping
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
from ratchet.adapters.gitremote import (
    BranchMoved,
    PushUnknown,
    RemoteBranch,
    cache_folder,
    is_commit_id,
)
from ratchet.adapters.gitworkspace import GitWorkspaceAdapter
from ratchet.adapters.ground import Ground
from ratchet.adapters.http import HttpAdapter
from ratchet.adapters.journal import BUSY_TIMEOUT_SECONDS
from ratchet.adapters.router import RouterAdapter
from ratchet.adapters.sandbox import Sandbox
from ratchet.adapters.verifier import CommandVerifier, VerifierCommand
from ratchet.adapters.workspace import WorkspaceAdapter
from ratchet.agents.credentials import credential_uses
from ratchet.errors import CheckpointError, ConfigurationError, ContractError, IntegrityError
from ratchet.fleet.credentials import BoundCredential, CredentialMap, no_longer_read
from ratchet.fleet.mcp_servers import SERVER_NAME, McpServerDeclaration, declared_tools, live_tools
from ratchet.fleet.settings import HOST_PATTERN
from ratchet.leasing import RedisStore
from ratchet.runtime import (
    Adapter,
    ApprovalEvidence,
    Clock,
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
from ratchet.runtime.catalog import BUILTIN_TOOLS, TOOL_NAME_PATTERN
from ratchet.runtime.signing import open_envelope, seal_envelope
from ratchet.runtime.types import Frozen, JsonObject, StrictBool, exact_version
from ratchet.tools import Tool, Toolbox
from ratchet.tools.adapter import ToolCheck
from ratchet.tools.ledger import CallLedger
from ratchet.tools.store_ledger import StoreLedger

__all__ = [
    "EnvironmentSpec",
    "GitRemoteSpec",
    "McpServerSpec",
    "RunDocument",
    "ToolCheckSpec",
    "VerifierSpec",
    "build_adapter",
    "check_credentials",
    "check_document_binding",
    "decide_environment",
    "document_digest",
    "make_run_branch",
    "open_document",
    "parse_evidence",
    "remote_branch",
    "run_toolbox",
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


def check_credentials(document: RunDocument, credentials: CredentialMap) -> None:
    """Every credential ``document`` names is one ``credentials`` (this process's own
    ``RATCHET_CREDENTIALS``) defines for the URL the document would send it to. Nothing
    is read or sent. Submit checks with the submitter's map before the run exists, a
    worker with its own at job start before it builds the agent or contacts a server.

    Raises:
        ConfigurationError: one line naming the field: a field that names an
            environment variable (``token_env``, ``api_key_env``: no longer read), a
            ``RATCHET_*`` name, a name the map does not define, a URL its destinations do
            not cover.
    """
    for server, spec in document.environment.mcp.items():
        _mcp_credential(server, spec, credentials)
    _git_credential(document.environment, credentials)
    for use in credential_uses(document.agent, dict(document.agent_config)):
        credentials.bind(use.name, use.url, field=use.field)


def _git_credential(env: EnvironmentSpec, credentials: CredentialMap) -> BoundCredential | None:
    """The credential a git environment's remote is sent, checked for its URL (None:
    none). Raises ConfigurationError (see :func:`check_credentials`)."""
    remote = env.remote
    if remote is None or remote.credential is None:
        return None
    if not remote.url.startswith(("http://", "https://")):
        raise ConfigurationError(
            "environment.remote.credential: only an http(s):// remote carries a credential",
            field="environment.remote.credential",
        )
    return credentials.bind(remote.credential, remote.url, field="environment.remote.credential")


def remote_branch(
    env: EnvironmentSpec, *, state_dir: Path, credentials: CredentialMap | None, branch: str
) -> RemoteBranch:
    """The git environment's remote, on ``branch``, with this process's object cache
    (under ``state_dir``) and its own credential for the remote's URL.

    Raises:
        ConfigurationError: not a git environment; the credential is refused.
    """
    remote = env.remote
    if remote is None:
        raise ConfigurationError("the environment has no git remote", field="environment.remote")
    bound = _git_credential(env, credentials if credentials is not None else CredentialMap())
    password = (lambda: bound().get_secret_value()) if bound is not None else None
    return RemoteBranch(
        remote.url,
        branch,
        cache=cache_folder(state_dir),
        password=password,
        username=remote.username,
    )


def make_run_branch(
    document: RunDocument,
    *,
    run_id: str,
    state_dir: Path,
    credentials: CredentialMap | None,
) -> RunDocument:
    """For a git environment: resolve the base to a commit, and make the run's branch
    (``ratchet/<run id>`` unless the task names one) at it on the remote, so the signed
    document names both. A branch that exists already is refused unless it stands at
    that very commit (a submit of this run that stopped after making it). Any other
    environment is returned as it is.

    Raises:
        ConfigurationError: the base names no branch or commit of the remote; the
            branch exists elsewhere; the credential is refused.
        AdapterError: the remote could not be reached (retryable=True).
    """
    env = document.environment
    remote = env.remote
    if remote is None:
        return document
    branch = remote.branch or f"ratchet/{run_id}"
    target = remote_branch(env, state_dir=state_dir, credentials=credentials, branch=branch)
    try:
        refs = target.refs()
        base = remote.base
        if not is_commit_id(base):
            found = refs.get(b"refs/heads/" + base.encode())
            if found is None:
                raise ConfigurationError(
                    f"environment.remote.base: the remote has no branch {base!r} (name a "
                    "branch or a full commit id)",
                    field="environment.remote.base",
                )
            base = found.decode()
        target.fetch(base.encode())
        target.commit(base.encode())  # a commit, not a tree or a blob
        existing = refs.get(target.ref)
        if existing is None:
            try:
                target.push(None, base.encode())
            except (BranchMoved, PushUnknown):
                existing = target.tip()
        if existing is not None and existing != base.encode():
            raise ConfigurationError(
                f"environment.remote.branch: {branch!r} exists on the remote at another "
                "commit; a run's branch is its own (name another, or delete it)",
                field="environment.remote.branch",
            )
    finally:
        target.close()
    fixed = remote.model_copy(update={"base": base, "branch": branch})
    return document.model_copy(update={"environment": env.model_copy(update={"remote": fixed})})


def _mcp_credential(
    server: str, spec: McpServerSpec, credentials: CredentialMap
) -> BoundCredential | None:
    """The credential MCP server ``server`` is sent, checked for its URL (None: none).

    Raises ConfigurationError (see :func:`check_credentials`)."""
    field = f"environment.mcp.{server}"
    if spec.token_env is not None:
        raise no_longer_read(f"{field}.token_env", f"{field}.credential")
    if spec.credential is None or spec.url is None:
        return None
    return credentials.bind(spec.credential, spec.url, field=f"{field}.credential")


def run_toolbox(
    document: RunDocument,
    *,
    credentials: CredentialMap | None = None,
    servers: Mapping[str, McpServerDeclaration] | None = None,
    start: bool = True,
    sandbox: Sandbox | None = None,
    state_dir: Path | None = None,
) -> Toolbox:
    """The declared tools a run's scenario permits, loaded from the installed
    ``ratchet.tools`` entry points (installing a package is the operator's decision;
    permitting one of its tools, the task's). Only the permitted names are loaded. An
    MCP server's credential comes from ``credentials`` (this process's own map; None: a
    server that names one is refused), checked for the server's URL before it is
    contacted. A stdio server the document names (``server``) is one of ``servers``
    (this process's ``RATCHET_MCP_SERVERS``): a worker (``start``) uses its live tools
    from the process's shared connection; submit and operator commands (``start=False``)
    know its tools by their declarations only and start nothing. A server declared
    ``sandbox`` runs under ``sandbox`` with its folder under ``state_dir``.

    Raises:
        ConfigurationError: a permitted tool is not installed or fails to load, or the
            scenario does not ask for an approval a tool requires; a credential is
            refused (see :func:`check_credentials`); a named server is not declared here.
        AdapterError: an MCP server could not be reached or started (retryable=True).
    """
    names = [str(n) for n in document.scenario.permissions if str(n) not in BUILTIN_TOOLS]
    box = Toolbox()
    for server, spec in document.environment.mcp.items():
        field = f"environment.mcp.{server}"
        made_tools: list[Tool]
        if spec.server is None:
            made_tools = _mcp_tools(server, spec, names, credentials or CredentialMap())
        elif start:
            made_tools = live_tools(
                spec.server,
                prefix=spec.prefix,
                permitted=names,
                servers=servers or {},
                credentials=credentials or CredentialMap(),
                field=field,
                sandbox=sandbox,
                scratch=state_dir,
            )
        else:
            made_tools = declared_tools(
                spec.server,
                prefix=spec.prefix,
                permitted=names,
                servers=servers or {},
                field=field,
            )
        for made in made_tools:
            box.add(made)
    box = box.with_entry_points(n for n in names if n not in box)
    box.catalog.check_scenario(document.scenario)
    return box


def _mcp_tools(
    server: str, spec: McpServerSpec, permitted: list[str], credentials: CredentialMap
) -> list[Tool]:
    """The tools of MCP server ``server`` that the scenario permits (none: not contacted).

    Raises:
        ConfigurationError: the ``mcp`` extra is missing; the credential is refused or
            its secret cannot be read (nothing was sent).
        AdapterError: the server could not be reached (retryable=True).
    """
    # Checked whether or not the server is contacted: a bad reference is refused alike.
    credential = _mcp_credential(server, spec, credentials)
    wanted = [n for n in permitted if n.startswith(spec.prefix)]
    if not wanted:
        return []
    try:
        from ratchet.tools.mcp import MCPConnection, mcp_tools  # noqa: PLC0415 - optional extra
    except ImportError:
        raise ConfigurationError(
            f"the run names MCP server {server!r}: install ratchet[mcp]",
            field=f"environment.mcp.{server}",
        ) from None
    headers: dict[str, str] = {}
    if credential is not None:
        headers["Authorization"] = f"Bearer {credential().get_secret_value()}"
    if spec.url is None:  # for the type checker: a url-less server is a declared one
        raise ConfigurationError(
            "an MCP server without url is a declared one", field=f"environment.mcp.{server}"
        )
    connection = MCPConnection.http(spec.url, headers=headers)
    try:
        listed = mcp_tools(connection, prefix=spec.prefix)
    except BaseException:
        connection.close()
        raise
    kept = [t for t in listed if t.spec.name in wanted]
    if not kept:
        connection.close()
    return kept


def build_adapter(
    document: RunDocument,
    *,
    sandbox: Sandbox | None = None,
    clock: Clock | None = None,
    http_token: str | None = None,
    toolbox: Toolbox | None = None,
    busy_timeout_s: float = BUSY_TIMEOUT_SECONDS,
    write_hook: Callable[[str], None] | None = None,
    recorded: Observation | None = None,
    store: RedisStore | None = None,
    run_id: str | None = None,
    create_ledger: bool = False,
    state_dir: Path | None = None,
    credentials: CredentialMap | None = None,
) -> Adapter:
    """The adapter for a run's (verified) environment. ``sandbox`` confines its verifier
    commands; a worker passes its own, checked usable here before anything is built.
    ``clock`` stamps the workspace's receipts (a worker passes the store's clock: the
    receipt's commit time is compared with approval expiry). ``http_token`` is the bearer
    token of the environment's HTTP API (the worker's setting, never the document's).
    ``toolbox`` holds the declared tools the scenario permits (default:
    :func:`run_toolbox`); with any, they join the environment as its ``tools`` part, over
    the ledger the document names: the run's own keys in ``store`` (``run_id``'s; made
    there with ``create_ledger``, which only submit does), or a file in the workspace's
    state folder. ``busy_timeout_s`` bounds the workspace
    journal's wait for a lock another process holds (the worker's
    ``workspace_busy_timeout_ms``); ``write_hook`` is called at each stage of a workspace
    write and of a declared tool's call (``before_call``, ``after_call``; drills and
    tests only). A git environment's remote is reached with this process's object cache
    under ``state_dir`` (its checkouts too) and its own ``credentials``.

    Raises ConfigurationError (missing workspace, bad verifier, bad URL, no usable
    sandbox, a permitted tool missing), AdapterError.
    """
    if sandbox is not None:
        sandbox.check_usable()
    env = document.environment
    scenario = document.scenario
    missing = set(scenario.allowed_verifier_targets) - set(env.verifiers) - set(env.checks)
    if missing:
        raise ConfigurationError(
            f"the environment has no command or check for verifier targets {sorted(missing)}",
            field="environment.verifiers",
        )
    verifier = CommandVerifier(
        {
            target: VerifierCommand(
                argv=spec.argv, timeout_seconds=float(spec.timeout_seconds), network=spec.network
            )
            for target, spec in env.verifiers.items()
        },
        sandbox=sandbox,
    )
    box = toolbox if toolbox is not None else run_toolbox(document)
    files: WorkspaceAdapter | GitWorkspaceAdapter | None
    if env.kind == "tools":
        files = None
        _check_tools_only(document, box)
    elif env.kind == "git":
        files = _git_workspace(
            document,
            run_id=run_id,
            state_dir=state_dir,
            credentials=credentials,
            verifier=verifier,
            clock=clock,
            hook=write_hook,
        )
    else:
        files = WorkspaceAdapter(
            env.workspace_root,
            scenario.allowed_paths,
            verifier=verifier,
            clock=clock,
            hook=write_hook,
            busy_timeout_s=busy_timeout_s,
            git=workspace_is_git(document, recorded),
        )
    calls: Any = (
        HttpAdapter(env.http_base_url, token=http_token) if env.http_base_url is not None else None
    )
    if any(str(name) in box for name in scenario.permissions):
        ledger: Path | CallLedger
        if env.tools_ledger != "store" and isinstance(files, WorkspaceAdapter):
            ledger = files.state_dir / "tools.ledger"
        else:
            if store is None or run_id is None:
                raise ConfigurationError(
                    "the run keeps its tool ledger in the store: the store and the run id "
                    "are needed to build its environment",
                    field="environment.tools_ledger",
                )
            ledger = StoreLedger(store, run_id, create=create_ledger)
        checks = {
            target: ToolCheck(
                tool=c.tool, arguments=c.arguments, expect=c.expect, contains=c.contains
            )
            for target, c in env.checks.items()
        }
        return box.environment(
            scenario,
            ledger=ledger,
            files=files,
            calls=calls,
            clock=clock,
            **({"hook": write_hook} if write_hook is not None else {}),
            **({"checks": checks} if checks else {}),
        )
    if files is None:
        raise ConfigurationError(
            "a tools environment needs a declared tool the scenario permits",
            field="scenario.permissions",
        )
    return files if calls is None else RouterAdapter(files, calls)


#: The built-in kinds that need a folder: a tools environment has none.
_FILE_KINDS = frozenset({"read_file", "write_file", "delete_file"})


def _check_tools_only(document: RunDocument, box: Toolbox) -> None:
    """A tools environment (``kind: tools``): no folder, so no file actions, no HTTP API
    beside it, and every verifier target answered by a check.

    Raises:
        ConfigurationError: the scenario permits a file action, the environment names an
            HTTP API, or a verifier target has no check.
    """
    scenario = document.scenario
    files = sorted(str(p) for p in scenario.permissions if str(p) in _FILE_KINDS)
    if files:
        raise ConfigurationError(
            f"a tools environment has no folder: the scenario may not permit {files[0]}",
            field="scenario.permissions",
        )
    if document.environment.http_base_url is not None:
        raise ConfigurationError(
            "a tools environment has no folder for an HTTP API's ledger: declare the API's "
            "operations as tools",
            field="environment.http_base_url",
        )
    unchecked = sorted(set(scenario.allowed_verifier_targets) - set(document.environment.checks))
    if unchecked:
        raise ConfigurationError(
            f"verifier target {unchecked[0]!r} has no check (environment.checks)",
            field="environment.checks",
        )
    if not any(str(p) in box for p in scenario.permissions):
        raise ConfigurationError(
            "a tools environment needs a declared tool the scenario permits",
            field="scenario.permissions",
        )


def _git_workspace(
    document: RunDocument,
    *,
    run_id: str | None,
    state_dir: Path | None,
    credentials: CredentialMap | None,
    verifier: CommandVerifier,
    clock: Clock | None,
    hook: Callable[[str], None] | None,
) -> GitWorkspaceAdapter:
    """The git workspace of a submitted run (its branch and base fixed in the document).

    Raises:
        ConfigurationError: the document was never submitted (no branch), or the run id
            or this process's state folder is missing; the credential is refused.
    """
    remote = document.environment.remote
    if remote is None or remote.branch is None or not is_commit_id(remote.base):
        raise ConfigurationError(
            "the git environment has no branch or base commit yet (submit makes them)",
            field="environment.remote",
        )
    if run_id is None or state_dir is None:
        raise ConfigurationError(
            "a git environment is built for a run, with this process's state folder",
            field="environment.remote",
        )
    branch = remote_branch(
        document.environment, state_dir=state_dir, credentials=credentials, branch=remote.branch
    )
    return GitWorkspaceAdapter(
        branch,
        base=remote.base,
        run_id=run_id,
        allowed_paths=document.scenario.allowed_paths,
        scratch=cache_folder(state_dir) / "checkouts",
        verifier=verifier,
        clock=clock,
        hook=hook,
    )


def parse_evidence(raw: bytes) -> ApprovalEvidence | ReviewDecision | None:
    """Evidence from an inbox entry, or None if it is neither kind (it is then ignored)."""
    for model in (ApprovalEvidence, ReviewDecision):
        try:
            return model.model_validate_json(raw)
        except ValidationError:
            continue
    return None
