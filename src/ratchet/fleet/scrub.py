"""Secrets out of text an operator reads: verifier output, before it is kept or shown.

A verifier runs code the agent wrote, so what it prints is untrusted text that may echo
anything it could read. Before a tail of it is stored for operators (and again before it
is displayed) a :class:`Scrubber` replaces:

1. the secrets this process is configured with: every checkpoint key (``RATCHET_
   CHECKPOINT_KEY`` or the keys of the key file), the HTTP API token, the secret of every
   credential of ``RATCHET_CREDENTIALS`` that can be read, the passwords in
   the Redis URLs, and the value of every ``RATCHET_*`` variable whose name says it is a
   secret (``KEY``, ``TOKEN``, ``SECRET``, ``PASSWORD``, ``URL``); hex secrets in either
   case, and a text that ends in the first 8 or more characters of one (output cut in
   the middle of a secret);
2. common token shapes: PEM private key blocks, ``Bearer ...``, GitHub, GitLab, Slack,
   AWS access key ids, ``sk-...`` API keys, JSON web tokens, credentials in URLs, and the
   value in ``password=...`` / ``token: ...`` style assignments.

Each is replaced by ``[redacted]``. Scrubbing is best effort for unknown secrets (a
pattern list cannot know every token format) and exact for configured ones.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from urllib.parse import urlsplit

from ratchet.fleet.credentials import CredentialMap
from ratchet.fleet.settings import PREFIX, Settings

__all__ = ["REDACTED", "Scrubber", "tail"]

REDACTED = "[redacted]"
_MIN_SECRET = 8  # shorter configured values are not treated as secrets (too many hits)
_SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|URL|CREDENTIAL", re.IGNORECASE)
_NOT_SECRET_NAME = re.compile(r"_(FILE|DIR|PATH|PORT|ADDR)$|_KEYS_FILE$", re.IGNORECASE)

_PATTERNS = tuple(
    re.compile(p)
    for p in (
        r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----[\s\S]*?(-----END [A-Z0-9 ]*PRIVATE KEY-----|\Z)",
        r"(?i)\bbearer\s+[A-Za-z0-9._~+/=-]{8,}",
        r"\bgh[pousr]_[A-Za-z0-9]{20,}",
        r"\bgithub_pat_[A-Za-z0-9_]{20,}",
        r"\bglpat-[A-Za-z0-9_-]{20,}",
        r"\bxox[abposr]-[A-Za-z0-9-]{10,}",
        r"\b(AKIA|ASIA)[0-9A-Z]{16}\b",
        r"\bsk[-_](live_|test_|proj-)?[A-Za-z0-9_-]{20,}",
        r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}",
    )
)
# Keeps the name and the separator, replaces the value.
_ASSIGNMENT = re.compile(
    r"(?i)\b([A-Za-z0-9_.-]*(?:password|passwd|secret|token|api[_-]?key|access[_-]?key|"
    r"private[_-]?key|auth)[A-Za-z0-9_.-]*[\"']?\s*[=:]\s*[\"']?)([^\s\"',;]{4,})"
)
_URL_CREDENTIALS = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^\s/:@]*:)([^\s/@]+)(@)")


class Scrubber:
    """Replaces known secret values and token-shaped text (see the module docstring).

    Its repr never shows what it knows.
    """

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        known: set[str] = set()
        for raw in secrets:
            value = raw.strip()
            if len(value) >= _MIN_SECRET:
                known.add(value)
                if re.fullmatch(r"[0-9a-fA-F]+", value):
                    known |= {value.lower(), value.upper()}
        # Longest first, so a secret that contains another is replaced whole.
        self._secrets = tuple(sorted(known, key=len, reverse=True))

    def __repr__(self) -> str:
        return f"Scrubber({len(self._secrets)} known values)"

    @classmethod
    def from_settings(
        cls, settings: Settings, environ: Mapping[str, str] | None = None
    ) -> Scrubber:
        """The secrets ``settings`` and the ``RATCHET_*`` environment hold. A key file that
        cannot be read adds nothing (the key ring's own loading reports that)."""
        env = os.environ if environ is None else environ
        values: list[str] = []
        for secret in (settings.checkpoint_key, settings.http_token, settings.redis_url):
            if secret is not None:
                values.append(secret.get_secret_value())
        values += _key_file_values(settings)
        values += CredentialMap(settings.credentials).secret_values()
        for name, value in env.items():
            if (
                name.startswith(PREFIX)
                and _SECRET_NAME.search(name)
                and not _NOT_SECRET_NAME.search(name)
            ):
                values.append(value)
        values += [p for v in list(values) if (p := _url_password(v))]
        return cls(values)

    def scrub(self, text: str) -> str:
        """``text`` with every known secret and token-shaped part replaced."""
        for secret in self._secrets:
            text = text.replace(secret, REDACTED)
        text = _cut_secret_at_end(text, self._secrets)
        for pattern in _PATTERNS:
            text = pattern.sub(REDACTED, text)
        text = _URL_CREDENTIALS.sub(lambda m: m.group(1) + REDACTED + m.group(3), text)
        return _ASSIGNMENT.sub(lambda m: m.group(1) + REDACTED, text)


def _cut_secret_at_end(text: str, secrets: tuple[str, ...]) -> str:
    for secret in secrets:
        for size in range(min(len(secret) - 1, len(text)), _MIN_SECRET - 1, -1):
            if text.endswith(secret[:size]):
                return text[:-size] + REDACTED
    return text


def _url_password(value: str) -> str | None:
    if "://" not in value:
        return None
    try:
        return urlsplit(value).password
    except ValueError:
        return None


def _key_file_values(settings: Settings) -> list[str]:
    path = settings.checkpoint_keys_file
    if path is None and settings.embedded:
        path = settings.state_dir / "keys" / "checkpoint.json"
    if path is None:
        return []
    try:
        doc = json.loads(Path(path).read_text())
        return [str(v) for v in doc["keys"].values()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


def tail(text: str, *, max_bytes: int = 4096, max_lines: int = 40) -> tuple[str, bool]:
    """The last ``max_lines`` lines of ``text``, at most ``max_bytes`` UTF-8 bytes (cut at
    a character boundary), and whether anything was left out."""
    lines = text.splitlines(keepends=True)
    kept = "".join(lines[-max_lines:])
    cut = len(lines) > max_lines
    data = kept.encode("utf-8")
    if len(data) > max_bytes:
        kept = data[-max_bytes:].decode("utf-8", "ignore")
        cut = True
    return kept, cut
