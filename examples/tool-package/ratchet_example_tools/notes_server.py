"""A small notes service as a stdio MCP server (the ``mcp`` package's ``MCPServer``):

    python notes_server.py --db PATH

It is the kind of server a tool package runs for itself, and behaves like many published
ones: it knows no idempotency keys, its write carries no annotations, and it answers a
note it will not keep with plain text (``refused: ...``), not an error result. Notes live
in one SQLite file, shared by every server started on it.
"""

from __future__ import annotations

import argparse
import sqlite3
from contextlib import closing
from pathlib import Path

from mcp.server.mcpserver import MCPServer
from mcp_types import ToolAnnotations

MAX_NOTE = 4000


def build(db: Path) -> MCPServer:
    """The server, over the notes in ``db``."""
    server = MCPServer("notes")

    def connect() -> sqlite3.Connection:
        conn = sqlite3.connect(db, timeout=30)
        conn.execute("CREATE TABLE IF NOT EXISTS notes (id INTEGER PRIMARY KEY, text TEXT)")
        return conn

    @server.tool(structured_output=False)  # no annotations: a client assumes the worst
    def add_note(text: str) -> str:
        """Add a note."""
        if not text.strip() or len(text) > MAX_NOTE:
            return f"refused: a note holds 1 to {MAX_NOTE} characters"
        with closing(connect()) as conn, conn:
            row = conn.execute("INSERT INTO notes (text) VALUES (?)", (text,)).lastrowid
        return f"added note {row}"

    @server.tool(annotations=ToolAnnotations(read_only_hint=True), structured_output=False)
    def list_notes() -> str:
        """Every note, oldest first."""
        with closing(connect()) as conn:
            rows = conn.execute("SELECT id, text FROM notes ORDER BY id").fetchall()
        return "\n\n".join(f"Note {n}:\n{text}" for n, text in rows) or "no notes"

    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", type=Path, required=True, help="the SQLite file")
    build(parser.parse_args().db).run("stdio")


if __name__ == "__main__":
    main()
