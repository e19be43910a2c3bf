"""Worker identities: one lease owner id per process incarnation.

A lease names its owner, and the acquire script lets the same owner id take its own live
lease again (a job of that process that was handed the run once more). Names such as
``hostname-pid`` repeat: containers share pid namespaces' low numbers, and several
processes may be configured with one ``RATCHET_WORKER_NAME``. Two live processes with one
id would be one owner to the store, and one could take the other's live lease mid-run.
So every process incarnation adds a random suffix drawn when it starts (and drawn again
in a forked child): ``<name>-<incarnation>-<pid>``. The pid stays last, so tools that read
it from the owner id (``rsplit("-", 1)``) keep working.
"""

from __future__ import annotations

import os
import secrets
import socket

__all__ = ["incarnation", "owner_id"]

_INCARNATION = secrets.token_hex(6)


def _new_incarnation() -> None:
    global _INCARNATION  # noqa: PLW0603 - one value per process, renewed after fork
    _INCARNATION = secrets.token_hex(6)


os.register_at_fork(after_in_child=_new_incarnation)


def incarnation() -> str:
    """This process incarnation's random suffix (12 hex characters)."""
    return _INCARNATION


def owner_id(worker_name: str | None = None) -> str:
    """The lease owner id of this process: ``<name>-<incarnation>-<pid>``, where the name
    is ``worker_name`` or the short host name."""
    base = worker_name or socket.gethostname().split(".")[0] or "worker"
    return f"{base}-{_INCARNATION}-{os.getpid()}"
