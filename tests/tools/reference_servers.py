"""The MCP reference servers from PyPI, unmodified, each in a virtual environment it can
run in: ``mcp-server-git`` (with the ``mcp`` it asks for) and ``mcp-server-sqlite`` (which
needs ``mcp`` 1.x). Built once into a cache folder outside the repository and reused; a
machine that cannot install them (no index, no ``git`` for the git server) skips the tests
that need them, saying why.

Also what the tests count effects with, outside ratchet and outside the servers: a
repository's commits read with dulwich (no ``git`` program, no repository configuration),
a SQLite file's rows read with ``sqlite3``, read-only."""

from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3
import subprocess
import sys
import venv
from pathlib import Path
from typing import Any

from dulwich import porcelain
from dulwich.repo import Repo

__all__ = [
    "GIT_SERVER",
    "NOTES_TABLE",
    "SQLITE_SERVER",
    "commit_messages",
    "notes_db",
    "reference_server",
    "rows",
    "staged_repo",
]

#: The pinned releases (what the tests were written against).
GIT_SERVER = ("git", ["mcp-server-git==2026.10.19"], "mcp-server-git")
SQLITE_SERVER = ("sqlite", ["mcp-server-sqlite==2025.4.25", "mcp<2"], "mcp-server-sqlite")

_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ratchet-tests" / "mcp"


def reference_server(server: tuple[str, list[str], str]) -> Path | str:
    """The path of the server's program, installed if needed, or why it cannot be."""
    name, requirements, program = server
    if name == "git" and shutil.which("git") is None:
        return "mcp-server-git runs the git program, which is not installed"
    # A digest, not hash(): str hashes differ per process, and the folder must not.
    pinned = hashlib.sha256("\n".join(requirements).encode()).hexdigest()[:12]
    folder = _CACHE / f"{name}-{pinned}"
    binary = folder / "bin" / program
    if binary.exists():
        return binary
    try:
        venv.EnvBuilder(with_pip=True, clear=True).create(folder)
        done = subprocess.run(
            [str(folder / "bin" / "python"), "-m", "pip", "install", "-q", *requirements],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        shutil.rmtree(folder, ignore_errors=True)
        return f"{program} could not be installed ({type(exc).__name__})"
    if done.returncode != 0 or not binary.exists():
        shutil.rmtree(folder, ignore_errors=True)
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["?"]
        return f"{program} could not be installed: {tail[0][:200]}"
    return binary


_WHO = b"t <t@example.com>"


def staged_repo(root: Path) -> Path:
    """A repository at ``root/repo`` (made with dulwich) with one commit and a change
    staged for a run to commit."""
    repo = root / "repo"
    repo.mkdir(parents=True)
    porcelain.init(str(repo))
    app = repo / "app.py"
    app.write_text('print("Hello, wrold")\n')
    porcelain.add(str(repo), paths=[str(app)])
    porcelain.commit(str(repo), message=b"initial\n", author=_WHO, committer=_WHO)
    app.write_text('print("Hello, world")\n')
    porcelain.add(str(repo), paths=[str(app)])
    return repo


def commit_messages(repo: Path) -> list[str]:
    """The messages of the commits reachable from HEAD, newest first."""
    with Repo(str(repo)) as opened:
        return [entry.commit.message.decode() for entry in opened.get_walker()]


#: The table the SQL tests write to: its key column is UNIQUE, as docs/mcp.md advises.
NOTES_TABLE = (
    "CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT NOT NULL, ratchet_key TEXT UNIQUE)"
)


def notes_db(root: Path) -> Path:
    """A SQLite file at ``root/notes.db`` with the empty ``notes`` table."""
    path = root / "notes.db"
    with sqlite3.connect(path) as made:
        made.execute(NOTES_TABLE)
    made.close()
    return path


def rows(
    db: Path, query: str = "SELECT body, ratchet_key FROM notes ORDER BY id"
) -> list[tuple[Any, ...]]:
    """``query``'s rows, read from the file itself (read-only)."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as reader:
        found = reader.execute(query).fetchall()
    reader.close()
    return found


if __name__ == "__main__":  # prepare the cache ahead of a run
    for server in (GIT_SERVER, SQLITE_SERVER):
        print(server[2], reference_server(server), file=sys.stderr)
