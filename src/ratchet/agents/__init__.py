"""Agents: what proposes the next action of a run.

An agent sees an :class:`AgentView` (the run's observation, phase, plan cursor, budgets
used, the last outcome, what the last read returned, and its own JSON state) and returns
an :class:`AgentStep`: an action (as plain data, complete: :func:`make_action` adds the
risk label, the idempotency key, the environment precondition and the deadline; an action
without them is rejected as ``rejected_schema``) plus its new JSON state, or ``None`` when
it has nothing to propose.

The agent's state is signed and committed with each proposal and handed back on resume,
so a resumed agent continues its plan. It is evidence of intent only: what happened
outside is known from receipts and observations, never from the agent's notes.

Idempotency keys are fixed before any side effect: the shipped agents derive them from
the run id and the step's position (:func:`ratchet.runtime.derive_idempotency_key`), salted
by the number of keys a reviewer quarantined, so a retry after a crash proposes the same
key and a replan proposes a new one.

Which agents a worker loads is the worker's decision, never the run document's alone
(:class:`AgentPolicy`): the built-in agents; agents installed as plugins under the
``ratchet.agents`` entry-point group (the convention Python plugins use: installing the
package is the operator's decision), by their entry-point name; and dotted paths
(``package.module:factory``) only inside the module prefixes the operator lists in
``RATCHET_AGENTS`` (``mypkg`` allows ``mypkg`` and ``mypkg.agents``, not ``mypkg2``).
Anything else is refused before it is imported. A factory is called with the run's agent
configuration (a JSON object) and returns an :class:`Agent`.

Credentials are the worker's too: the built-in ``tool_calling`` agent gets the policy's
``credentials`` (the process's own ``RATCHET_CREDENTIALS``), through which a
configuration names a secret, never by an environment variable
(:mod:`ratchet.agents.credentials`). A plugin's factory gets its configuration alone.
"""

from __future__ import annotations

import functools
import importlib
import re
import time
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ratchet.agents.credentials import CredentialResolver
from ratchet.entrypoints import installed_entry_points
from ratchet.errors import ConfigurationError
from ratchet.runtime import (
    KIND_SPECS,
    ActionKind,
    Observation,
    Phase,
    TraceOutcome,
    derive_idempotency_key,
)
from ratchet.runtime.catalog import ToolSpec
from ratchet.runtime.state import Usage

__all__ = [
    "ENTRY_POINT_GROUP",
    "Agent",
    "AgentFactory",
    "AgentPolicy",
    "AgentStep",
    "AgentView",
    "GreetingAgent",
    "ScriptedAgent",
    "ToolCallingAgent",
    "build_agent",
    "load_agent",
]

#: The entry-point group installed agent plugins register under (``name = "pkg.mod:f"``).
ENTRY_POINT_GROUP = "ratchet.agents"


@dataclass(frozen=True, slots=True)
class AgentView:
    """What an agent is shown before each proposal."""

    run_id: str
    phase: Phase
    observation: Observation
    plan_cursor: int
    usage: Usage
    last_outcome: TraceOutcome
    quarantined_keys: tuple[str, ...]
    agent_state: dict[str, Any]
    now: int
    # The keys of the writes that took effect: ``key in view.executed_keys`` (a
    # membership test over the run's whole history; ``len()`` counts them).
    executed_keys: Container[str] = frozenset()
    verified: bool = False  # a passing verifier report at the current environment version
    last_read: str | None = None
    # The tools the run may call (the scenario's permitted ones, built-in kinds included),
    # with their contracts: what a model-driven agent offers its model.
    tools: tuple[ToolSpec, ...] = ()


@dataclass(frozen=True, slots=True)
class AgentStep:
    """One proposal: the action as plain data, and the agent's new JSON state."""

    action: dict[str, Any]
    agent_state: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Agent(Protocol):
    """Proposes the run's next action from what the runtime shows it.

    An agent may also set ``plans_ahead = True`` when ``next_step`` answers at once (a
    plan, no model call): the worker then lets a write's receipt commit travel with the
    next proposal's commit (one round trip, one fsync, for both) instead of sending it on
    its own before asking. Leave it unset for an agent that thinks (a model call), so the
    receipt is durable while it does; see :func:`plans_ahead`.
    """

    def next_step(self, view: AgentView) -> AgentStep | None:
        """The next action, or None when the agent has nothing more to propose."""


def plans_ahead(agent: object) -> bool:
    """True only when ``agent`` declares ``plans_ahead = True`` (see :class:`Agent`)."""
    return getattr(agent, "plans_ahead", False) is True


def step_key(view: AgentView, position: int) -> str:
    """The idempotency key of the write at ``position``: stable across crashes, renewed only
    when a reviewer quarantined a key (replan)."""
    return derive_idempotency_key(view.run_id, position, salt=str(len(view.quarantined_keys)))


