"""Key rotation commands: ``ratchet keys rotate | retire | revoke | list``.

Checkpoint keys (HMAC, a key file ``{"signing", "keys", "retired"}``):

1. ``rotate`` adds a fresh key and makes it the signing key. Older keys keep verifying,
   so runs restore across the rotation and re-sign with the new key at their next commit.
   Restart the workers (rolling) so each picks the new file up.
2. ``retire KID`` marks an old key retired: checkpoints signed with it are refused
   (``retired_kid``). Run documents are signed once, at submit, so it first signs every
   document signed with ``KID`` again with the signing key (each verified under ``KID``
   first, swapped in by compare-and-set; one that does not verify stops the retirement).
   It refuses while any run's current checkpoint is still signed with that key, unless
   ``--force`` (those runs then fail closed, visibly).

Approver and reviewer keys (Ed25519 public keys, a trust file per role): ``revoke`` lists
a signer under ``"_revoked"``; workers refuse that signer's approvals and decisions
(``revoked_signer``) and the run stays waiting. The public key stays in the file.

Key material is never printed: only key ids, paths and counts.
"""

from __future__ import annotations

import json
import os
import secrets
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from ratchet.cli.common import JsonFlag, keys_app, print_json, ratchet_errors
from ratchet.errors import ConfigurationError, RatchetError
from ratchet.runtime import KeyRing
from ratchet.runtime.signing import parse_envelope
from ratchet.worker.context import Fleet, load_trust_roots
from ratchet.worker.runs import open_document, seal_document
from ratchet.worker.settings import Settings

__all__ = ["checkpoint_keys_path", "read_checkpoint_keys", "replace_file", "runs_signed_with"]

