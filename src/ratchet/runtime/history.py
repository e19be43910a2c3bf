"""A run's history tuples (trace events, executed writes) at a cost that does not grow with them.

A :class:`~ratchet.runtime.state.RunState` is frozen: every step makes a new state whose
``trace`` (and, after a write, ``executed``) is the old tuple plus the new entries. Three
things about those tuples used to cost time in proportion to the run's length at every
step: proving that the new tuple starts with the old one (so the invariant check only
looks at the new entries), finding an executed write by its idempotency key, and checking
that no key was executed twice. This module makes each of them cost what changed:

* :func:`grow` is the one way the runtime appends: it returns ``history + entries`` and
  records that the result extends ``history``. :func:`extends` answers "does ``child``
  start with ``parent``?" by following those records (a few dict lookups), and falls back
  to comparing the tuples (in C, the very same objects compare equal without calling
  ``__eq__``) when the records do not reach ``parent``.
* :func:`key_positions` maps each idempotency key of an ``executed`` tuple to its first
  position. An index made for one tuple is extended in place for a tuple :func:`grow`
  made from it, so the index of a run is built once and then grows by one key per write.
  One index serves every prefix of the newest tuple it covers: a position at or beyond a
  tuple's length is not in that tuple (:func:`position` checks it).

Both tables are bounded and keep the tuples they name alive while they name them, so an
``id`` is never taken for another tuple's; a miss (another run pushed an entry out, a
state built by parsing) only costs one full comparison or one rebuild. Every operation
on them is one call of a C-implemented ``OrderedDict``, atomic under the GIL. Nothing
here is trusted evidence: it is a cache of facts about immutable tuples, and every answer
it gives is one a full scan would give.
"""

from __future__ import annotations

import contextlib
import operator
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["extends", "grow", "key_positions", "position"]

T = TypeVar("T")

# id(child) -> (child, parent): ``child`` is ``parent`` plus entries, made by grow().
_GROWN: OrderedDict[int, tuple[tuple[Any, ...], tuple[Any, ...]]] = OrderedDict()
_GROWN_KEPT = 16
# A chain of grow() records longer than this is not followed (a state is committed, and
# so compared with its predecessor, every few appends).
_FOLLOW = 32


class _KeyIndex:
    """First positions of the keys of ``latest`` (and so of every prefix of it)."""

    __slots__ = ("latest", "positions")

    def __init__(self, latest: tuple[Any, ...], positions: dict[str, int]) -> None:
        self.latest = latest
        self.positions = positions


# id(executed) -> (executed, its index).
_INDEXES: OrderedDict[int, tuple[tuple[Any, ...], _KeyIndex]] = OrderedDict()
_INDEXES_KEPT = 16

_KEY_OF: Callable[[Any], str] = operator.attrgetter("idempotency_key")


def _trim(table: OrderedDict[int, Any], kept: int) -> None:
    # popitem(last=False) is O(1); popping a plain dict's first key is not (its scan
    # skips every slot deleted before it).
    with contextlib.suppress(KeyError):
        while len(table) > kept:
            table.popitem(last=False)


def grow(history: tuple[T, ...], *entries: T) -> tuple[T, ...]:
    """``history + entries``, recorded as extending ``history``."""
    grown = history + entries
    _GROWN[id(grown)] = (grown, history)
    _trim(_GROWN, _GROWN_KEPT)
    index = _INDEXES.get(id(history))
    if index is not None and index[0] is history and index[1].latest is history:
        _extend_index(index[1], grown, len(history))
    return grown


def extends(child: tuple[Any, ...], parent: tuple[Any, ...]) -> bool:
    """Whether ``child`` starts with ``parent``'s entries (the same objects, or equal)."""
    node = child
    for _ in range(_FOLLOW):
        if node is parent:
            return True
        hit = _GROWN.get(id(node))
        if hit is None or hit[0] is not node:
            break
        node = hit[1]
    if node is parent:
        return True
    count = len(parent)
    return count <= len(child) and child[:count] == parent  # C; identity first


def _extend_index(index: _KeyIndex, grown: tuple[Any, ...], start: int) -> None:
    positions = index.positions
    for offset, entry in enumerate(grown[start:], start):
        positions.setdefault(_KEY_OF(entry), offset)
    index.latest = grown
    _INDEXES[id(grown)] = (grown, index)
    _trim(_INDEXES, _INDEXES_KEPT)


def key_positions(executed: tuple[Any, ...]) -> dict[str, int]:
    """Each idempotency key of ``executed`` mapped to its first position; may also hold
    keys at positions beyond ``len(executed)`` (of a longer tuple that extends it): use
    :func:`position`. Do not modify the result."""
    hit = _INDEXES.get(id(executed))
    if hit is not None and hit[0] is executed:
        return hit[1].positions
    positions: dict[str, int] = {}
    for offset, key in enumerate(map(_KEY_OF, executed)):
        positions.setdefault(key, offset)
    _INDEXES[id(executed)] = (executed, _KeyIndex(executed, positions))
    _trim(_INDEXES, _INDEXES_KEPT)
    return positions


def position(executed: tuple[Any, ...], key: str) -> int | None:
    """The first position of ``key`` in ``executed``, or None."""
    found = key_positions(executed).get(key)
    return found if found is not None and found < len(executed) else None
