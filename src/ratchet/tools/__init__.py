"""Tools: users' own actions, with exactly-once effects, fences, approvals and review.

Declare a tool once (:func:`tool` for a function, :class:`Tool` for a class with state),
put it in a :class:`Toolbox`, permit it by name in the scenario, and every guarantee the
built-in kinds have applies to it: the intent is committed before the call, the key is
fixed before any effect and bound to the intent, a stale worker is refused, an approval
binds the exact call, the output comes back as a receipt, and a call whose outcome a crash
hid is recovered as the tool's declaration allows (docs/tools.md).

Installed packages can offer tools under the ``ratchet.tools`` entry-point group
(``name = "pkg.module:object"``; the object is a :class:`Tool`, a :class:`Tool` subclass
taking no arguments, or a function returning a tool). A worker loads an entry point
only when a run's scenario permits a tool of that name: installing the package is the
operator's decision, permitting the tool the task's.

Layout: :mod:`.declare` (the decorator and the class form), :mod:`.ledger` (the record
that makes stateless tools an environment), :mod:`.adapter` (that environment), and the
tools shipped here: :mod:`.mcp` (an MCP server's tools), :mod:`.postgres` (a database
that fences itself), :mod:`.shell` (a command in the verifier sandbox).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ratchet.adapters.router import RouterAdapter
from ratchet.entrypoints import installed_entry_points
from ratchet.errors import AdapterError, ConfigurationError
from ratchet.runtime.catalog import BUILTIN_TOOLS, Recovery, ToolCatalog, ToolSpec
from ratchet.runtime.ports import Adapter, Clock
from ratchet.tools.adapter import ToolsAdapter, output_result
from ratchet.tools.declare import Found, FunctionTool, RecordedCall, Tool, ToolCall, tool
from ratchet.tools.ledger import CallLedger, ToolLedger

__all__ = [
    "ENTRY_POINT_GROUP",
    "Found",
    "FunctionTool",
    "RecordedCall",
    "Recovery",
    "Tool",
    "ToolCall",
    "ToolCatalog",
    "ToolLedger",
    "ToolSpec",
    "Toolbox",
    "ToolsAdapter",
    "load_entry_point_tool",
    "output_result",
    "tool",
]

#: The entry-point group installed tool plugins register under.
ENTRY_POINT_GROUP = "ratchet.tools"


def _as_tool(obj: Any, where: str) -> Tool:
    if isinstance(obj, Tool):
        return obj
    if isinstance(obj, type) and issubclass(obj, Tool):
        return obj()
    if callable(obj):
        made = obj()
        if isinstance(made, Tool):
            return made
    raise ConfigurationError(f"{where} is not a ratchet tool", field="tools")


#: What a tool package's factory raises when the server or service it reaches could not
#: be reached, or died while it was asked (an MCP server during its handshake or tool
#: listing): transient, so the job is retried later and the run is not frozen.
_TRANSIENT = (OSError, TimeoutError, ExceptionGroup)


def load_entry_point_tool(name: str, *, group: str = ENTRY_POINT_GROUP) -> Tool:
    """The tool installed under entry point ``name``.

    Transient is not configuration: a factory that fails because what it reaches is
    down (an ``AdapterError`` it raises, an ``OSError``, a timeout, the exception group an
    async client raises when its server dies mid-handshake) is a retryable failure; what
    would fail the same way every time (not installed, not importable, not a tool, named
    otherwise, a bug of the factory) is a configuration error.

    Raises:
        ConfigurationError: no such entry point, it fails to import, it is not a tool
            named ``name``, or its factory failed for a reason of its own.
        AdapterError: its factory could not reach what it needs (retryable=True), or
            the factory's own ``AdapterError``.
    """
    point = installed_entry_points(group).get(name)
    if point is None:
        raise ConfigurationError(f"no tool {name!r} is installed ({group})", field="tools")
    try:
        loaded = point.load()
    except Exception as exc:  # the package itself is broken: its type only (no message)
        raise ConfigurationError(
            f"tool {name!r} failed to load ({type(exc).__name__})", field="tools"
        ) from None
    try:
        made = _as_tool(loaded, f"entry point {name!r}")
    except (ConfigurationError, AdapterError):
        raise
    except _TRANSIENT as exc:
        raise AdapterError(
            f"tool {name!r} could not be made: what it reaches is unavailable "
            f"({type(exc).__name__}); the job is retried later",
            retryable=True,
            tool=name,
        ) from None
    except Exception as exc:  # the factory's own failure: its type only (no message)
        raise ConfigurationError(
            f"tool {name!r} failed to load ({type(exc).__name__})", field="tools"
        ) from None
    if made.spec.name != name:
        raise ConfigurationError(
            f"entry point {name!r} provides a tool named {made.spec.name!r}", field="tools"
        )
    return made


class Toolbox:
    """The tools a worker (or a script) offers runs, by name.

    Raises (constructor, :meth:`add`):
        ConfigurationError: two tools with one name, a built-in name, a bad declaration.
    """

    def __init__(self, tools: Iterable[Tool] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        for t in tools:
            self.add(t)

    def add(self, t: Tool) -> Tool:
        """Register ``t`` (returned, so it can decorate a class or a tool)."""
        if not isinstance(t, Tool):
            raise ConfigurationError(f"{t!r} is not a ratchet tool", field="tools")
        name = t.spec.name
        if name in self._tools or name in BUILTIN_TOOLS:
            raise ConfigurationError(f"a tool named {name!r} is registered already", field="tools")
        self._tools[name] = t
        return t

    def __iter__(self) -> Iterator[Tool]:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __getitem__(self, name: str) -> Tool:
        return self._tools[name]

    def __repr__(self) -> str:
        return f"Toolbox({sorted(self._tools)})"

    @property
    def catalog(self) -> ToolCatalog:
        """The built-ins and these tools' contracts (what the engine checks calls by)."""
        return ToolCatalog(t.spec for t in self._tools.values())

    def with_entry_points(self, names: Iterable[str], *, group: str = ENTRY_POINT_GROUP) -> Toolbox:
        """A toolbox with these tools and the installed entry points ``names`` that are
        neither built-in nor here already (a worker passes a scenario's permissions).

        Raises:
            ConfigurationError: from :func:`load_entry_point_tool`.
        """
        box = Toolbox(self._tools.values())
        for name in names:
            if name in BUILTIN_TOOLS or name in box:
                continue
            box.add(load_entry_point_tool(name, group=group))
        return box

    def for_scenario(self, scenario: Any) -> list[Tool]:
        """The tools ``scenario`` permits, after checking it may run with them.

        Raises:
            ConfigurationError: a permitted tool is missing, or its approval is not asked
                for (:meth:`ToolCatalog.check_scenario`).
        """
        self.catalog.check_scenario(scenario)
        return [self._tools[str(n)] for n in scenario.permissions if str(n) in self._tools]

    def environment(
        self,
        scenario: Any,
        *,
        ledger: Path | str | CallLedger,
        files: Adapter | None = None,
        calls: Adapter | None = None,
        clock: Clock | None = None,
        **options: Any,
    ) -> Adapter:
        """The adapter a run of ``scenario`` uses: the permitted tools over ``ledger``,
        beside a workspace (``files``) and an HTTP API (``calls``) when given.

        Raises:
            ConfigurationError: see :meth:`for_scenario`.
        """
        tools = ToolsAdapter(self.for_scenario(scenario), ledger, clock=clock, **options)
        if files is None and calls is None:
            return tools
        if files is None:
            raise ConfigurationError("an HTTP API needs a workspace beside it", field="files")
        return RouterAdapter(files, calls, tools=tools)
