"""Effects: what the engine needs the world to do, as plain data.

The engine performs no effect itself. Each operation that needs the environment or the
store is a generator (an :data:`Op`) that yields effects and receives each one's result
(or has its exception thrown in at the ``yield``), in the style of h11 and of
:mod:`ratchet.langgraph.protocol`. One executor (:class:`ratchet.worker.executor.Executor`)
performs them; :func:`drive` runs an operation against it. So the order of commits and
adapter calls, and every recovery decision, lives in the engine; the lease guard,
metrics, log context and fault injection live in the executor and its :class:`Hooks`.

The effects, with what each returns:

=================  ==================================================  ====================
effect             performed as                                        result
=================  ==================================================  ====================
``Observe``        ``adapter.observe()``                               ``Observation``
``Project``        ``adapter.project(action, before)``                 ``Observation|None``
``RaiseFence``     ``adapter.raise_fence(fence)``                      ``None``
``Execute``        ``adapter.execute(action, intent, fence, approval)``  ``Receipt``
``Lookup``         ``adapter.lookup(key)``                             ``Receipt|None``
``Read``           ``adapter.read(action)``                            ``ReadResult``
``Verify``         ``adapter.verify(target)``                          ``VerifierReport``
``HighWater``      ``store.high_water(key)``                           ``int``
``Load``           ``store.load(key)``                                 ``StoredCheckpoint``
``Commit``         ``store.commit_batch(key, batch)``                  ``None``
``Reached``        nothing: a named crash window was reached            ``None``
=================  ==================================================  ====================

``Reached`` is how tests and drills crash a run at an exact window: their hooks see it
and raise or kill there. Production code never looks at it.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol, TypeVar

from ratchet.runtime.actions import Action
from ratchet.runtime.ports import (
    Advance,
    Fence,
    Observation,
    Release,
    RunKey,
    StoredCheckpoint,
)

__all__ = [
    "Commit",
    "CrashWindow",
    "Effect",
    "Execute",
    "HighWater",
    "Hooks",
    "Load",
    "Lookup",
    "Observe",
    "Op",
    "Performer",
    "Project",
    "RaiseFence",
    "Reached",
    "Read",
    "Verify",
    "drive",
]

_T = TypeVar("_T")


class CrashWindow(StrEnum):
    """Where a worker can die between a side effect and the checkpoint that records it."""

    BEFORE_PROPOSAL = "before_proposal"
    AFTER_PENDING_BEFORE_ADAPTER = "after_pending_before_adapter"
    AFTER_ADAPTER_BEFORE_RECEIPT = "after_adapter_before_receipt"
    AFTER_RECEIPT_BEFORE_STATE = "after_receipt_before_state"
    COMMIT_REPLY_LOST = "commit_reply_lost"


@dataclass(frozen=True, slots=True)
class Observe:
    """Observe the environment now."""


@dataclass(frozen=True, slots=True)
class Project:
    """The environment ``action`` would produce from ``before`` in one commit (None: the
    adapter cannot say)."""

    action: Action
    before: Observation


@dataclass(frozen=True, slots=True)
class RaiseFence:
    """Make ``fence`` the highest the adapter has seen for the run, or be refused."""

    fence: Fence


@dataclass(frozen=True, slots=True)
class Execute:
    """Send the pending write to the adapter once, under ``fence``."""

    action: Action
    intent_digest: str
    fence: Fence
    approval_digest: str | None


@dataclass(frozen=True, slots=True)
class Lookup:
    """The adapter's authoritative receipt for an idempotency key, or None: it holds none.

    ``action`` is the write the key was issued for (None: not known), so an adapter over
    several tools asks the right one about the right intent. An adapter that cannot tell
    whether an interrupted call happened raises :class:`ratchet.errors.OutcomeUnknownError`.
    """

    idempotency_key: str
    action: Action | None = None


@dataclass(frozen=True, slots=True)
class Read:
    """Perform a read-only action."""

    action: Action


@dataclass(frozen=True, slots=True)
class Verify:
    """Run the allow-listed verifier ``target``."""

    target: str


@dataclass(frozen=True, slots=True)
class HighWater:
    """The run's high-water generation in the store."""

    key: RunKey


@dataclass(frozen=True, slots=True)
class Load:
    """The checkpoint at the run's high-water mark."""

    key: RunKey


@dataclass(frozen=True, slots=True)
class Commit:
    """Apply ``batch`` (consecutive generations, in order) in one store call; with
    ``release``, the lease goes with it (see :class:`ratchet.runtime.ports.Release`)."""

    key: RunKey
    batch: tuple[Advance, ...]
    release: Release | None = None


@dataclass(frozen=True, slots=True)
class Reached:
    """A crash window was reached (nothing is performed)."""

    window: CrashWindow


Effect = (
    Observe
    | Project
    | RaiseFence
    | Execute
    | Lookup
    | Read
    | Verify
    | HighWater
    | Load
    | Commit
    | Reached
)

# An engine operation: yields effects, receives their results, returns its own result.
Op = Generator[Effect, Any, _T]


class Performer(Protocol):
    """What performs effects (the executor)."""

    @property
    def enforces_preconditions(self) -> bool:
        """Whether the adapter's own ``execute`` refuses a write unless the environment
        is exactly the planned one (see docs/adapters.md)."""

    def perform(self, effect: Effect) -> Any:
        """Perform ``effect`` and return its result; raises what performing it raised."""


class Hooks:
    """Where drills and tests attach: the executor passes every effect through
    :meth:`around`. The default performs it and changes nothing."""

    def around(self, effect: Effect, proceed: Callable[[], Any]) -> Any:
        """Perform ``effect`` by calling ``proceed`` (or not, or raise instead, or raise
        after it: a lost reply) and return its result."""
        return proceed()


def drive(op: Op[_T], performer: Performer) -> _T:
    """Run ``op`` to its end, performing each effect it yields with ``performer``.

    An effect's exception is thrown into ``op`` at its ``yield``, so the operation's own
    ``try`` blocks handle it exactly as if it had made the call itself.
    """
    try:
        effect = next(op)
        while True:
            try:
                result = performer.perform(effect)
            except BaseException as exc:
                effect = op.throw(exc)
            else:
                effect = op.send(result)
    except StopIteration as done:
        value: _T = done.value
        return value


# Typed one-effect operations, for a caller that drives a single effect
# (``drive(observe(), executor)``). Inside an operation the engine yields the effect
# itself: ``observed = cast(Observation, (yield Observe()))``.


def observe() -> Op[Observation]:
    result: Observation = yield Observe()
    return result


def load(key: RunKey) -> Op[StoredCheckpoint]:
    result: StoredCheckpoint = yield Load(key)
    return result


def commit(key: RunKey, batch: tuple[Advance, ...]) -> Op[None]:
    yield Commit(key, batch)
