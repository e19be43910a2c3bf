"""An example ratchet tool package (``examples/tool-package/README.md``).

Four tools, one ``ratchet.tools`` entry point each (``pyproject.toml``):

- ``send_invoice``: a decorated Python tool, an irreversible write, with a lookup that
  finds an earlier call by its idempotency key (recovery ``lookup``);
- ``invoice_status``: a read-only Python tool, the check of a ``kind: tools`` run;
- ``notes_add_note`` and ``notes_list_notes``: the tools of the notes MCP server
  (``notes_server.py``), started over stdio once per worker process (``shared_stdio``);
  ``add_note`` is declared with a refusal pattern and a key recipe (``McpDeclaration``).

Where the tools keep their state is the worker's setting: the folder
``EXAMPLE_TOOLS_DIR`` names (default ``~/.local/state/ratchet-example-tools``).
"""

from __future__ import annotations

from ratchet_example_tools.invoices import invoice_status, send_invoice
from ratchet_example_tools.notes import notes_add_note, notes_list_notes

__all__ = ["invoice_status", "notes_add_note", "notes_list_notes", "send_invoice"]
