"""The worker's credentials: which secret a run may have sent, and where it may go.

A run document never holds a secret and never chooses one. It names a credential by the
name this process's settings give it (``agent_config.model.credential``,
``environment.mcp.<server>.credential``), and the setting ``RATCHET_CREDENTIALS`` (a JSON
object, :class:`CredentialSpec` per name) says, for each name:

* where its secret comes from: an environment variable of this process
  (``{"env": "OPENAI_API_KEY"}``; never a ``RATCHET_*`` one, which are ratchet's own
  settings) or a file (``{"file": "/run/secrets/openai"}``, an absolute path); and
* the destinations it may be sent to: one or more URL prefixes
  (``"destinations": ["https://api.openai.com/v1"]``), and the stdio MCP servers the
  operator declares (``RATCHET_MCP_SERVERS``, :mod:`ratchet.fleet.mcp_servers`) it may be
  given to in a variable of their environment (``"servers": ["git"]``).

::

    RATCHET_CREDENTIALS='{"openai": {"env": "OPENAI_API_KEY",
                                     "destinations": ["https://api.openai.com/v1"]}}'

The map holds no secret (names of variables and files, and URLs), so it is a setting like
any other: checked when settings load (a bad map stops the process before it connects),
passed to worker processes with the rest, and shown by ``repr`` as names only.

:meth:`CredentialMap.bind` is the one gate: the name must be defined here, and the URL the
document names must be covered by one of its destinations, or a one-line
:class:`~ratchet.errors.ConfigurationError` says which, before anything is read or sent.
A URL is covered when its parsed scheme, host and port (the scheme's default when none is
written) equal the destination's and its path is the destination's path or continues it
after a ``/``: ``https://api.example.com/v1`` covers ``https://api.example.com/v1/chat``
but not ``https://api.example.com/v10``, ``https://api.example.com.evil.org/v1`` or
``https://evil.org/v1``. Strings are never compared as strings, and a URL that two parsers
could read differently is refused rather than judged: characters outside RFC 3986's set
(a backslash, a space, a control or non-ASCII character, which some clients rewrite or
drop), user information (``https://api.example.com@evil.org``), a percent sign in the
host, a fragment, dot segments in the path (``/v1/../admin``) and their encoded forms.

The secret is read when it is used (a rotated file or variable is picked up), must be
one token of visible ASCII (it goes into a header), and is handed out as a ``SecretStr``:
it is in no repr, log line, error message, checkpoint or metric.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Final, Self
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    StrictStr,
    field_validator,
    model_validator,
)

from ratchet.errors import ConfigurationError

__all__ = [
    "CREDENTIAL_NAME",
    "BoundCredential",
    "CredentialMap",
    "CredentialName",
    "CredentialSpec",
    "Target",
    "covers",
    "no_longer_read",
    "parse_target",
]

#: A credential's name in the map: a letter, then letters, digits, ``_``, ``.``, ``-``.
CREDENTIAL_NAME: Final = r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$"
_NAME = re.compile(CREDENTIAL_NAME)
_ENV_NAME: Final = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"
_OWN_PREFIX: Final = "RATCHET_"
# RFC 3986's characters (unreserved, reserved, and % for escapes): anything else is a
# character some URL parser rewrites, strips or splits on differently from another.
_URL_CHARS = re.compile(r"[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=%]{1,2048}")
_ENCODED_SEPARATOR = re.compile(r"%(2e|2f|5c)", re.IGNORECASE)
_DEFAULT_PORTS: Final = {"http": 80, "https": 443}
_SECRET = re.compile(r"[\x21-\x7e]{1,16384}")
_MAX_FILE_BYTES = 64 * 1024


def _is_own(name: str) -> bool:
    return name.upper().startswith(_OWN_PREFIX)


@dataclass(frozen=True, slots=True)
class Target:
    """A URL as compared: scheme, host (lower case), port (explicit or the scheme's
    default) and path (``/`` when empty). Nothing else of the URL takes part."""

    scheme: str
    host: str
    port: int
    path: str

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}{self.path}"


def parse_target(url: str) -> Target:
    """``url`` as a :class:`Target`, or ValueError saying why it is refused (see the
    module docstring; the message never quotes the URL)."""
    if not _URL_CHARS.fullmatch(url):
        raise ValueError(
            "it holds characters outside a URL's (a space, backslash, control or "
            "non-ASCII character), or is empty or longer than 2048"
        )
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise ValueError("it is not a URL with a valid host and port") from None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise ValueError("it is not an http(s) URL")
    if "@" in parts.netloc:
        raise ValueError("it carries user information (user@host)")
    if "%" in parts.netloc:
        raise ValueError("its host is percent-encoded")
    host = parts.hostname
    if not host:
        raise ValueError("it has no host")
    if "#" in url:
        raise ValueError("it has a fragment")
    path = parts.path or "/"
    if any(segment in (".", "..") for segment in path.split("/")):
        raise ValueError("its path has a dot segment")
    if _ENCODED_SEPARATOR.search(path):
        raise ValueError("its path has an encoded dot, slash or backslash")
    return Target(scheme, host, port if port is not None else _DEFAULT_PORTS[scheme], path)


def covers(destination: Target, target: Target) -> bool:
    """Whether ``destination`` (a URL prefix) covers ``target``: same scheme, host and
    port, and a path that is the destination's or continues it after a ``/``."""
    if (destination.scheme, destination.host, destination.port) != (
        target.scheme,
        target.host,
        target.port,
    ):
        return False
    prefix = destination.path.rstrip("/")
    return not prefix or target.path == prefix or target.path.startswith(prefix + "/")


