"""How much ratchet takes in from one answer of a network peer (DESIGN.md §9: no unbounded
read of a network answer).

Every client that reads a peer's answer counts its bytes as they arrive and stops reading
once they pass the cap, without reading the rest: an MCP server's (stdio: a line;
streamable HTTP: a response body, JSON or an event stream), a chat model's (a response
body) and the HTTP adapter's service's. Past the cap the call fails with
:class:`~ratchet.errors.PeerAnswerTooLargeError` naming the peer, the cap and the bytes
seen: a read is refused without effect, a write it cut off is an outcome unknown (see
docs/security.md, "Bytes from peers are bounded").

The cap is one number for every peer: an operator reasons about "no single answer costs
this worker more than about N bytes of buffer", whichever peer sends it. It is the
worker's setting ``RATCHET_MAX_PEER_BYTES`` (default :data:`DEFAULT_MAX_PEER_BYTES`);
``Fleet.connect`` applies it to the process (:func:`set_max_peer_bytes`), so clients a
tool package or an agent builds pick it up without being handed the worker's settings.
A client given a cap of its own (``max_answer_bytes=``) keeps that one.
"""

from __future__ import annotations

from typing import Final

from ratchet.errors import ConfigurationError, PeerAnswerTooLargeError

__all__ = [
    "DEFAULT_MAX_PEER_BYTES",
    "MAX_PEER_BYTES_RANGE",
    "AnswerBudget",
    "max_peer_bytes",
    "peer_cap",
    "set_max_peer_bytes",
]

#: The default cap: 4 MiB. What ratchet keeps of an answer is far smaller (a read keeps
#: 1 MiB of canonical JSON, a receipt 64 KiB and a digest), so a legitimate answer is
#: never near it, and a worker's buffer for one answer stays a few MiB.
DEFAULT_MAX_PEER_BYTES: Final = 4 << 20
#: The range a cap may take: from 64 KiB (a chat completion or a tool listing needs
#: tens of KiB) to 1 GiB.
MAX_PEER_BYTES_RANGE: Final = (64 << 10, 1 << 30)

_cap = DEFAULT_MAX_PEER_BYTES


def _checked(limit: int, field: str) -> int:
    low, high = MAX_PEER_BYTES_RANGE
    if isinstance(limit, bool) or not isinstance(limit, int) or not low <= limit <= high:
        raise ConfigurationError(
            f"{field} must be a number of bytes from {low} to {high}", field=field
        )
    return limit


def set_max_peer_bytes(limit: int) -> None:
    """Make ``limit`` this process's cap (``Fleet.connect`` applies the worker's setting).

    Raises:
        ConfigurationError: not within :data:`MAX_PEER_BYTES_RANGE`.
    """
    global _cap  # noqa: PLW0603 - one process-wide setting, applied at start-up
    _cap = _checked(limit, "max_peer_bytes")


def max_peer_bytes() -> int:
    """This process's cap (see the module docstring)."""
    return _cap


def peer_cap(limit: int | None) -> int:
    """``limit`` when given (checked), else this process's cap.

    Raises:
        ConfigurationError: a ``limit`` not within :data:`MAX_PEER_BYTES_RANGE`.
    """
    return _cap if limit is None else _checked(limit, "max_answer_bytes")


class AnswerBudget:
    """The bytes of one answer from ``peer``, counted as they arrive against ``limit``.

    ``peer`` names the peer in the error (no credential: an MCP server's label, a URL's
    scheme, host, port and path). Not thread-safe: one answer is read by one reader.
    """

    __slots__ = ("limit", "peer", "seen")

    def __init__(self, peer: str, limit: int) -> None:
        self.peer = peer
        self.limit = limit
        self.seen = 0

    def __repr__(self) -> str:
        return f"AnswerBudget(peer={self.peer!r}, limit={self.limit}, seen={self.seen})"

    def take(self, size: int) -> None:
        """Count ``size`` more bytes of the answer (call before keeping them).

        Raises:
            PeerAnswerTooLargeError: the answer is now past the cap; stop reading it.
        """
        self.seen += size
        if self.seen > self.limit:
            raise self.refusal()

    def refusal(self, *, encoding: str | None = None) -> PeerAnswerTooLargeError:
        """The error that refuses this answer: past the cap, or (``encoding``) compressed
        although an identity encoding was asked for, which cannot be bounded before it
        is inflated, so it is refused unread."""
        if encoding is not None:
            what = f"was compressed ({encoding}) although it was asked not to be; refused unread"
        else:
            what = f"went past the cap of {self.limit} bytes; reading stopped at {self.seen}"
        return PeerAnswerTooLargeError(
            f"{self.peer}: the answer {what}",
            peer=self.peer,
            limit_bytes=self.limit,
            seen_bytes=self.seen,
            encoding=encoding,
        )
