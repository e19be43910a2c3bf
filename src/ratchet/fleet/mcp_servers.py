"""Stdio MCP servers the operator declares, named by task files, run by workers.

A task file names an MCP server either by address (``environment.mcp.<name>.url``,
streamable HTTP) or by the name of a server the **operator** declares in the worker's
settings (``environment.mcp.<name>.server``). The declaration (``RATCHET_MCP_SERVERS``, a
JSON object of :class:`McpServerDeclaration` by name) says what to run and what runs may
use::

    RATCHET_MCP_SERVERS='{"git": {
        "command": ["/opt/mcp-git/bin/mcp-server-git", "--repository", "/srv/repo"],
        "tools": {"git_status": {"risk": "read_only"},
                  "git_log": {"risk": "read_only"},
                  "git_commit": {"keys": {"carry": "message", "tool": "git_log",
                                          "arguments": {"repo_path": "/srv/repo"}}}}}}'

* **What runs is the operator's.** The program, its arguments, its folder and the
  variables it sees come from the worker's settings only: a document names the server,
  never a command (the worker starts nothing a document spells). Its environment is a
  minimal default (``PATH``, ``HOME`` and the like: never the worker's ``RATCHET_*``
  settings or secrets) plus ``env``: variable name to credential name, each credential one
  of ``RATCHET_CREDENTIALS`` whose ``servers`` list names this server.
* **Only the declared tools exist.** ``tools`` is an allow-list by MCP name; each entry may
  make the tool stricter than the server's annotations (untrusted hints), or looser with
  ``loosen``, add a refusal pattern or a key recipe (:class:`~ratchet.tools.mcp.
  McpDeclaration`). A run's tool is named the task's ``prefix`` + the MCP name.
* **One server per worker.** A worker starts the server on the first job that needs it
  and keeps it for its life, shared by every job and run (``shared_stdio``): probed before
  each job, started again when it died, stopped when the worker stops. A server that
  cannot start or dies while it is asked for its tools fails the job as retryable (the
  run waits and is retried; it is not frozen).
* **Submit starts nothing.** Submit checks the document against its own declaration of
  the server (the same settings as the workers'): the server is declared, every permitted
  tool of it is declared. What the run's first observation binds (signed, in its
  fingerprint) is the declaration of each permitted tool (:func:`declared_contract`), not
  the server's live list, which submit never asks for.
* **The live list is pinned, signed.** The first job that lists the server's tools pins
  their contracts (names, risk, recovery, argument schemas) in the run's tool ledger,
  under an HMAC of the checkpoint key ring (:func:`pin_live_contract`); every later job
  compares the server's live list with the pin. A server whose tools changed under a
  running run (a new version answers with other schemas or hints) is a contradiction of
  the run's contract: a configuration error, and the run stops with that reason until an
  operator acts. A declaration changed under a running run changes the bound fingerprint,
  which is a changed environment (``ratchet rebaseline``).
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictStr,
    field_validator,
    model_validator,
)

from ratchet.adapters.sandbox import Sandbox, SandboxMode
from ratchet.errors import AdapterError, ConfigurationError, IntegrityError
from ratchet.runtime.actions import Risk
from ratchet.runtime.canonical import Domain, digest
from ratchet.runtime.catalog import TOOL_NAME_PATTERN
from ratchet.tools.declare import Tool, ToolCall

if TYPE_CHECKING:
    from ratchet.fleet.credentials import CredentialMap
    from ratchet.leasing import RedisStore
    from ratchet.runtime.signing import KeyRing

__all__ = [
    "SERVER_NAME",
    "DeclaredTool",
    "McpKeyRecipe",
    "McpServerDeclaration",
    "McpToolDeclaration",
    "declared_contract",
    "declared_tools",
    "live_tools",
    "pin_live_contract",
]

#: A declared server's name (what ``environment.mcp.<name>.server`` names).
SERVER_NAME: Final = r"^[A-Za-z][A-Za-z0-9_-]{0,31}$"
_MCP_NAME = r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$"
_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"
_PIN_DOMAIN: Final = b"ratchet/tool-contract-pin/v1"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class McpKeyRecipe(_Frozen):
    """A key recipe (:class:`ratchet.tools.mcp.KeyRecipe`), declared in settings: every
    field of it, or one of the shipped recipes by name (``{"git_trailer": {"repo_path":
    "/srv/repo"}}``, ``{"sql_key_column": {"table": "orders", "column": "ratchet_key"}}``,
    their keyword arguments as :func:`ratchet.tools.mcp.recipes.git_trailer` and
    :func:`~ratchet.tools.mcp.recipes.sql_key_column` take them)."""

    carry: Annotated[StrictStr, Field(min_length=1, max_length=128)] | None = None
    tool: Annotated[StrictStr, Field(pattern=_MCP_NAME)] | None = None
    arguments: dict[StrictStr, Any] = Field(default_factory=dict)
    placeholder: Annotated[StrictStr, Field(min_length=1, max_length=64)] | None = None
    quote: Literal["text", "sql"] = "text"
    intent_placeholder: Annotated[StrictStr, Field(min_length=1, max_length=64)] | None = None
    absent: Annotated[StrictStr, Field(min_length=1, max_length=512)] | None = None
    git_trailer: dict[StrictStr, Any] | None = None
    sql_key_column: dict[StrictStr, Any] | None = None

    @model_validator(mode="after")
    def _one_form(self) -> McpKeyRecipe:
        named = [n for n in ("git_trailer", "sql_key_column") if getattr(self, n) is not None]
        raw = self.carry is not None or self.tool is not None
        if len(named) + raw != 1:
            raise ValueError(
                "a key recipe is carry and tool (and the rest), or one of git_trailer "
                "and sql_key_column"
            )
        if raw and (self.carry is None or self.tool is None):
            raise ValueError("a key recipe names both carry and tool")
        try:  # refused when settings load, not at a job: made as a worker would make it
            self.made()
        except ImportError:  # no mcp extra here: a worker that runs it checks it
            pass
        except ConfigurationError as exc:
            raise ValueError(exc.message) from None
        return self

    def made(self) -> Any:
        """The recipe as :mod:`ratchet.tools.mcp` takes it.

        Raises:
            ConfigurationError: a named recipe's arguments are refused by it.
        """
        from ratchet.tools.mcp import recipes  # noqa: PLC0415 - optional extra

        for name in ("git_trailer", "sql_key_column"):
            given = getattr(self, name)
            if given is not None:
                try:
                    return getattr(recipes, name)(**given)
                except TypeError as exc:
                    raise ConfigurationError(
                        f"key recipe {name}: {exc}", field="RATCHET_MCP_SERVERS"
                    ) from None
        return recipes.KeyRecipe(
            carry=str(self.carry),
            tool=str(self.tool),
            arguments=dict(self.arguments),
            placeholder=self.placeholder,
            quote=self.quote,
            intent_placeholder=self.intent_placeholder,
            absent=self.absent,
        )


class McpToolDeclaration(_Frozen):
    """What the operator says of one tool of a declared server (all optional): see
    :class:`ratchet.tools.mcp.McpDeclaration`."""

    risk: Literal["read_only", "reversible_write", "irreversible_external_write"] | None = None
    idempotent: StrictBool | None = None
    refusal: Annotated[StrictStr, Field(min_length=1, max_length=512)] | None = None
    keys: McpKeyRecipe | None = None

    @field_validator("refusal")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"refusal is not a regular expression: {exc}") from None
        return value


class McpServerDeclaration(_Frozen):
    """One stdio MCP server of ``RATCHET_MCP_SERVERS`` (see the module docstring)."""

    command: tuple[Annotated[StrictStr, Field(min_length=1, max_length=4096)], ...] = Field(
        min_length=1, max_length=256, description="the program (absolute path) and arguments"
    )
    cwd: Path | None = Field(default=None, description="the folder it starts in (absolute)")
    env: dict[Annotated[StrictStr, Field(pattern=_ENV_NAME)], StrictStr] = Field(
        default_factory=dict,
        description="variable name -> credential name (RATCHET_CREDENTIALS) it is given",
    )
    protocol: Literal["auto", "legacy"] = "auto"
    loosen: StrictBool = False
    sandbox: StrictBool = Field(
        default=False,
        description="run it under the worker's verifier sandbox (bubblewrap): for a server "
        "that runs agent-supplied code",
    )
    network: StrictBool = Field(default=False, description="a sandboxed server's network")
    tools: dict[Annotated[StrictStr, Field(pattern=_MCP_NAME)], McpToolDeclaration] = Field(
        min_length=1, description="the server's tools runs may use, by MCP name"
    )

    @field_validator("command")
    @classmethod
    def _absolute_program(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        # No PATH lookup: which program runs is what the setting says, on every host.
        if not Path(value[0]).is_absolute():
            raise ValueError("command[0] is an absolute path to the server's program")
        return value

    @field_validator("cwd")
    @classmethod
    def _absolute_cwd(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_absolute():
            raise ValueError("cwd is an absolute path")
        return value

    @field_validator("env")
    @classmethod
    def _not_ratchets_own(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if name.upper().startswith("RATCHET_"):
                raise ValueError(f"env may not set {name}: RATCHET_* are ratchet's own")
        return value


def _declaration(
    servers: Mapping[str, McpServerDeclaration], server: str, field: str
) -> McpServerDeclaration:
    found = servers.get(server)
    if found is None:
        known = ", ".join(sorted(servers)) or "none"
        raise ConfigurationError(
            f"{field} names MCP server {server!r}, which this process's RATCHET_MCP_SERVERS "
            f"does not declare (declared: {known})",
            field=field,
        )
    return found


def _tool_name(prefix: str, mcp_name: str) -> str:
    name = re.sub(r"[^A-Za-z0-9_-]", "_", prefix + mcp_name)
    if not re.match(TOOL_NAME_PATTERN, name):
        raise ConfigurationError(
            f"MCP tool {mcp_name!r} cannot be named {name!r} here (a tool name must match "
            f"{TOOL_NAME_PATTERN})",
            field="tools",
            tool=mcp_name,
        )
    return name


def _permitted(
    declaration: McpServerDeclaration, prefix: str, permitted: list[str]
) -> dict[str, str]:
    """The run's tool names of this server that the scenario permits -> their MCP names."""
    by_name = {_tool_name(prefix, mcp): mcp for mcp in declaration.tools}
    return {name: by_name[name] for name in permitted if name in by_name}