def _destination(url: str) -> Target:
    target = parse_target(url)
    if "?" in url:
        raise ValueError("it has a query (a destination is scheme, host, port and a path)")
    return target


def no_longer_read(field: str, instead: str) -> ConfigurationError:
    """The refusal of a document field that named an environment variable."""
    return ConfigurationError(
        f"{field} is no longer read: name one of the worker's credentials "
        f"(RATCHET_CREDENTIALS) in {instead} instead",
        field=field,
    )


class CredentialSpec(BaseModel):
    """One credential of ``RATCHET_CREDENTIALS``: exactly one source (``env`` or
    ``file``) and the URL prefixes it may be sent to."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    env: Annotated[StrictStr, Field(pattern=_ENV_NAME)] | None = Field(
        default=None, description="an environment variable of this process (not RATCHET_*)"
    )
    file: Path | None = Field(
        default=None, description="an absolute path to a file holding the secret"
    )
    destinations: tuple[Annotated[StrictStr, Field(max_length=2048)], ...] = Field(
        default=(), max_length=64, description="URL prefixes the secret may be sent to"
    )
    servers: tuple[Annotated[StrictStr, Field(pattern=r"^[A-Za-z][A-Za-z0-9_-]{0,31}$")], ...] = (
        Field(
            default=(),
            max_length=64,
            description="stdio MCP servers (RATCHET_MCP_SERVERS) it may be given to, in a "
            "variable of their environment",
        )
    )

    @field_validator("env")
    @classmethod
    def _not_ratchets_own(cls, value: str | None) -> str | None:
        if value is not None and _is_own(value):
            raise ValueError("a credential's source is never a RATCHET_* variable")
        return value

    @field_validator("file")
    @classmethod
    def _absolute(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_absolute():
            raise ValueError("a credential file is an absolute path")
        return value

    @field_validator("destinations")
    @classmethod
    def _urls(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for index, url in enumerate(value):
            try:
                _destination(url)
            except ValueError as exc:
                raise ValueError(f"destination {index} is refused: {exc}") from None
        return value

    @model_validator(mode="after")
    def _one_source(self) -> Self:
        if (self.env is None) == (self.file is None):
            raise ValueError("give exactly one source: env or file")
        if not self.destinations and not self.servers:
            raise ValueError("give at least one destination (or a server it is given to)")
        return self

    def targets(self) -> tuple[Target, ...]:
        return tuple(_destination(url) for url in self.destinations)

    def source(self) -> str:
        """Where the secret comes from, for a message (a name or a path, never a value)."""
        return f"${self.env}" if self.env is not None else f"the file {self.file}"


def _check_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ValueError("a credential name is a letter, then letters, digits, _ . or -")
    if _is_own(name):
        raise ValueError("a credential name never starts with RATCHET_")
    return name


#: A credential name as ``RATCHET_CREDENTIALS`` keys it.
CredentialName = Annotated[str, AfterValidator(_check_name)]


class BoundCredential:
    """A credential checked for one URL; calling it reads the secret (raising
    :class:`~ratchet.errors.ConfigurationError` when its source is unset, empty,
    unreadable or not one token of visible ASCII). Its repr shows the name and where it
    goes, never the secret."""

    __slots__ = ("_spec", "field", "name", "target")

    def __init__(self, name: str, spec: CredentialSpec, target: Target | str, field: str) -> None:
        self.name = name
        self.target = target
        self.field = field
        self._spec = spec

    def __repr__(self) -> str:
        return f"BoundCredential({self.name!r} -> {self.target})"

    def __call__(self) -> SecretStr:
        value = _read(self._spec)
        if value is None or not _SECRET.fullmatch(value):
            raise ConfigurationError(
                f"credential {self.name!r} ({self.field}): {self._spec.source()} is unset, "
                "empty, unreadable or not one token of visible ASCII",
                field=self.field,
            )
        return SecretStr(value)


def _read(spec: CredentialSpec) -> str | None:
    """The secret, stripped of surrounding whitespace; None when it cannot be read."""
    if spec.env is not None:
        value = os.environ.get(spec.env)
        return value.strip() if value is not None else None
    if spec.file is None:
        return None
    try:
        # Non-blocking, so a FIFO put there refuses instead of hanging; links are
        # followed (mounted secrets are often links), the type is checked on what opened.
        fd = os.open(spec.file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.read(fd, _MAX_FILE_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(data) > _MAX_FILE_BYTES:
        return None
    try:
        return data.decode("ascii").strip()
    except UnicodeDecodeError:
        return None


def _shown(name: str) -> str:
    """A name from a document, for a message: quoted when it is a name, else not at all
    (a secret pasted where a name belongs is not echoed)."""
    return repr(name) if _NAME.fullmatch(name) else "a value that is not a credential name"


class CredentialMap:
    """This process's credentials (``RATCHET_CREDENTIALS``): see the module docstring.

    Implements :class:`ratchet.agents.credentials.CredentialResolver`.

    Raises (constructor):
        ConfigurationError: a name that is not a credential name, or starts with
            ``RATCHET_``.
    """

    def __init__(self, specs: Mapping[str, CredentialSpec] | None = None) -> None:
        for name in specs or {}:
            try:
                _check_name(name)
            except ValueError as exc:
                raise ConfigurationError(
                    f"RATCHET_CREDENTIALS: {exc}", field="credentials"
                ) from None
        self._specs = dict(specs or {})

    def __repr__(self) -> str:
        return f"CredentialMap({sorted(self._specs)})"

    def __len__(self) -> int:
        return len(self._specs)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._specs))

    def bind(self, name: str, url: str, *, field: str) -> BoundCredential:
        """The credential ``name``, checked for requests to ``url`` (nothing is read).

        Raises:
            ConfigurationError: one line, ``field=field``: ``name`` is a ``RATCHET_*``
                name, or not defined here; ``url`` is refused, or not covered by any of
                its destinations.
        """
        if _is_own(name):
            raise ConfigurationError(
                f"{field} names {_shown(name)}, one of ratchet's own settings: a task "
                "names a credential the worker's RATCHET_CREDENTIALS defines",
                field=field,
            )
        spec = self._specs.get(name)
        if spec is None:
            known = ", ".join(sorted(self._specs)) or "none"
            raise ConfigurationError(
                f"{field} names {_shown(name)}, which this process's RATCHET_CREDENTIALS "
                f"does not define (defined: {known})",
                field=field,
            )
        try:
            target = parse_target(url)
        except ValueError as exc:
            raise ConfigurationError(
                f"{field}: credential {name!r} is not sent to this URL: {exc}", field=field
            ) from None
        if not any(covers(d, target) for d in spec.targets()):
            raise ConfigurationError(
                f"{field}: credential {name!r} may not be sent to {target}; its "
                f"destinations are {', '.join(spec.destinations)}",
                field=field,
            )
        return BoundCredential(name, spec, target, field)

    def bind_server(self, name: str, server: str, *, field: str) -> BoundCredential:
        """The credential ``name``, checked for stdio MCP server ``server`` (one the
        operator declares in ``RATCHET_MCP_SERVERS``): its ``servers`` must list it.

        Raises:
            ConfigurationError: one line, ``field=field``: not defined here, or not one
                this server may be given.
        """
        spec = self._specs.get(name)
        if spec is None or _is_own(name):
            known = ", ".join(sorted(self._specs)) or "none"
            raise ConfigurationError(
                f"{field} names {_shown(name)}, which this process's RATCHET_CREDENTIALS "
                f"does not define (defined: {known})",
                field=field,
            )
        if server not in spec.servers:
            raise ConfigurationError(
                f"{field}: credential {name!r} may not be given to MCP server {server!r} "
                "(list the server in its servers)",
                field=field,
            )
        return BoundCredential(name, spec, f"MCP server {server}", field)

    def files(self) -> list[Path]:
        """The files secrets are read from (the verifier sandbox masks them)."""
        return [spec.file for spec in self._specs.values() if spec.file is not None]

    def secret_values(self) -> list[str]:
        """Every secret that can be read now (for scrubbing verifier output)."""
        values = (_read(spec) for spec in self._specs.values())
        return [value for value in values if value]
