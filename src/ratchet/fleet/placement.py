"""Where a host-bound run lives now: its signed document's host, or a signed placement.

A run whose workspace is a folder on one host's disk is bound to that host by its signed
run document (``environment.host``). When the host is lost but its disk is not (a volume
moved to another machine, a disk attached elsewhere), an operator on the new machine
proves the environment is the run's own, **the same instance at the version the run
recorded**, observed from that machine's disk, and moves the run there
(``ratchet attach``, :func:`ratchet.ops.hosts.attach`). The move is a
:class:`Placement`: signed with the checkpoint key ring under its own domain
(``ratchet/placement/v1``), bound to the run id and the document's digest, numbered
(``seq``), and kept in the run's own key ``ratchet:{<run>}:placement``. The document
itself is never changed (every checkpoint binds its digest).

Every worker that takes a host-bound run reads it: a placement that verifies names the
run's host; one that does not (a rewritten record) refuses the run, as any record that
does not verify does. So the old host, back with an old copy of the disk, hands the run
on instead of opening it.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, Strict, ValidationError

from ratchet.errors import CheckpointError, ContractError, IntegrityError
from ratchet.fleet.runs import RunDocument, document_digest
from ratchet.fleet.settings import HOST_PATTERN
from ratchet.leasing import RedisStore
from ratchet.runtime.canonical import Domain, canonical_json, strict_json_loads
from ratchet.runtime.signing import KeyRing, open_envelope, seal_envelope
from ratchet.runtime.types import Digest, Frozen, Identifier, NonNegInt, PosInt

__all__ = ["Placement", "home_of", "open_placement", "seal_placement"]

_Host = Annotated[str, Strict(), Field(pattern=HOST_PATTERN)]


class Placement(Frozen):
    """A host-bound run moved to ``host`` (from ``moved_from``), proven there by its
    environment's instance and version, by ``by`` at store time ``at_ms``."""

    run_id: Identifier
    document_digest: Digest
    seq: PosInt
    host: _Host
    moved_from: _Host
    env_instance_id: Identifier
    env_version: NonNegInt
    by: Annotated[str, Strict(), Field(min_length=1, max_length=200)]
    reason: Annotated[str, Strict(), Field(min_length=1, max_length=1000)]
    at_ms: NonNegInt


def seal_placement(keyring: KeyRing, placement: Placement) -> bytes:
    """The stored bytes: an envelope (HMAC under the ring's signing key, placement domain)
    over the placement's canonical JSON."""
    return seal_envelope(
        keyring, canonical_json(placement.model_dump(mode="json")), domain=Domain.PLACEMENT
    )


def open_placement(keyring: KeyRing, run_id: str, document_digest: str, blob: bytes) -> Placement:
    """Verify and parse run ``run_id``'s stored placement: its MAC first, then a strict
    parse, then its bindings (this run, this document).

    Raises:
        IntegrityError: ``reason="placement"``; nothing of it is used.
    """
    try:
        body = open_envelope(keyring, blob, domain=Domain.PLACEMENT)
        placement = Placement.model_validate(strict_json_loads(body))
    except (CheckpointError, ContractError, ValidationError) as exc:
        raise IntegrityError(
            f"the run's placement does not verify ({type(exc).__name__})",
            reason="placement",
            run_id=run_id,
        ) from None
    if placement.run_id != run_id or placement.document_digest != document_digest:
        raise IntegrityError(
            "the run's placement was signed for another run or document",
            reason="placement",
            run_id=run_id,
        )
    return placement


def home_of(
    keyring: KeyRing, store: RedisStore, run_id: str, document: RunDocument
) -> tuple[str | None, Placement | None]:
    """The host run ``run_id`` lives on (None: any host may take it) and the placement
    that moved it there (None: its document's host).

    Raises:
        IntegrityError: a stored placement that does not verify (``reason="placement"``).
        StoreUnavailableError: the store could not be read.
    """
    host = document.environment.host
    if host is None:
        return None, None
    blob = store.hosts.placement(run_id)
    if blob is None:
        return host, None
    placement = open_placement(keyring, run_id, document_digest(document), blob)
    return placement.host, placement
