"""The pending write as a change: its content and a unified diff against the current file.

Read only from a run that :func:`ratchet.ops.inspect_run` verified: the path comes
from the signed pending intent, the workspace root from the signed run document, and the
path must be one of the document's allowed paths, reached through no symbolic link (the
checks the workspace adapter makes before a write). Nothing is written: the adapter's
journal is not opened (opening it resolves a crashed writer's intent, which is a worker's
job, not a viewer's).

Bounds: content is shown up to :data:`SHOW_BYTES`; a file or content larger than
:data:`DIFF_BYTES` is not diffed; a diff is cut after :data:`DIFF_LINES` lines or
:data:`DIFF_SHOW_BYTES` bytes, whichever comes first. Content
that is not text (a NUL byte, or undecodable) is marked ``binary`` and never printed;
content over the bounds is marked ``huge`` and described by its size and digest.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import stat
from pathlib import Path
from typing import Any

from ratchet.adapters.files import AllowedPaths
from ratchet.adapters.ground import Ground
from ratchet.errors import ConfigurationError, RatchetError, UntrustedGroundError
from ratchet.fleet.context import Fleet
from ratchet.fleet.runbuild import remote_branch
from ratchet.ops.operations import RunView
from ratchet.runtime import ActionKind

__all__ = ["DIFF_BYTES", "DIFF_LINES", "DIFF_SHOW_BYTES", "SHOW_BYTES", "pending_change"]

SHOW_BYTES = 16 * 1024
DIFF_BYTES = 256 * 1024
DIFF_LINES = 400
DIFF_SHOW_BYTES = 64 * 1024
_MISSING = "the file does not exist yet"


def _describe(data: bytes) -> dict[str, Any]:
    """Size, digest and how the bytes may be shown: ``text``, ``binary`` or ``huge``."""
    info: dict[str, Any] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    if b"\x00" in data[:DIFF_BYTES]:
        info["form"] = "binary"
        return info
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        info["form"] = "binary"
        return info
    if len(data) > SHOW_BYTES:
        info["form"] = "huge"
    else:
        info["form"], info["text"] = "text", text
    return info


def _read_current(root: Path, path: str, allowed: AllowedPaths) -> tuple[bytes | None, str]:
    """The file's bytes (None when it does not exist) and a note; never follows a link,
    never opens anything but a regular file, never reads past the diff bound."""
    if path not in allowed:
        return None, "the path is outside the allowed paths"
    try:
        with Ground(root).open(path) as opened:
            if opened is None:
                return None, _MISSING
            fd, _ = opened
            data = bytearray()
            while len(data) <= DIFF_BYTES:
                chunk = os.read(fd, DIFF_BYTES + 1 - len(data))
                if not chunk:
                    break
                data += chunk
    except UntrustedGroundError as exc:
        if exc.reason == "link_in_path" or exc.file_type == "symlink":
            return None, "the path goes through a symbolic link"
        return None, f"the path is not a regular file ({exc.file_type})"
    except OSError as exc:
        return None, f"the file cannot be read here ({exc.strerror or type(exc).__name__})"
    return bytes(data), ""


def _diff(old: bytes, new: bytes, path: str) -> dict[str, Any]:
    if len(old) > DIFF_BYTES or len(new) > DIFF_BYTES:
        return {"diff": None, "diff_note": f"not diffed: over {DIFF_BYTES} bytes"}
    try:
        old_text, new_text = old.decode("utf-8"), new.decode("utf-8")
    except UnicodeDecodeError:
        return {"diff": None, "diff_note": "not diffed: binary content"}
    if "\x00" in old_text or "\x00" in new_text:
        return {"diff": None, "diff_note": "not diffed: binary content"}
    if old_text == new_text:
        return {"diff": "", "diff_note": "the file already holds exactly this content"}
    lines = list(
        difflib.unified_diff(
            old_text.splitlines(keepends=True),
            new_text.splitlines(keepends=True),
            fromfile=f"a/{path} (current)",
            tofile=f"b/{path} (pending)",
        )
    )
    lines = [
        line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines
    ]
    note = ""
    if len(lines) > DIFF_LINES:
        note = f"{len(lines) - DIFF_LINES} more diff lines not shown"
        lines = lines[:DIFF_LINES]
    text = "".join(lines)
    if len(text.encode("utf-8")) > DIFF_SHOW_BYTES:
        text = text.encode("utf-8")[:DIFF_SHOW_BYTES].decode("utf-8", "ignore") + "\n"
        note = (note + "; " if note else "") + f"the diff is cut at {DIFF_SHOW_BYTES} bytes"
        note += " (the rest not shown)"
    return {"diff": text, "diff_note": note}


def _read_branch(
    fleet: Fleet, view: RunView, path: str, allowed: AllowedPaths
) -> tuple[bytes | None, str]:
    """A git environment's file as the run's branch has it on the remote now (bytes,
    None when missing) and a note; never past the diff bound."""
    if path not in allowed:
        return None, "the path is outside the allowed paths"
    env = view.document.environment
    remote = env.remote
    if remote is None or remote.branch is None:
        return None, "the run's branch is not known"
    try:
        branch = remote_branch(
            env,
            state_dir=fleet.settings.state_dir,
            credentials=fleet.credentials,
            branch=remote.branch,
        )
    except RatchetError as exc:
        return None, f"the remote cannot be read here ({exc.message})"
    try:
        tip = branch.tip()
        if tip is None:
            return None, "the run's branch is gone from the remote"
        branch.fetch(tip)
        found = branch.path_at(branch.commit(tip).tree, path)
        if found is None:
            return None, _MISSING
        if not stat.S_ISREG(found[0]):
            return None, "the path is not a regular file on the branch"
        return branch.blob(found[1]).as_raw_string()[: DIFF_BYTES + 1], ""
    except RatchetError as exc:
        return None, f"the remote cannot be read here ({exc.message})"
    finally:
        branch.close()


def pending_change(view: RunView, fleet: Fleet | None = None) -> dict[str, Any] | None:
    """The run's pending write as a change, or None when nothing is pending.

    ``{"path", "operation", "content": {bytes, sha256, form, text?}, "current": {...} |
    None, "current_note", "diff", "diff_note"}`` for a file write or delete;
    ``{"operation": "external_call", "target", "content": {...}}`` for an external call
    (there is no current file to compare with). A git environment's current file is the
    one on the run's branch, read from the remote through ``fleet`` (this process's
    object cache and credentials; None: not read). Raises nothing for a workspace that
    cannot be read here: the notes say why.
    """
    pending = view.state.pending
    if pending is None:
        return None
    action = pending.action
    if action.kind is ActionKind.EXTERNAL_CALL:
        body = str(action.args.get("body", "")).encode("utf-8")
        return {
            "operation": "external_call",
            "target": str(action.args.get("operation")),
            "content": _describe(body),
            "current": None,
            "current_note": "an external call: there is no current file",
            "diff": None,
            "diff_note": "",
        }
    if action.kind not in (ActionKind.WRITE_FILE, ActionKind.DELETE_FILE):
        return None
    path = str(action.text("path"))
    new = (
        str(action.text("content")).encode("utf-8") if action.kind is ActionKind.WRITE_FILE else b""
    )
    out: dict[str, Any] = {
        "path": path,
        "operation": str(action.kind),
        "content": _describe(new) if action.kind is ActionKind.WRITE_FILE else None,
    }
    if pending.receipt is not None:
        out["receipt_note"] = "the adapter's receipt is recorded: the write was done"
    try:
        allowed = AllowedPaths(view.document.scenario.allowed_paths)
    except ConfigurationError as exc:
        out.update(current=None, current_note=exc.message, diff=None, diff_note="")
        return out
    env = view.document.environment
    if env.kind == "git":
        if fleet is None:
            out.update(
                current=None, current_note="the remote is not read here", diff=None, diff_note=""
            )
            return out
        current, note = _read_branch(fleet, view, path, allowed)
    else:
        root = Path(env.workspace_root)
        if not root.is_dir():
            out.update(
                current=None,
                current_note="the workspace is not reachable from here",
                diff=None,
                diff_note="",
            )
            return out
        current, note = _read_current(root, path, allowed)
    missing = current is None and note == _MISSING
    if current is not None:
        described = _describe(current)
        described.pop("text", None)  # the diff shows it; the whole file is not repeated
        if len(current) > DIFF_BYTES:
            described["bytes_note"] = f"over {DIFF_BYTES} bytes (read that far)"
        out["current"] = described
    else:
        out["current"] = None
    out["current_note"] = note
    if current is not None or missing:
        out.update(_diff(current or b"", new, path))
    else:
        out.update(diff=None, diff_note="not diffed")
    return out
