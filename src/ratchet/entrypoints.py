"""Installed entry points, read once per import path.

``importlib.metadata.entry_points(group=...)`` reads the metadata of every installed
distribution on every call: several milliseconds of a worker's CPU at every job start,
for an answer that changes only when packages are installed. The answer is kept per
``(group, sys.path)``: a process that puts another folder on its import path (and calls
``importlib.invalidate_caches()``, as an installer does) sees the plugins there at its next
lookup; a package installed into a folder already on the path shows up when the worker
restarts, as a changed package's code would.

Agents (``ratchet.agents``) and tools (``ratchet.tools``) both load plugins through it, so
it lives below both, in a module of its own that imports nothing of ratchet's: neither
package should reach into the other for it.
"""

from __future__ import annotations

import sys
import threading
from importlib.metadata import EntryPoint, entry_points

__all__ = ["installed_entry_points"]

_LOCK = threading.Lock()
_SEEN: dict[tuple[str, tuple[str, ...]], dict[str, EntryPoint]] = {}


def installed_entry_points(group: str) -> dict[str, EntryPoint]:
    """The entry points of ``group`` by name (the first one found for a name wins, as in
    the import path's order). Do not modify the result."""
    key = (group, tuple(sys.path))
    found = _SEEN.get(key)
    if found is not None:
        return found
    with _LOCK:
        found = {}
        for point in entry_points(group=group):
            found.setdefault(point.name, point)
        if len(_SEEN) > 16:  # import paths that keep changing: forget the old ones
            _SEEN.clear()
        _SEEN[key] = found
    return found
