"""A read-only web console for operators: runs, one run's evidence, the review queue.

Served on loopback by default (``ratchet console``). It shows exactly what ``ratchet
show`` shows, verified the same way, and the commands an operator runs to sign; it never
signs and has no write endpoint. See :mod:`ratchet.console.server`.
"""

from __future__ import annotations

from ratchet.console.data import ConsoleData, waiting_runs
from ratchet.console.server import CSP, ConsoleServer, serve_console

__all__ = ["CSP", "ConsoleData", "ConsoleServer", "serve_console", "waiting_runs"]
