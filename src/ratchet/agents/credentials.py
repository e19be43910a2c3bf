"""The credential port: how an agent gets a secret it may send, and never chooses it.

A run's agent configuration names a credential only by the name the worker's settings
give it (``agent_config.model.credential: openai``), never an environment variable or a
file. The process that builds the agent (a worker, or ``ratchet submit``) hands the
factory a :class:`CredentialResolver`: its own map of names to secrets and to the URLs
each may be sent to (``RATCHET_CREDENTIALS``, :mod:`ratchet.fleet.credentials`).
:meth:`CredentialResolver.bind` refuses a name it does not define, or a URL the
credential's destinations do not cover, before anything is sent; what it returns reads the
secret when a request is made.

:func:`credential_uses` lists what a run's (built-in) agent would send, and where, from
its configuration alone, so a worker can refuse a run at job start, and ``submit`` before
the run exists, without building anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import SecretStr

__all__ = ["CredentialResolver", "CredentialUse", "credential_uses"]


@dataclass(frozen=True, slots=True)
class CredentialUse:
    """One credential a configuration names: ``field`` is where (``agent_config.model.
    credential``), ``name`` the credential's name, ``url`` where it would be sent."""

    field: str
    name: str
    url: str


class CredentialResolver(Protocol):
    """A process's own credentials (see the module docstring)."""

    def bind(self, name: str, url: str, *, field: str) -> Callable[[], SecretStr]:
        """The credential ``name`` for requests to ``url``: a callable that reads its
        secret (at each call, so a rotated secret is picked up).

        Raises:
            ConfigurationError: one line, ``field=field``: a ``RATCHET_*`` name, a name
                this process does not define, a URL its destinations do not cover.
        """
        ...


def credential_uses(agent: str, config: dict[str, Any]) -> list[CredentialUse]:
    """The credentials agent ``agent`` would send with ``config``, and where. Only the
    built-in ``tool_calling`` agent is handed credentials; a plugin's factory gets its
    configuration alone, so it uses none of the worker's.

    Raises:
        ConfigurationError: the configuration is refused (one line, naming the field),
            e.g. it still names an environment variable (``api_key_env``).
    """
    if agent != "tool_calling":
        return []
    # Here, not at the top: tool_calling imports this module.
    from ratchet.agents.tool_calling import ToolCallingConfig  # noqa: PLC0415

    return ToolCallingConfig.parse(config).credential_uses()