def declared_contract(
    server: str, declaration: McpServerDeclaration, mcp_name: str
) -> dict[str, Any]:
    """What a run binds of one tool of a declared server: the server's name, the tool's
    MCP name and the operator's declaration of it (not the program that runs it, which
    may live at another path on another host)."""
    return {
        "mcp_server": server,
        "mcp_tool": mcp_name,
        "loosen": declaration.loosen,
        "declared": declaration.tools[mcp_name].model_dump(mode="json", exclude_none=True),
    }


class DeclaredTool(Tool):
    """A declared server's tool as submit and operator commands know it, without the
    server: its contract is the declaration (:attr:`bound_contract`, what the run's
    fingerprint binds); it cannot be called (a worker calls the live tool)."""

    class Args(BaseModel):
        model_config = ConfigDict(extra="allow")

    def __init__(self, name: str, bound: dict[str, Any], risk: str | None) -> None:
        self.name = name  # type: ignore[misc]  # instance values of the class form's fields
        self.risk = risk or Risk.IRREVERSIBLE_EXTERNAL_WRITE  # type: ignore[misc]
        self.description = f"MCP tool {bound['mcp_tool']} of server {bound['mcp_server']}"  # type: ignore[misc]
        self.bound_contract = bound

    def run(self, args: Any, call: ToolCall) -> Any:
        raise AdapterError(
            f"tool {self.name} is known here by its declaration only: a worker calls it",
            retryable=False,
            tool=self.name,
        )


