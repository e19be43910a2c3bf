"""Integrations: agents written with other frameworks, run as ratchet runs.

Each integration is a module of its own with an optional extra, imported only by the
code that uses it; nothing in ratchet's core imports this package.

* :mod:`ratchet.integrations.pydantic_ai`: a Pydantic AI ``Agent`` (extra
  ``pydantic-ai``; ``docs/pydantic-ai.md``).
* :mod:`ratchet.integrations.openai_agents`: an OpenAI Agents SDK ``Agent`` (extra
  ``openai-agents``; ``docs/openai-agents.md``).

Both drive one journaled step (:mod:`ratchet.integrations._journal`): a model response is
committed with the proposal it led to, so a worker that takes a run over never asks the
model again for a step the run already has.
"""

from __future__ import annotations

__all__: list[str] = []