_BUILTIN_KINDS = {kind.value: kind for kind in ActionKind}


def make_action(
    view: AgentView, position: int, kind: str, args: dict[str, Any], *, deadline_s: int = 600
) -> dict[str, Any]:
    """Complete a planned step into an action: risk label, key, precondition, deadline.
    ``kind`` is a built-in action kind or the name of a tool the run may call
    (``view.tools``: its declared risk); a tool's ``args`` are its JSON arguments."""
    builtin = _BUILTIN_KINDS.get(kind) if isinstance(kind, str) else None
    if builtin is not None:
        risk = KIND_SPECS[builtin].risk
    else:
        declared = next((t for t in view.tools if t.name == kind), None)
        if declared is None:
            raise ConfigurationError(
                f"unknown action kind {kind!r} in the plan (neither a built-in kind nor a "
                "tool the run may call)",
                field="kind",
            )
        risk = declared.risk
    return {
        "action_id": f"{view.run_id}-s{position}-p{view.usage.proposals + 1}",
        "kind": kind,
        "risk": risk.value,
        "args": args,
        "idempotency_key": step_key(view, position) if risk.is_write else None,
        "expected_env_version": view.observation.version,
        "deadline_at": view.now + deadline_s,
    }


class ScriptedAgent:
    """Plays a fixed plan: a list of ``{"kind": ..., "args": {...}}`` steps, in order.

    The position comes from the run's plan cursor (the number of completed steps), which
    the runtime advances only when a step took effect, so a rejected or crashed step is
    proposed again with the same idempotency key.
    """

    plans_ahead = True  # the next step is read off the plan: no thinking to wait for

    def __init__(self, steps: list[dict[str, Any]]) -> None:
        if not steps:
            raise ConfigurationError("a plan needs at least one step", field="steps")
        for index, step in enumerate(steps):
            if not isinstance(step, dict) or set(step) - {"kind", "args"} or "kind" not in step:
                raise ConfigurationError(
                    f"plan step {index} must be {{kind, args}}", field=f"steps[{index}]"
                )
        self.steps = steps

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ScriptedAgent:
        steps = config.get("steps")
        if not isinstance(steps, list):
            raise ConfigurationError("scripted agent needs a 'steps' list", field="steps")
        return cls(steps)

    def next_step(self, view: AgentView) -> AgentStep | None:
        position = view.plan_cursor
        if position >= len(self.steps):
            return None
        step = self.steps[position]
        action = make_action(view, position, step["kind"], dict(step.get("args", {})))
        return AgentStep(action, {"cursor": position, "plan_length": len(self.steps)})


class GreetingAgent:
    """The spec's example task: read ``app.py``, fix the greeting, verify, finish.

    It decides from evidence, not from its notes: whether the fix's key has a receipt
    (executed keys) and whether a passing verification binds the current version. It keeps
    the fix it planned in its own state, so after a crash between the read and the write
    it proposes the very same write (same content, same key) without re-reading.
    """

    WRITE_POSITION = 1

    def __init__(self, path: str = "app.py", target: str = "unit", think_ms: int = 0) -> None:
        self.path = path
        self.target = target
        self.think_ms = think_ms  # stands in for a model's latency in demos and drills
        self.plans_ahead = think_ms == 0

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GreetingAgent:
        think = config.get("think_ms", 0)
        if isinstance(think, bool) or not isinstance(think, int) or not 0 <= think <= 60_000:
            raise ConfigurationError("think_ms must be an integer 0..60000", field="think_ms")
        return cls(
            path=str(config.get("path", "app.py")),
            target=str(config.get("target", "unit")),
            think_ms=think,
        )

    def next_step(self, view: AgentView) -> AgentStep | None:
        if self.think_ms:
            time.sleep(self.think_ms / 1000)
        key = step_key(view, self.WRITE_POSITION)
        planned = view.agent_state.get("planned")
        if key in view.executed_keys:
            if view.verified:
                return AgentStep(
                    make_action(view, 3, "finish", {"summary": "greeting fixed"}),
                    {"step": "finish", "planned": planned},
                )
            return AgentStep(
                make_action(view, 2, "run_verifier", {"target": self.target}),
                {"step": "verify", "planned": planned},
            )
        if planned is None and view.last_read is not None:
            planned = view.last_read.replace("wrold", "world")
        if isinstance(planned, str):
            return AgentStep(
                make_action(
                    view, self.WRITE_POSITION, "write_file", {"path": self.path, "content": planned}
                ),
                {"step": "write", "planned": planned},
            )
        return AgentStep(make_action(view, 0, "read_file", {"path": self.path}), {"step": "read"})


def _tool_calling(config: dict[str, Any], *, credentials: CredentialResolver | None = None) -> Any:
    # ToolCallingAgent is imported at the end of this module.
    return ToolCallingAgent.from_config(config, credentials=credentials)


