"""The notes MCP server's tools, as a tool package exposes a stdio server on a fleet.

A task file never names a process for a worker to start; the operator installs this
package, whose factories start the server (``notes_server.py``) over stdio, once per
worker process: ``shared_stdio`` keeps the connection for the worker's life, probes it
before each job and starts a new server when the old one died.

The server's ``add_note`` carries no annotations, so ratchet takes it for an
irreversible write with no way to recover a cut-off call but a review. The package
declares what the server does not say (``McpDeclaration``): a result reading
``refused: ...`` is a refusal with no effect (the server answers a note it will not keep
with plain text, not an error), and the key rides in the note as its last line and is
found again by ``list_notes`` (``KeyRecipe``), so the next worker settles a cut-off call
without a person.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ratchet import Tool
from ratchet.tools.mcp import KeyRecipe, McpDeclaration, mcp_tools, shared_stdio
from ratchet_example_tools.state import state_dir

__all__ = ["DECLARE", "notes_add_note", "notes_list_notes"]

#: The server, run as a script (it needs only the ``mcp`` package).
SERVER = Path(__file__).with_name("notes_server.py")

#: What ratchet goes by for the server's tools, by their MCP names.
DECLARE = {
    "add_note": McpDeclaration(
        refusal=r"^refused: ",
        keys=KeyRecipe(carry="text", tool="list_notes"),
    ),
}


def _tool(mcp_name: str) -> Tool:
    server = shared_stdio([sys.executable, str(SERVER), "--db", str(state_dir() / "notes.sqlite3")])
    return mcp_tools(server, prefix="notes_", include=[mcp_name], declare=DECLARE)[0]


def notes_add_note() -> Tool:
    """Entry point ``notes_add_note``: the server's ``add_note``."""
    return _tool("add_note")


def notes_list_notes() -> Tool:
    """Entry point ``notes_list_notes``: the server's ``list_notes`` (read-only)."""
    return _tool("list_notes")
