"""What a worker builds from a verified run document: the credentials it may send, the
run's git branch, its toolbox (declared tools and MCP servers) and its adapter.

Everything here runs only after :func:`ratchet.fleet.runs.open_document` verified the
document and the job checked that the checkpoint binds it: nothing is built, contacted or
run from a document that did not verify.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ratchet.adapters.gitremote import (
    BranchMoved,
    PushUnknown,
    RemoteBranch,
    cache_folder,
    is_commit_id,
)
from ratchet.adapters.gitworkspace import GitWorkspaceAdapter
from ratchet.adapters.http import HttpAdapter
from ratchet.adapters.journal import BUSY_TIMEOUT_SECONDS
from ratchet.adapters.router import RouterAdapter
from ratchet.adapters.sandbox import Sandbox
from ratchet.adapters.verifier import CommandVerifier, VerifierCommand
from ratchet.adapters.workspace import WorkspaceAdapter
from ratchet.agents.credentials import credential_uses
from ratchet.errors import ConfigurationError
from ratchet.fleet.credentials import BoundCredential, CredentialMap, no_longer_read
from ratchet.fleet.mcp_servers import McpServerDeclaration, declared_tools, live_tools
from ratchet.fleet.runs import EnvironmentSpec, McpServerSpec, RunDocument, workspace_is_git
from ratchet.leasing import RedisStore
from ratchet.runtime import (
    Adapter,
    Clock,
    Observation,
)
from ratchet.runtime.catalog import BUILTIN_TOOLS
from ratchet.tools import Tool, Toolbox
from ratchet.tools.adapter import ToolCheck
from ratchet.tools.ledger import CallLedger
from ratchet.tools.store_ledger import StoreLedger

__all__ = [
    "build_adapter",
    "check_credentials",
    "make_run_branch",
    "remote_branch",
    "run_toolbox",
]


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
