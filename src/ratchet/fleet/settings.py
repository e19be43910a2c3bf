"""Worker settings, from ``RATCHET_*`` environment variables (pydantic-settings).

Timing rules checked at load: the renew interval is shorter than the lease TTL (default
TTL/3), the stall timeout is longer than the renew interval, and the RQ job timeout is far
longer than any lease, so RQ's own abandoned-job handling never races ratchet's leases.

Keys never live in settings output: the checkpoint key is a ``SecretStr`` and key files
are paths; :meth:`Settings.__repr__` shows neither key material nor the Redis password.

Names: every ``RATCHET_*`` environment variable must be a setting of this model or one of
:data:`OTHER_NAMES` (read elsewhere, each where the list says). Any other is refused when
settings are read from the environment, as a typo (a misspelt ``RATCHET_REDIS_URL`` would
otherwise mean "no Redis URL": the embedded default). The error names the variable and the
closest known name, never its value.
"""

from __future__ import annotations

import difflib
import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Final, Self

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from ratchet.adapters.sandbox import SandboxMode
from ratchet.errors import ConfigurationError
from ratchet.fleet.credentials import CredentialName, CredentialSpec
from ratchet.fleet.mcp_servers import SERVER_NAME, McpServerDeclaration
from ratchet.limits import DEFAULT_MAX_PEER_BYTES, MAX_PEER_BYTES_RANGE

__all__ = [
    "HOST_PATTERN",
    "OTHER_NAMES",
    "PREFIX",
    "Settings",
    "check_environment_names",
    "default_host",
    "setting_names",
]

PREFIX: Final = "RATCHET_"

#: ``RATCHET_*`` names that are not settings of :class:`Settings`, and who reads them.
OTHER_NAMES: Final = frozenset(
    {
        # ratchet.fleet.logs
        "RATCHET_LOG_FORMAT",
        "RATCHET_LOG_LEVEL",
        # ratchet.fleet.metrics
        "RATCHET_METRICS_PORT",
        "RATCHET_METRICS_ADDR",
        # ratchet.fleet.context: RQ's own connection (an ACL user of its own)
        "RATCHET_QUEUE_REDIS_URL",
        # ratchet.redis_server: which redis-server binary to run
        "RATCHET_REDIS_SERVER",
        # ratchet.chaos.failpoints: drills
        "RATCHET_FAILPOINTS",
        "RATCHET_FAILPOINTS_LOG",
        "RATCHET_DRILL_EVENTS",
        # ratchet's own test suite and CI
        "RATCHET_TEST_REDIS_URL",
        "RATCHET_REQUIRE_SANDBOX",
        "RATCHET_REQUIRE_BROWSER",
        "RATCHET_REQUIRE_POSTGRES",
        "RATCHET_SCREENSHOT_DIR",
        "RATCHET_CHROMIUM",
        "RATCHET_CHROMEDRIVER",
        "RATCHET_TEST_API_TOKEN",
        "RATCHET_PROBE_AGENT_MARKER",
        "RATCHET_DRILL_SEEDS",  # tests/chaos/test_drill.py: the seeds of the opt-in run
        "RATCHET_DRILL_HOSTS_SEEDS",  # tests/chaos/test_drill_hosts.py: likewise
    }
)

_Ms = Annotated[int, Field(ge=50, le=24 * 3600 * 1000)]
#: A host's name: what ``RATCHET_HOST`` may be, and what a run document records.
HOST_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"


def default_host() -> str:
    """This machine's host name, as a host name ratchet accepts (anything else made ``-``)."""
    name = socket.gethostname().split(".")[0] or "localhost"
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "-", name)[:63]
    return cleaned if re.match(HOST_PATTERN, cleaned) else f"h{cleaned}"[:63]