_BUILTIN: dict[str, Callable[[dict[str, Any]], Any]] = {
    "scripted": ScriptedAgent.from_config,
    "greeting": GreetingAgent.from_config,
    "tool_calling": _tool_calling,
}


AgentFactory = Callable[[dict[str, Any]], Any]

_MODULE_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def _refuse(spec: str, why: str) -> ConfigurationError:
    return ConfigurationError(f"agent {spec[:200]!r} {why}", field="agent")


@dataclass(frozen=True, slots=True)
class AgentPolicy:
    """Which agents this process may load (see the module docstring).

    ``prefixes`` are module paths under which dotted-path agents are allowed
    (``RATCHET_AGENTS``); ``entry_points`` turns the ``ratchet.agents`` plugin group on.
    ``credentials`` are the process's own (``RATCHET_CREDENTIALS``), handed to the
    built-in ``tool_calling`` agent; None: a configuration that names one is refused.
    """

    prefixes: tuple[str, ...] = ()
    entry_points: bool = True
    credentials: CredentialResolver | None = None

    def __post_init__(self) -> None:
        for prefix in self.prefixes:
            if _MODULE_PATH.fullmatch(prefix) is None:
                raise ConfigurationError(
                    f"agent prefix {prefix!r} is not a module path", field="agents"
                )

    def _allows_module(self, module: str) -> bool:
        return any(module == p or module.startswith(p + ".") for p in self.prefixes)

    def resolve(self, spec: str) -> AgentFactory:
        """The factory for ``spec``, imported only once the policy allows it.

        Raises:
            ConfigurationError: ``field="agent"``: not allowed on this worker, not found,
                or its import failed.
        """
        builtin = _BUILTIN.get(spec)
        if builtin is _tool_calling:
            return functools.partial(_tool_calling, credentials=self.credentials)
        if builtin is not None:
            return builtin
        module_name, colon, attr = spec.partition(":")
        if not colon:
            if self.entry_points:
                point = installed_entry_points(ENTRY_POINT_GROUP).get(spec)
                if point is not None:
                    try:
                        loaded: AgentFactory = point.load()
                    except Exception as exc:  # a plugin's own import error, reported
                        raise _refuse(
                            spec,
                            f"(entry point {point.value}) cannot be imported: {type(exc).__name__}",
                        ) from None
                    return loaded
            raise _refuse(spec, "is neither built in nor an installed ratchet.agents plugin")
        if (
            _MODULE_PATH.fullmatch(module_name) is None
            or not attr
            or not all(part.isidentifier() for part in attr.split("."))
        ):
            raise _refuse(spec, "is not 'package.module:factory'")
        if not self._allows_module(module_name):
            raise _refuse(
                spec,
                "is not allowed on this worker: RATCHET_AGENTS lists the "
                "module prefixes dotted-path agents may come from",
            )
        try:
            target: Any = importlib.import_module(module_name)
            for part in attr.split("."):  # package.module:Class.factory works too
                target = getattr(target, part)
        except (ImportError, AttributeError) as exc:
            raise _refuse(spec, f"cannot be loaded: {type(exc).__name__}: {exc}") from None
        if not callable(target):
            raise _refuse(spec, "is not callable")
        factory: AgentFactory = target
        return factory

    def build(self, spec: str, config: dict[str, Any] | None = None) -> Agent:
        """Resolve ``spec`` and call its factory with ``config``.

        Raises:
            ConfigurationError: see :meth:`resolve`; a factory that refuses its
                configuration or returns something without ``next_step``.
        """
        return build_agent(spec, self.resolve(spec), config or {})


def build_agent(spec: str, factory: AgentFactory, config: dict[str, Any]) -> Agent:
    """Call an agent factory :meth:`AgentPolicy.resolve` returned for ``spec``.

    Raises:
        ConfigurationError: the factory refused its configuration or returned something
            without ``next_step``.
    """
    try:
        agent = factory(config)
    except ConfigurationError:
        raise
    except Exception as exc:  # a user's factory: its failure is a configuration error
        raise _refuse(spec, f"factory failed: {type(exc).__name__}: {str(exc)[:200]}") from None
    if not isinstance(agent, Agent):
        raise _refuse(spec, "has no next_step(view)")
    return agent


def load_agent(
    spec: str, config: dict[str, Any] | None = None, *, policy: AgentPolicy | None = None
) -> Agent:
    """Build an agent allowed by ``policy`` (default: built-ins and installed plugins).

    Raises:
        ConfigurationError: not allowed, not found, import failure, or a factory that
            returns something without ``next_step``.
    """
    return (policy or AgentPolicy()).build(spec, config)


# Last: the model-driven agent builds on the names above (AgentView, make_action, step_key).
from ratchet.agents.tool_calling import ToolCallingAgent  # noqa: E402
