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
import secrets
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from ratchet.cli.common import JsonFlag, keys_app, print_json, ratchet_errors
from ratchet.errors import ConfigurationError
from ratchet.fleet.context import Fleet, load_trust_roots
from ratchet.fleet.settings import Settings
from ratchet.ops.keys import (
    checkpoint_keys_path,
    key_file_summary,
    read_checkpoint_keys,
    replace_file,
    resign_documents,
    runs_signed_with,
    write_checkpoint_keys,
)

__all__: list[str] = []

FileOption = Annotated[
    Path | None, typer.Option("--file", help="The key file (default: from RATCHET_* settings).")
]


def _some(run_ids: list[str]) -> str:
    """The first few run ids, for a one-line error."""
    return ", ".join(run_ids[:5]) + (" ..." if len(run_ids) > 5 else "")


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
    write_checkpoint_keys(path, doc)
    info = {**key_file_summary(path, doc), "previous": previous}
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
    write_checkpoint_keys(path, doc)
    info = {**key_file_summary(path, doc), "documents_resigned": len(resigned)}
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
        info["checkpoint"] = key_file_summary(path, read_checkpoint_keys(path))
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
