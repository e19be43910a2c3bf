"""Reading a signer's private key for `approve` and `review`.

The key is read as late as possible and as little as possible: from stdin with
``--key -`` (no path on any command line), else from a regular file opened without
blocking (a FIFO is refused, never waited on), at most 64 KiB. A command that observes
the environment first takes a loader (:func:`key_loader`) and calls it only once the
observation is over, so no process the observation started is alive while the key is
in memory.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Callable
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ratchet.errors import ConfigurationError
from ratchet.ops import load_private_key

__all__ = ["key_loader", "read_key_file", "signer", "signer_id"]

_MAX_KEY_FILE_BYTES = 64 * 1024


def read_key_file(key_file: Path) -> bytes:
    """A private key's PEM: from stdin for ``-`` (no path on any command line), else a
    regular file opened without blocking (a FIFO is refused, not waited on), bounded.

    Raises:
        ConfigurationError: unreadable, not a regular file, or larger than 64 KiB.
    """
    if str(key_file) == "-":
        data = sys.stdin.buffer.read(_MAX_KEY_FILE_BYTES + 1)
    else:
        try:
            fd = os.open(key_file, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        except OSError as exc:
            raise ConfigurationError(f"cannot read {key_file}: {exc.strerror or exc}") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ConfigurationError(f"{key_file} is not a regular file", field="key")
            data = os.read(fd, _MAX_KEY_FILE_BYTES + 1)
        finally:
            os.close(fd)
    if len(data) > _MAX_KEY_FILE_BYTES:
        raise ConfigurationError(f"{key_file} is too large for a key file", field="key")
    return data


def signer_id(key_file: Path, given: str | None, role: str) -> str:
    """The signer's id: given, else from a ``ROLE-ID.pem`` file name."""
    if given is not None:
        return given
    if str(key_file) == "-":
        raise ConfigurationError("--id is required when the key is read from stdin", field="id")
    stem = key_file.stem
    return stem.split("-", 1)[1] if stem.startswith(f"{role}-") else stem


def signer(key_file: Path, given: str | None, role: str) -> tuple[Ed25519PrivateKey, str]:
    """The key (read now) and the signer's id."""
    return load_private_key(read_key_file(key_file)), signer_id(key_file, given, role)


def key_loader(key_file: Path) -> Callable[[], Ed25519PrivateKey]:
    """Load the key when called: a command that observes the environment calls it only
    after the observation is over (no process it started is alive while the key is
    loaded). The file is checked for access first, so a wrong path fails before any work."""
    if str(key_file) != "-" and not os.access(key_file, os.R_OK):
        raise ConfigurationError(f"cannot read {key_file}", field="key")
    return lambda: load_private_key(read_key_file(key_file))
