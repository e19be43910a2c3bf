"""An agent that fixes a typo in one file, written against ratchet's public agent API.

Its plan has four steps, each at a fixed position (the position is what makes a write's
idempotency key stable, see :func:`ratchet.agents.step_key`):

0. read the file;
1. write it back with the typo replaced (the only write, so the only idempotency key);
2. run the verifier;
3. finish.

It decides from evidence, not from its notes: whether the write took effect is read off
``view.executed_keys`` (keys with a committed receipt) and whether the fix passes off
``view.verified`` (a passing verifier report bound to the current environment). Its own
state holds only what it planned: the new content, and the environment version and
replan count it was planned under. A job that dies between the read and the write
resumes with that plan and proposes the very same write under the very same key; a plan
made for another environment (a reviewer rebaselined the run) or before a replan (a
reviewer quarantined the old key) is dropped and the file is read again.

Use it on a worker (see ``examples/README.md``)::

    export PYTHONPATH=/path/to/parent/of/greeting RATCHET_AGENTS=greeting
    ratchet submit greeting/task.yaml --agent greeting.agent:make_agent

Configuration (the task file's ``agent_config``): ``path`` (default ``app.py``), ``typo``
(``wrold``), ``fix`` (``world``), ``target`` (the verifier target, ``unit``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ratchet.agents import AgentStep, AgentView, make_action, step_key
from ratchet.errors import ConfigurationError

__all__ = ["FINISH", "READ", "VERIFY", "WRITE", "FixTypoAgent", "FixTypoConfig", "make_agent"]

READ, WRITE, VERIFY, FINISH = 0, 1, 2, 3
#: Verifier runs after the write before the agent stops proposing (a fix that does not
#: pass is left for a person, not retried until the proposal budget runs out).
MAX_VERIFICATIONS = 2


class FixTypoConfig(BaseModel):
    """The agent's configuration; unknown keys and wrong types are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    path: str = Field(default="app.py", min_length=1)
    typo: str = Field(default="wrold", min_length=1)
    fix: str = "world"
    target: str = Field(default="unit", min_length=1)


class FixTypoAgent:
    """Read ``path``, replace ``typo`` by ``fix``, verify with ``target``, finish."""

    # next_step answers at once (no model call), so the worker may send a write's
    # receipt commit together with the next proposal's commit.
    plans_ahead = True

    def __init__(self, config: FixTypoConfig) -> None:
        self.config = config

    def next_step(self, view: AgentView) -> AgentStep | None:
        """The next action, or None when the fix was written but does not pass."""
        cfg = self.config
        notes = dict(view.agent_state)
        if step_key(view, WRITE) in view.executed_keys:
            if view.verified:
                return AgentStep(
                    make_action(
                        view,
                        FINISH,
                        "finish",
                        {"summary": f"replaced {cfg.typo!r} by {cfg.fix!r} in {cfg.path}"},
                    ),
                    {**notes, "step": "finish"},
                )
            tries = int(notes.get("verifications", 0))
            if tries >= MAX_VERIFICATIONS:
                return None
            return AgentStep(
                make_action(view, VERIFY, "run_verifier", {"target": cfg.target}),
                {**notes, "step": "verify", "verifications": tries + 1},
            )
        plan = notes.get("plan")
        if not _plan_holds(plan, view):
            plan = None
            if view.last_read is not None:  # what the read this job proposed returned
                plan = {
                    "content": view.last_read.replace(cfg.typo, cfg.fix),
                    "env_version": view.observation.version,
                    "replans": len(view.quarantined_keys),
                }
        if isinstance(plan, dict):
            return AgentStep(
                make_action(
                    view, WRITE, "write_file", {"path": cfg.path, "content": str(plan["content"])}
                ),
                {"step": "write", "plan": plan},
            )
        return AgentStep(make_action(view, READ, "read_file", {"path": cfg.path}), {"step": "read"})


def _plan_holds(plan: object, view: AgentView) -> bool:
    """A plan is reused only under the environment and the replan count it was made for."""
    return (
        isinstance(plan, dict)
        and isinstance(plan.get("content"), str)
        and plan.get("env_version") == view.observation.version
        and plan.get("replans") == len(view.quarantined_keys)
    )


def make_agent(config: dict[str, Any]) -> FixTypoAgent:
    """The factory a worker calls with the run's ``agent_config``.

    Raises:
        ConfigurationError: an unknown key or a value of the wrong type
            (``field="agent_config.<key>"``); submit refuses the run before it exists.
    """
    try:
        return FixTypoAgent(FixTypoConfig.model_validate(config))
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        field = "".join(f".{part}" for part in ("agent_config", *first["loc"]))[1:]
        raise ConfigurationError(f"{field}: {first['msg']}", field=field) from None