def declared_tools(
    server: str,
    *,
    prefix: str,
    permitted: list[str],
    servers: Mapping[str, McpServerDeclaration],
    field: str,
) -> list[Tool]:
    """The permitted tools of declared server ``server``, by their declarations only
    (nothing is started: what submit and operator commands use).

    Raises:
        ConfigurationError: the server is not declared here.
    """
    declaration = _declaration(servers, server, f"{field}.server")
    made: list[Tool] = []
    for name, mcp in _permitted(declaration, prefix, permitted).items():
        made.append(
            DeclaredTool(
                name, declared_contract(server, declaration, mcp), declaration.tools[mcp].risk
            )
        )
    return made


def live_tools(
    server: str,
    *,
    prefix: str,
    permitted: list[str],
    servers: Mapping[str, McpServerDeclaration],
    credentials: CredentialMap,
    field: str,
    sandbox: Sandbox | None = None,
    scratch: Path | None = None,
) -> list[Tool]:
    """The permitted tools of declared server ``server``, from its live server: this
    worker's shared connection to it (started if none lives), each tool carrying its
    declaration as the contract the run binds (``bound_contract``). A server declared
    ``sandbox`` runs under ``sandbox`` (the worker's verifier sandbox), writing only its
    folder under ``scratch``.

    Raises:
        ConfigurationError: the server is not declared here, the ``mcp`` extra is missing,
            a credential it is given is refused, the server does not list a declared tool.
        AdapterError: the server could not be started or listed (retryable=True).
    """
    declaration = _declaration(servers, server, f"{field}.server")
    wanted = _permitted(declaration, prefix, permitted)
    if not wanted:
        return []
    env = {
        var: credentials.bind_server(
            cred, server, field=f"RATCHET_MCP_SERVERS.{server}.env.{var}"
        )().get_secret_value()
        for var, cred in sorted(declaration.env.items())
    }
    try:
        from ratchet.tools.mcp import (  # noqa: PLC0415 - optional extra
            McpDeclaration,
            mcp_tools,
            shared_stdio,
        )
    except ImportError:
        raise ConfigurationError(
            f"the run names MCP server {server!r}: install ratchet[mcp]", field=field
        ) from None
    declare = {
        mcp: McpDeclaration(
            risk=Risk(d.risk) if d.risk is not None else None,
            idempotent=d.idempotent,
            refusal=d.refusal,
            keys=d.keys.made() if d.keys is not None else None,
        )
        for mcp, d in declaration.tools.items()
        if mcp in wanted.values()
    }
    argv: list[str] = list(declaration.command)
    cwd = declaration.cwd
    if declaration.sandbox:
        argv, env = _confined(server, declaration, argv, env, sandbox, scratch)
        cwd = None  # bwrap changes into the scratch folder itself
    connection = shared_stdio(argv, env=env, cwd=cwd, protocol=declaration.protocol)
    listed = mcp_tools(
        connection,
        prefix=prefix,
        include=sorted(wanted.values()),
        declare=declare,
        loosen=declaration.loosen,
    )
    for made in listed:
        made.bound_contract = declared_contract(server, declaration, wanted[made.spec.name])  # type: ignore[attr-defined]
    return listed


