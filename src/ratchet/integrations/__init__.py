"""Integrations: agents written with other frameworks, run as ratchet runs.

Each integration is a module of its own with an optional extra, imported only by the
code that uses it; nothing in ratchet's core imports this package.

* :mod:`ratchet.integrations.pydantic_ai`: a Pydantic AI ``Agent`` (extra
  ``pydantic-ai``; ``docs/pydantic-ai.md``).
"""

from __future__ import annotations

__all__: list[str] = []