FileOption = Annotated[
    Path | None, typer.Option("--file", help="The key file (default: from RATCHET_* settings).")
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
        if fleet.store.replace_document(
            run_id, blob, seal_document(fleet.keyring, run_id, document)
        ):
            resigned.append(run_id)
        else:
            refused.append(run_id)
    return resigned, refused


def _some(run_ids: list[str]) -> str:
    """The first few run ids, for a one-line error."""
    return ", ".join(run_ids[:5]) + (" ..." if len(run_ids) > 5 else "")


def _write_checkpoint_keys(path: Path, doc: dict[str, Any]) -> None:
    replace_file(path, json.dumps(doc).encode(), mode=0o600)


def _summary(path: Path, doc: dict[str, Any]) -> dict[str, Any]:
    return {
        "path": str(path),
        "signing": doc["signing"],
        "kids": sorted(doc["keys"]),
        "retired": sorted(doc["retired"]),
    }


@keys_app.command("rotate")
@ratchet_errors
def keys_rotate(file: FileOption = None, as_json: JsonFlag = False) -> None:
    """Add a fresh checkpoint key that signs from now on; older keys keep verifying.

    Then restart the workers (rolling) so each loads the new signing key.
    """
    path = file or checkpoint_keys_path(Settings())
    doc = read_checkpoint_keys(path)
    previous = doc["signing"]
    kid = f"k-{secrets.token_hex(4)}"
    doc["keys"][kid] = secrets.token_hex(32)
    doc["signing"] = kid
    _write_checkpoint_keys(path, doc)
    info = {**_summary(path, doc), "previous": previous}
    if as_json:
        print_json(info)
    else:
        typer.echo(
            f"{path}: {kid} signs from now on; {previous} still verifies until "
            "retired. Restart the workers to pick it up."
        )


@keys_app.command("retire")
@ratchet_errors
def keys_retire(
    kid: Annotated[str, typer.Argument(help="Key id to retire.")],
    file: FileOption = None,
    force: Annotated[
        bool,
        typer.Option(
            help="Retire even though runs' current checkpoints "
            "still use it (they will fail closed)."
        ),
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """Retire an old checkpoint key: checkpoints signed with it are refused from now on."""
    settings = Settings()
    path = file or checkpoint_keys_path(settings)
    doc = read_checkpoint_keys(path)
    if kid not in doc["keys"]:
        raise ConfigurationError(f"no key {kid!r} in {path}", field="kid")
    if kid == doc["signing"]:
        raise ConfigurationError(f"{kid!r} is the signing key; rotate first", field="kid")
    in_use: list[str] = []
    resigned: list[str] = []
    if not force:
        fleet = Fleet.connect(settings)
        resigned, unreadable = resign_documents(fleet, kid)
        if unreadable:
            raise ConfigurationError(
                f"{len(unreadable)} run document(s) signed with {kid!r} could not be signed "
                f"again ({_some(unreadable)}): they do not verify or changed meanwhile; "
                "nothing retired",
                field="kid",
            )
        in_use = runs_signed_with(fleet, kid)
        if in_use:
            raise ConfigurationError(
                f"{len(in_use)} run(s) still have a current checkpoint signed with {kid!r} "
                f"({_some(in_use)}); let them commit once under the new key, or use --force",
                field="kid",
            )
    if kid not in doc["retired"]:
        doc["retired"].append(kid)
    _write_checkpoint_keys(path, doc)
    info = {**_summary(path, doc), "documents_resigned": len(resigned)}
    if as_json:
        print_json(info)
    else:
        typer.echo(
            f"{path}: {kid} retired; checkpoints signed with it are refused "
            f"({len(resigned)} run document(s) signed again first). "
            "Restart the workers to pick it up."
        )


class SignerRole(StrEnum):
    APPROVER = "approver"
    REVIEWER = "reviewer"


def _trust_path(role: SignerRole, file: Path | None) -> Path:
    if file is not None:
        return file
    settings = Settings()
    path = settings.approvers_file if role is SignerRole.APPROVER else settings.reviewers_file
    if path is None:
        raise ConfigurationError(
            f"no {role.value} trust file: set RATCHET_{role.value.upper()}S_FILE or pass --file",
            field="file",
        )
    return path


@keys_app.command("revoke")
@ratchet_errors
def keys_revoke(
    role: Annotated[SignerRole, typer.Option("--role")],
    signer_id: Annotated[str, typer.Option("--id", help="Signer id to revoke.")],
    file: FileOption = None,
    as_json: JsonFlag = False,
) -> None:
    """Revoke an approver or reviewer: workers refuse their approvals and decisions, and
    a run waiting on one stays waiting. The public key stays in the file, marked."""
    path = _trust_path(role, file)
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        raise ConfigurationError(f"{path} is not a readable trust file", field="file") from None
    if not isinstance(doc, dict) or signer_id not in doc or signer_id == "_revoked":
        raise ConfigurationError(f"no {role.value} {signer_id!r} in {path}", field="id")
    revoked = sorted({*(str(x) for x in doc.get("_revoked", [])), signer_id})
    doc["_revoked"] = revoked
    mode = path.stat().st_mode & 0o777
    replace_file(path, (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode(), mode=mode)
    load_trust_roots(path, role.value)  # the file still loads
    info = {"role": role.value, "id": signer_id, "path": str(path), "revoked": revoked}
    if as_json:
        print_json(info)
    else:
        typer.echo(f"{path}: {role.value} {signer_id} revoked. Restart the workers to pick it up.")


@keys_app.command("list")
@ratchet_errors
def keys_list(as_json: JsonFlag = False) -> None:
    """Key ids only: the checkpoint key ring (signing, retired) and the trust roots."""
    settings = Settings()
    info: dict[str, Any] = {}
    try:
        path = checkpoint_keys_path(settings)
        info["checkpoint"] = _summary(path, read_checkpoint_keys(path))
    except ConfigurationError as exc:
        info["checkpoint"] = {"note": exc.message}
    for role, trust in (
        ("approvers", settings.approvers_file),
        ("reviewers", settings.reviewers_file),
    ):
        roots = load_trust_roots(trust, role[:-1])
        info[role] = (
            None
            if roots is None
            else {"signers": sorted(roots.keys), "revoked": sorted(roots.revoked)}
        )
    if as_json:
        print_json(info)
        return
    for name, value in info.items():
        typer.echo(f"{name}: {json.dumps(value, sort_keys=True)}")