class Settings(BaseSettings):
    """Everything a worker, submitter or operator command needs to find and fence runs."""

    model_config = SettingsConfigDict(env_prefix="RATCHET_", extra="forbid", validate_default=True)

    redis_url: SecretStr | None = Field(
        default=None, description="Redis primary; unset: a private embedded redis-server"
    )
    state_dir: Path = Field(
        default=Path(".ratchet"), description="local state: embedded Redis data, generated keys"
    )
    queue: str = Field(default="ratchet", min_length=1, max_length=100)
    lease_ttl_ms: _Ms = 15_000
    renew_interval_ms: _Ms | None = None
    stall_timeout_ms: _Ms = 120_000
    reaper_interval_ms: _Ms = 1_000
    pickup_timeout_ms: _Ms = 60_000  # an enqueued run no worker took by then is re-enqueued
    job_timeout_s: Annotated[int, Field(ge=10)] = 24 * 3600
    max_steps_per_job: Annotated[int, Field(ge=1)] = 10_000
    # A job that fails for a reason other than a lost lease or fence is recorded and
    # retried after a backoff (doubling from job_error_backoff_ms), up to max_job_errors
    # failures of the run; then the run is frozen with the reason visible.
    max_job_errors: Annotated[int, Field(ge=1)] = 3
    job_error_backoff_ms: _Ms = 1000
    # How long a workspace call waits for its journal while another process holds the
    # journal's lock; then the call fails retryable and the job ends retry_later.
    workspace_busy_timeout_ms: _Ms = 30_000
    # Retention (ratchet.ops.retention): the workers purge runs that finished more than
    # retention_s seconds ago (None: never), exporting each into retention_export_dir first
    # when it is set. ratchet purge does the same on demand.
    retention_s: Annotated[int, Field(ge=60)] | None = None
    retention_export_dir: Path | None = None
    # A write's receipt commit travels with the next proposal's commit when the agent
    # plans ahead (see ratchet.agents.Agent); off: every commit goes on its own.
    coalesce_commits: bool = True
    # Checkpoints are stored as zstd frames (the signature covers the envelope inside);
    # reads accept both forms, so this can change at any time.
    compress_checkpoints: bool = True
    # Trace events and receipts go to the run's signed, hash-chained archive beside the
    # checkpoint, so a commit's size and cost do not grow with the run. Runs that already
    # have an archive keep it whatever this says.
    archive_trace: bool = True
    checkpoint_key: SecretStr | None = Field(
        default=None, description="hex key (>= 32 bytes) used as key id 'env'"
    )
    checkpoint_keys_file: Path | None = Field(
        default=None, description='JSON {"signing": kid, "keys": {kid: hex}, "retired": []}'
    )
    approvers_file: Path | None = Field(
        default=None, description='JSON {"approver-id": "<public hex>"}'
    )
    reviewers_file: Path | None = Field(
        default=None, description='JSON {"reviewer-id": "<public hex>"}'
    )
    worker_name: str | None = Field(default=None, max_length=100)
    # The host this process runs on, where its host-local environments live (a workspace
    # is a folder on this machine's disk). A run submitted here records it, signed; its
    # jobs go to this host's queue (<queue>@<host>) and only workers of this host open it.
    # Default: the machine's host name. In Kubernetes set it from the node's name, so a
    # restarted pod on the same node (and disk) is the same host.
    host: str = Field(default_factory=default_host, pattern=HOST_PATTERN)
    # A host none of whose workers has been seen for this long shows as gone: its runs
    # wait for it visibly, and the reaper stops handing them to its queue until it is back.
    host_timeout_ms: _Ms = 30_000
    # Module prefixes dotted-path agents may come from (RATCHET_AGENTS="mypkg,other.pkg");
    # built-in agents and installed ratchet.agents plugins are always allowed.
    agents: Annotated[tuple[str, ...], NoDecode] = ()
    # How verifier commands (agent-written tests) are confined: auto (bubblewrap, else a
    # separate uid when verifier_uid is set, else verifier runs are refused), bwrap, uid,
    # or none (an explicit opt-out, logged at every start). See ratchet.adapters.sandbox.
    verifier_sandbox: SandboxMode = SandboxMode.AUTO
    verifier_uid: Annotated[int, Field(ge=1)] | None = None
    # Extra host paths verifier commands may read (RATCHET_VERIFIER_READ_ONLY="/opt/tools").
    verifier_read_only: Annotated[tuple[Path, ...], NoDecode] = ()
    # Replicated durability (docs/scale.md): a create or commit counts as acknowledged
    # only once WAIT confirms this many replicas received it within the timeout;
    # otherwise ReplicationUnconfirmedError and the job stops. 0: the primary's AOF.
    min_replicas_ack: Annotated[int, Field(ge=0, le=16)] = 0
    replicas_ack_timeout_ms: _Ms = 1000
    # The bearer token the worker's HTTP adapter sends with every mutating request (the
    # reference orders service's --token-file); never in a run document.
    http_token: SecretStr | None = None
    # The credentials a run may name, each with its source and the URL prefixes it may be
    # sent to (ratchet.fleet.credentials; docs/operations.md). A JSON object of names and
    # places, never of secrets: RATCHET_CREDENTIALS='{"openai": {"env": "OPENAI_API_KEY",
    # "destinations": ["https://api.openai.com/v1"]}}'.
    credentials: dict[CredentialName, CredentialSpec] = Field(
        default_factory=dict,
        description='JSON {"name": {"env": VAR | "file": "/abs/path", "destinations": [url]}}',
    )
    # The stdio MCP servers this worker runs for runs that name them
    # (environment.mcp.<name>.server; ratchet.fleet.mcp_servers, docs/mcp.md): a JSON object
    # of names and declarations, the program and its arguments, the credentials it is given
    # and the tools runs may use. Submit checks documents against its own copy.
    mcp_servers: dict[Annotated[str, Field(pattern=SERVER_NAME)], McpServerDeclaration] = Field(
        default_factory=dict,
        description='JSON {"name": {"command": ["/abs/program", ...], "tools": {...}}}',
    )
    # The most bytes one answer of a network peer (an MCP server, a chat model, the HTTP
    # adapter's service) may carry: counted while it streams in, and reading stops past
    # it (ratchet.limits). A read is then refused, a write is an outcome unknown (review).
    max_peer_bytes: Annotated[
        int, Field(ge=MAX_PEER_BYTES_RANGE[0], le=MAX_PEER_BYTES_RANGE[1])
    ] = DEFAULT_MAX_PEER_BYTES
    # Workers and submit refuse a Redis whose maxmemory-policy is not noeviction; where an
    # ACL forbids reading it (CONFIG GET and INFO), this says it was checked by hand.
    allow_unknown_eviction_policy: bool = False
    # A worker whose wall clock is further than this from Redis' refuses to start.
    max_clock_skew_ms: Annotated[int, Field(ge=50)] = 2000
    # ratchet worker replaces a worker process that died after a backoff doubling from
    # this, capped at the next (see ratchet.worker.pool).
    worker_restart_backoff_ms: _Ms = 1000
    worker_restart_backoff_max_ms: _Ms = 60_000

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The names are checked whenever the environment is read, before any value is.
        return (
            init_settings,
            _EnvironmentNames(settings_cls),
            env_settings,
            dotenv_settings,
            file_secret_settings,
        )

    @field_validator("agents", "verifier_read_only", mode="before")
    @classmethod
    def _split_agents(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value

    @model_validator(mode="after")
    def _timing(self) -> Self:
        renew = self.renew_interval
        if renew >= self.lease_ttl_ms:
            raise ValueError("renew_interval_ms must be shorter than lease_ttl_ms")
        if self.stall_timeout_ms <= renew:
            raise ValueError("stall_timeout_ms must be longer than renew_interval_ms")
        if self.job_timeout_s * 1000 <= 4 * self.lease_ttl_ms:
            raise ValueError("job_timeout_s must be far longer than the lease TTL")
        if self.min_replicas_ack and self.replicas_ack_timeout_ms >= self.lease_ttl_ms:
            raise ValueError("replicas_ack_timeout_ms must be shorter than lease_ttl_ms")
        if self.worker_restart_backoff_ms > self.worker_restart_backoff_max_ms:
            raise ValueError(
                "worker_restart_backoff_ms must not exceed worker_restart_backoff_max_ms"
            )
        return self

    @model_validator(mode="after")
    def _credential_files(self) -> Self:
        keys = {
            p.resolve()
            for p in (self.checkpoint_keys_file, self.approvers_file, self.reviewers_file)
            if p is not None
        }
        for spec in self.credentials.values():
            if spec.file is not None and spec.file.resolve() in keys:
                raise ValueError("a credential is never read from a key or trust file")
        for server, declared in self.mcp_servers.items():
            for var, name in declared.env.items():
                found = self.credentials.get(name)
                if found is None or server not in found.servers:
                    raise ValueError(
                        f"mcp_servers.{server}.env.{var} names credential {name!r}, which "
                        f"RATCHET_CREDENTIALS does not define for server {server!r} (servers)"
                    )
        return self

    @property
    def renew_interval(self) -> int:
        """Milliseconds between renewals: the setting, or a third of the TTL."""
        return self.renew_interval_ms or max(self.lease_ttl_ms // 3, 1)

    @property
    def embedded(self) -> bool:
        return self.redis_url is None

    def __repr__(self) -> str:
        return (
            f"Settings(redis={'set' if self.redis_url else 'embedded'}, "
            f"queue={self.queue!r}, lease_ttl_ms={self.lease_ttl_ms}, "
            f"renew_interval_ms={self.renew_interval}, "
            f"stall_timeout_ms={self.stall_timeout_ms})"
        )

    __str__ = __repr__


def setting_names() -> frozenset[str]:
    """The environment variable of every setting of :class:`Settings`."""
    return frozenset(PREFIX + name.upper() for name in Settings.model_fields)


def check_environment_names(environ: Mapping[str, str] | None = None) -> None:
    """Refuse ``RATCHET_*`` variables that are neither settings nor :data:`OTHER_NAMES`.

    Names are compared without regard to case, as the settings themselves are read.
    Raises ConfigurationError naming every unknown variable (``field``: the first) and the
    closest known name of each; values are never read.
    """
    environ = os.environ if environ is None else environ
    known = setting_names() | OTHER_NAMES
    unknown = sorted(
        name for name in environ if name.upper().startswith(PREFIX) and name.upper() not in known
    )
    if not unknown:
        return
    # Compared without the prefix, which every name shares and which would make any two
    # names look alike.
    stems = sorted(name[len(PREFIX) :] for name in known)
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(name.upper()[len(PREFIX) :], stems, n=1, cutoff=0.6)
        parts.append(f"{name} (did you mean {PREFIX}{close[0]}?)" if close else name)
    noun = "variable" if len(unknown) == 1 else "variables"
    raise ConfigurationError(
        f"unknown environment {noun} {', '.join(parts)}; ratchet reads no such name: fix "
        "or unset it",
        field=unknown[0],
    )


class _EnvironmentNames(PydanticBaseSettingsSource):
    """A settings source that contributes nothing and checks the environment's names."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        check_environment_names()
        return {}