def _confined(
    server: str,
    declaration: McpServerDeclaration,
    argv: list[str],
    env: dict[str, str],
    sandbox: Sandbox | None,
    scratch: Path | None,
) -> tuple[list[str], dict[str, str]]:
    """The command and environment that start a ``sandbox`` server under bubblewrap: no
    network unless declared, the system read-only, its program's prefix read-only, its
    own folder (``scratch/<server>``) the only place it writes besides a fresh ``/tmp``.
    Its credentials stay in its environment, never in the command line.

    Raises:
        ConfigurationError: no usable sandbox, or one that is not bubblewrap (a separate
            uid cannot start a stdio server here).
    """
    field = f"RATCHET_MCP_SERVERS.{server}.sandbox"
    if sandbox is None or scratch is None:
        raise ConfigurationError(
            f"MCP server {server!r} is declared sandboxed and no sandbox is given", field=field
        )
    sandbox.check_usable()
    if sandbox.mode is SandboxMode.NONE:
        return argv, env  # the operator's opt-out (RATCHET_VERIFIER_SANDBOX=none), logged
    if sandbox.mode is not SandboxMode.BWRAP:
        raise ConfigurationError(
            f"MCP server {server!r} is declared sandboxed: that needs bubblewrap "
            f"(the worker's sandbox is {sandbox.mode.value})",
            field=field,
        )
    home = scratch / "mcp" / server
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    base = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8"}
    wrapped, kept, _ = sandbox.command(
        argv,
        cwd=home,
        env=base | env,
        workspace=home,
        state_dir=home / ".ratchet",
        writable=[],
        network=declaration.network,
        workspace_writable=True,
        inherit_env=True,
    )
    return wrapped, kept


