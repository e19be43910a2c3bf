"""The MCP reference servers from PyPI, unmodified, each in a virtual environment it can
run in: ``mcp-server-git`` (with the ``mcp`` it asks for) and ``mcp-server-sqlite`` (which
needs ``mcp`` 1.x). Built once into a cache folder outside the repository and reused; a
machine that cannot install them (no index, no ``git`` for the git server) skips the tests
that need them, saying why."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

__all__ = ["GIT_SERVER", "SQLITE_SERVER", "reference_server"]

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


if __name__ == "__main__":  # prepare the cache ahead of a run
    for server in (GIT_SERVER, SQLITE_SERVER):
        print(server[2], reference_server(server), file=sys.stderr)
