"""Key management: the checkpoint key file, re-signing run documents, finding the runs a
key still signs. The command line's ``ratchet keys rotate | retire | revoke | list`` are
wiring over these (see :mod:`ratchet.cli.keys` for the rotation protocol).

Key material is never returned for display: :func:`key_file_summary` names paths and
key ids only.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

from ratchet.errors import ConfigurationError, RatchetError
from ratchet.fleet.context import Fleet
from ratchet.fleet.runs import open_document, seal_document
from ratchet.fleet.settings import Settings
from ratchet.runtime import KeyRing
from ratchet.runtime.signing import parse_envelope

__all__ = [
    "checkpoint_keys_path",
    "key_file_summary",
    "read_checkpoint_keys",
    "replace_file",
    "resign_documents",
    "runs_signed_with",
    "write_checkpoint_keys",
]


def checkpoint_keys_path(settings: Settings) -> Path:
    """The checkpoint key file in use. Raises ConfigurationError if keys come from the
    environment (rotate by moving to a key file) or none is configured."""
    if settings.checkpoint_key is not None:
        raise ConfigurationError(
            "the checkpoint key comes from RATCHET_CHECKPOINT_KEY; "
            "move to RATCHET_CHECKPOINT_KEYS_FILE to rotate",
            field="checkpoint_key",
        )
    if settings.checkpoint_keys_file is not None:
        return settings.checkpoint_keys_file
    if settings.embedded:
        return settings.state_dir / "keys" / "checkpoint.json"
    raise ConfigurationError("no checkpoint key file configured", field="checkpoint_keys_file")


def read_checkpoint_keys(path: Path) -> dict[str, Any]:
    """A checkpoint key file, checked by building its key ring. Raises ConfigurationError
    (never with key material in the message)."""
    try:
        doc = json.loads(path.read_text())
        keys = {str(k): bytes.fromhex(str(v)) for k, v in doc["keys"].items()}
        KeyRing.from_secrets(
            keys, signing_kid=str(doc["signing"]), retired=[str(k) for k in doc.get("retired", [])]
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise ConfigurationError(
            f"{path} is not a readable checkpoint key file", field="checkpoint_keys_file"
        ) from None
    doc.setdefault("retired", [])
    return dict(doc)


def replace_file(path: Path, data: bytes, *, mode: int) -> None:
    """Replace ``path`` atomically (temporary file, fsync, rename, fsync of the folder)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as out:
            os.fchmod(out.fileno(), mode)
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def runs_signed_with(fleet: Fleet, kid: str, *, limit: int = 100_000) -> list[str]:
    """Runs whose current checkpoint (at the high-water mark) names key id ``kid``.

    Reads only the envelope header. Raises StoreError when Redis cannot be read.
    """
    found = []
    for run_id in fleet.store.run_ids(limit=limit):
        snap = fleet.store.read_run(run_id, with_checkpoint=True)
        if snap.checkpoint is None:
            continue
        try:
            header, _ = parse_envelope(snap.checkpoint)
        except RatchetError:
            continue
        if header.kid == kid:
            found.append(run_id)
    return found


def resign_documents(
    fleet: Fleet, kid: str, *, limit: int = 100_000
) -> tuple[list[str], list[str]]:
    """Sign again, with the ring's signing key, every run document signed with ``kid``.

    A document is written once, at submit, so retiring the key that signed it would make
    the run unreadable. Each one is verified under ``kid`` first (a document that does
    not verify is left alone and reported), re-sealed from the very same document, and
    swapped in by compare-and-set. Returns (re-signed, left alone). Raises StoreError.
    """
    resigned, refused = [], []
    for run_id in fleet.store.run_ids(limit=limit):
        snap = fleet.store.read_run(run_id, with_checkpoint=False, with_scenario=True)
        blob = snap.scenario
        if blob is None:
            continue
        try:
            header, _ = parse_envelope(blob)
        except RatchetError:
            refused.append(run_id)
            continue
        if header.kid != kid:
            continue
        try:
            document = open_document(fleet.keyring, run_id, blob)
        except RatchetError:
            refused.append(run_id)
            continue
        if fleet.store.records.replace_document(
            run_id, blob, seal_document(fleet.keyring, run_id, document)
        ):
            resigned.append(run_id)
        else:
            refused.append(run_id)
    return resigned, refused


def write_checkpoint_keys(path: Path, doc: dict[str, Any]) -> None:
    """Write a checkpoint key file atomically, readable by its owner only."""
    replace_file(path, json.dumps(doc).encode(), mode=0o600)


def key_file_summary(path: Path, doc: dict[str, Any]) -> dict[str, Any]:
    """What may be shown of a key file: its path and key ids, never key material."""
    return {
        "path": str(path),
        "signing": doc["signing"],
        "kids": sorted(doc["keys"]),
        "retired": sorted(doc["retired"]),
    }