def live_digest(tools: list[Tool]) -> str:
    """The digest of the live contracts of ``tools`` (what :func:`pin_live_contract`
    pins)."""
    return digest(Domain.TOOL, {t.spec.name: t.spec.contract for t in tools})


def _mac(keyring: KeyRing, kid: str, run_id: str, instance: str, value: str) -> str:
    payload = f"{run_id}\x00{instance}\x00{value}".encode()
    return keyring.mac(kid, payload, _PIN_DOMAIN).hex()


def pin_live_contract(
    store: RedisStore, run_id: str, keyring: KeyRing, tools: list[Tool], *, pin: bool = True
) -> None:
    """Compare the live contracts of a run's declared-server ``tools`` with the run's pin
    (made now from these when the run has none and ``pin``; an operator command only
    compares).

    Raises:
        ConfigurationError: the live contracts contradict the pin (the run's tools
            changed under it).
        IntegrityError: the pin is not signed by a key of the ring (it was written by hand
            or by another fleet).
        AdapterError: the run's tool ledger is missing.
        StoreUnavailableError: the store could not be reached.
    """
    if not tools:
        return
    value = live_digest(tools)
    meta = store.ledger.meta(run_id)
    if meta is None:
        raise AdapterError(
            "the run's tool ledger is missing from the store",
            retryable=False,
            reason="ledger_missing",
            run_id=run_id,
        )
    kid = keyring.signing_kid
    signed = f"{kid}:{_mac(keyring, kid, run_id, meta.instance_id, value)}:{value}"
    found = store.ledger.pin_contract(run_id, signed) if pin else meta.contract
    if found is None:  # not pinned yet, and not asked to pin
        return
    found_kid, _, rest = found.partition(":")
    found_mac, _, found_value = rest.partition(":")
    try:
        expected = _mac(keyring, found_kid, run_id, meta.instance_id, found_value)
    except Exception:  # an unknown or retired key id: not ours to trust
        expected = ""
    if not expected or not hmac.compare_digest(expected, found_mac):
        raise IntegrityError(
            "the run's pinned tool contract is not signed by this fleet's keys",
            run_id=run_id,
            reason="tool_contract_pin",
        )
    if found_value != value:
        names = ", ".join(sorted(t.spec.name for t in tools))
        raise ConfigurationError(
            f"the MCP server's tools ({names}) no longer match the contract the run pinned "
            "when it first listed them (the server changed under the run)",
            field="environment.mcp",
            run_id=run_id,
        )
