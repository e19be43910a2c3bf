"""Worker settings, from ``RATCHET_*`` environment variables (pydantic-settings).

Timing rules checked at load: the renew interval is shorter than the lease TTL (default
TTL/3), the stall timeout is longer than the renew interval, and the RQ job timeout is far
longer than any lease, so RQ's own abandoned-job handling never races ratchet's leases.

Keys never live in settings output: the checkpoint key is a ``SecretStr`` and key files
are paths; :meth:`Settings.__repr__` shows neither key material nor the Redis password.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Self

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from ratchet.adapters.sandbox import SandboxMode

__all__ = ["Settings"]

_Ms = Annotated[int, Field(ge=50, le=24 * 3600 * 1000)]


class Settings(BaseSettings):
    """Everything a worker, submitter or operator command needs to find and fence runs."""

    model_config = SettingsConfigDict(env_prefix="RATCHET_", extra="forbid",
                                      validate_default=True)

    redis_url: SecretStr | None = Field(
        default=None, description="Redis primary; unset: a private embedded redis-server")
    state_dir: Path = Field(default=Path(".ratchet"),
                            description="local state: embedded Redis data, generated keys")
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
    # A write's receipt commit travels with the next proposal's commit when the agent
    # plans ahead (see ratchet.worker.agents.Agent); off: every commit goes on its own.
    coalesce_commits: bool = True
    # Checkpoints are stored as zstd frames (the signature covers the envelope inside);
    # reads accept both forms, so this can change at any time.
    compress_checkpoints: bool = True
    # Trace events and receipts go to the run's signed, hash-chained archive beside the
    # checkpoint, so a commit's size and cost do not grow with the run. Runs that already
    # have an archive keep it whatever this says.
    archive_trace: bool = True
    checkpoint_key: SecretStr | None = Field(
        default=None, description="hex key (>= 32 bytes) used as key id 'env'")
    checkpoint_keys_file: Path | None = Field(
        default=None, description='JSON {"signing": kid, "keys": {kid: hex}, "retired": []}')
    approvers_file: Path | None = Field(default=None,
                                        description='JSON {"approver-id": "<public hex>"}')
    reviewers_file: Path | None = Field(default=None,
                                        description='JSON {"reviewer-id": "<public hex>"}')
    worker_name: str | None = Field(default=None, max_length=100)
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
    # The bearer token the worker's HTTP adapter sends with every mutating request (the
    # reference orders service's --token-file); never in a run document.
    http_token: SecretStr | None = None
    # Workers and submit refuse a Redis whose maxmemory-policy is not noeviction; where an
    # ACL forbids reading it (CONFIG GET and INFO), this says it was checked by hand.
    allow_unknown_eviction_policy: bool = False
    # A worker whose wall clock is further than this from Redis' refuses to start.
    max_clock_skew_ms: Annotated[int, Field(ge=50)] = 2000

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
        return self

    @property
    def renew_interval(self) -> int:
        """Milliseconds between renewals: the setting, or a third of the TTL."""
        return self.renew_interval_ms or max(self.lease_ttl_ms // 3, 1)

    @property
    def embedded(self) -> bool:
        return self.redis_url is None

    def __repr__(self) -> str:
        return (f"Settings(redis={'set' if self.redis_url else 'embedded'}, "
                f"queue={self.queue!r}, lease_ttl_ms={self.lease_ttl_ms}, "
                f"renew_interval_ms={self.renew_interval}, "
                f"stall_timeout_ms={self.stall_timeout_ms})")

    __str__ = __repr__
