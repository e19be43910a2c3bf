"""Declaring a tool: the decorator for the common case, the class form for tools with state.

Decorator::

    @ratchet.tool(risk="irreversible_external_write", idempotent=True)
    def create_refund(order_id: str, amount_cents: int, *, call: ratchet.ToolCall) -> dict:
        resp = payments.post("/refunds", json={...},
                             headers={"Idempotency-Key": call.idempotency_key})
        return {"refund_id": resp["id"]}

    @create_refund.lookup
    def find_refund(key: str) -> dict | None:   # optional: recovery by key
        ...                                     # (or find_refund(key, call): see below)

The arguments' model is built from the signature (every parameter but ``call``), or is
the one parameter's own pydantic model; its JSON Schema is what a model is shown. The
``call`` parameter, when the function has one, receives the :class:`ToolCall`: the run,
the idempotency key, the fence, the intent and approval digests.

Class form::

    class Tickets(ratchet.Tool):
        name = "file_ticket"
        risk = Risk.IRREVERSIBLE_EXTERNAL_WRITE
        class Args(BaseModel):
            title: str
            body: str
        def __init__(self, client): self.client = client
        def run(self, args, call): ...
        def lookup(self, key, call=None): ...   # optional
        def raise_fence(self, fence): ...   # optional: the tool checks fences itself

A lookup is asked by recovery about a call whose outcome a crash hid: ``lookup(key)``, or
``lookup(key, call)`` when it takes a second argument, ``call`` being the
:class:`RecordedCall` (the tool, the arguments as proposed, the intent digest the key was
committed with), for a lookup that searches by something the arguments name.

A tool's recovery follows from what it declares: a ``lookup`` makes it ``lookup``;
``idempotent=True`` (the service dedupes by the key it is given) makes it
``idempotent``; otherwise ``review``. A tool that defines ``raise_fence`` checks fences
(it must then also refuse, inside ``run``, a call whose ``call.fence`` is older than one
it has seen, raising :class:`ratchet.errors.FenceRejectedError`).

What ``run`` returns is the call's output: any JSON value (no floats) or a pydantic model.
It becomes the receipt's ``output`` (canonical JSON; past 64 KiB a prefix, with the
whole output's ``output_sha256``). ``run``
raises :class:`ratchet.errors.AdapterError` with ``retryable=False`` for a refusal that had
no effect; anything else it raises leaves the call's outcome unknown, for recovery.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, ClassVar, Generic, ParamSpec, TypeVar, get_type_hints, overload

from pydantic import BaseModel, ConfigDict, create_model

from ratchet.errors import ConfigurationError
from ratchet.runtime.actions import Risk
from ratchet.runtime.catalog import Recovery, ToolSpec
from ratchet.runtime.ports import Fence

__all__ = ["Found", "FunctionTool", "RecordedCall", "Tool", "ToolCall", "tool"]

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class ToolCall:
    """What a tool is told about the call besides its arguments.

    ``idempotency_key`` and ``fence`` are None for a read-only tool's call. ``fence`` is
    the caller's lease fence: a tool that checks fences refuses one older than it has seen
    for the run.
    """

    run_id: str
    tool: str
    idempotency_key: str | None
    fence: Fence | None
    intent_digest: str | None = None
    approval_digest: str | None = None


@dataclass(frozen=True, slots=True)
class Found:
    """What a lookup found, when the tool also knows which intent the earlier call had
    (the ``intent_digest`` its ``ToolCall`` carried): a lookup may return this instead of
    the bare output, and a key found under another intent then opens a review instead of
    passing for this call."""

    output: Any
    intent_digest: str | None = None


@dataclass(frozen=True, slots=True)
class RecordedCall:
    """The call recovery asks a lookup about: the tool's name, the ``arguments`` as
    proposed (what the intent digest covers; None when recovery knows only the key's
    ledger row) and the ``intent_digest`` the key was committed with."""

    tool: str
    arguments: Mapping[str, Any] | None
    intent_digest: str


def takes_call(lookup: Callable[..., Any]) -> bool:
    """Whether ``lookup`` takes the recorded call after the key (a second positional
    parameter, or ``*args``)."""
    try:
        params = list(inspect.signature(lookup).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: the key alone
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)


class Tool:
    """The class form of a tool. Subclass it, set ``name``, ``risk`` and ``Args`` (a
    pydantic model), and define :meth:`run`; optionally :meth:`lookup`,
    :meth:`raise_fence` and :meth:`close`. See the module docstring."""

    name: ClassVar[str] = ""
    risk: ClassVar[Risk | str] = Risk.IRREVERSIBLE_EXTERNAL_WRITE
    Args: ClassVar[type[BaseModel]]
    description: ClassVar[str] = ""
    requires_approval: ClassVar[bool] = False
    idempotent: ClassVar[bool] = False

    def run(self, args: Any, call: ToolCall) -> Any:
        """Perform the call; return its output. See the module docstring."""
        raise NotImplementedError

    def lookup(self, key: str) -> Any | None:
        """The output of an earlier call made with ``key`` (or a :class:`Found` naming
        its intent too), or None: none was made. Defining it makes the tool's recovery
        ``lookup``. It may take a second argument, the :class:`RecordedCall`
        (``lookup(self, key, call=None)``)."""
        raise NotImplementedError

    def recover(self, key: str, call: RecordedCall) -> Any | None:
        """What recovery asks: ``lookup(key, call)`` when the tool's lookup takes the
        call, else ``lookup(key)``."""
        if takes_call(self.lookup):
            return self.lookup(key, call)  # type: ignore[call-arg]  # a lookup that takes it
        return self.lookup(key)

    def raise_fence(self, fence: Fence) -> None:
        """Record a new owner's fence without calling. Defining it declares that the
        tool checks fences. Raises FenceRejectedError."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the tool holds (connections, processes)."""

    def declare(self, **fields: Any) -> None:
        """Set class-form fields (``name``, ``risk``, ``Args``, ...) on this instance, the
        ones given and not None: a tool built from arguments rather than subclassed."""
        for name, value in fields.items():
            if value is not None:
                setattr(self, name, value)
        self.__dict__.pop("_spec", None)

    # -- what the runtime reads ---------------------------------------------------------

    def _defines(self, method: str) -> bool:
        return getattr(type(self), method) is not getattr(Tool, method)

    @property
    def has_lookup(self) -> bool:
        return self._defines("lookup")

    @property
    def checks_fences(self) -> bool:
        return self._defines("raise_fence")

    @property
    def args_model(self) -> type[BaseModel]:
        model = getattr(self, "Args", None)
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise ConfigurationError(
                f"tool {self.name!r} has no Args model (a pydantic BaseModel)", field="Args"
            )
        return model

    def parse_args(self, args: dict[str, Any]) -> Any:
        """The arguments as :meth:`run` takes them (validated already by the runtime)."""
        return self.args_model.model_validate(args)

    @property
    def spec(self) -> ToolSpec:
        """The tool's contract. Raises ConfigurationError for a bad declaration."""
        cached: ToolSpec | None = self.__dict__.get("_spec")
        if cached is not None:
            return cached
        try:
            risk = Risk(self.risk)
        except ValueError:
            raise ConfigurationError(
                f"tool {self.name!r} has an unknown risk {self.risk!r}", field="risk"
            ) from None
        if self.has_lookup:
            recovery = Recovery.LOOKUP
        elif self.idempotent:
            recovery = Recovery.IDEMPOTENT
        else:
            recovery = Recovery.REVIEW
        spec = ToolSpec(
            name=self.name,
            risk=risk,
            args_model=self.args_model,
            description=self.description or (inspect.getdoc(type(self)) or "").strip(),
            requires_approval=self.requires_approval,
            recovery=recovery,
            checks_fences=self.checks_fences,
        )
        self.__dict__["_spec"] = spec
        return spec

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class FunctionTool(Tool, Generic[P, R]):
    """A tool made by :func:`tool` from a function (see the module docstring).

    Generic in the function's parameters and return type, so a decorated function keeps
    its signature for a type checker: calling the tool directly (in a test, say) is
    checked as calling the function.
    """

    def __init__(
        self,
        fn: Callable[P, R],
        *,
        name: str,
        risk: Risk | str,
        description: str,
        requires_approval: bool,
        idempotent: bool,
    ) -> None:
        self.fn: Callable[P, R] = fn
        self.name = name  # type: ignore[misc]  # instance values of the class form's fields
        self.risk = risk  # type: ignore[misc]
        self.description = description  # type: ignore[misc]
        self.requires_approval = requires_approval  # type: ignore[misc]
        self.idempotent = idempotent  # type: ignore[misc]
        self._lookup_fn: Callable[..., Any] | None = None
        self._fence_fn: Callable[[Fence], None] | None = None
        self.Args, self._model_param, self._wants_call = _signature_model(fn, name)  # type: ignore[misc]

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Call the function itself (for tests and plain use): no ledger, no fence."""
        return self.fn(*args, **kwargs)

    def lookup(self, key: Any, call: RecordedCall | None = None) -> Any | None:
        """With a key: the registered lookup's answer (given ``call`` too when it takes
        it). With a function (as a decorator, ``@my_tool.lookup``): register it as the
        tool's lookup."""
        if callable(key) and not isinstance(key, str):
            return self.register_lookup(key)
        if self._lookup_fn is None:
            raise NotImplementedError
        if call is not None and takes_call(self._lookup_fn):
            return self._lookup_fn(key, call)
        return self._lookup_fn(key)

    def fence(self, fn: Callable[[Fence], None]) -> Callable[[Fence], None]:
        """Decorator (``@my_tool.fence``): see :meth:`register_fence`."""
        return self.register_fence(fn)

    def raise_fence(self, fence: Fence) -> None:
        if self._fence_fn is None:
            raise NotImplementedError
        self._fence_fn(fence)

    @property
    def has_lookup(self) -> bool:
        return self._lookup_fn is not None

    @property
    def checks_fences(self) -> bool:
        return self._fence_fn is not None

    def register_lookup(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: ``fn(key)`` (or ``fn(key, call)``, given the :class:`RecordedCall`)
        returns an earlier call's output, or None."""
        self._lookup_fn = fn
        self.__dict__.pop("_spec", None)
        return fn

    def register_fence(self, fn: Callable[[Fence], None]) -> Callable[[Fence], None]:
        """Decorator: ``fn(fence)`` records a new owner's fence at the tool's storage (and
        declares that the tool checks fences)."""
        self._fence_fn = fn
        self.__dict__.pop("_spec", None)
        return fn

    def parse_args(self, args: dict[str, Any]) -> Any:
        # Plain arguments (str, int, bool) go to the function as the runtime validated
        # them against this very model (the contract the run's environment binds).
        if self._model_param is None and self.spec.plain_args:
            return args
        return self.args_model.model_validate(args)

    def run(self, args: Any, call: ToolCall) -> Any:
        # Called by name with validated arguments: the signature was checked when the
        # tool was declared (_signature_model), not here.
        fn: Callable[..., Any] = self.fn
        extra = {"call": call} if self._wants_call else {}
        if self._model_param is not None:
            return fn(**{self._model_param: args}, **extra)
        if isinstance(args, dict):
            return fn(**args, **extra)
        return fn(**args.model_dump(), **extra)


def _argument_hints(fn: Callable[..., Any], name: str) -> dict[str, Any]:
    """``fn``'s argument annotations, resolved (``call`` and the return are not: they
    may name types the function's module imports only for type checking)."""
    shown = {k: v for k, v in inspect.get_annotations(fn).items() if k not in ("call", "return")}
    holder = SimpleNamespace(__annotations__=shown)
    try:
        return get_type_hints(
            holder,
            globalns=getattr(fn, "__globals__", {}),
            localns=dict(inspect.getclosurevars(fn).nonlocals),
            include_extras=True,
        )
    except NameError as exc:
        raise ConfigurationError(
            f"tool {name!r}: an argument's type cannot be resolved ({exc.name})", field="args"
        ) from None


def _signature_model(fn: Callable[..., Any], name: str) -> tuple[type[BaseModel], str | None, bool]:
    """The arguments' model from ``fn``'s signature: ``(model, model_param, wants_call)``.

    Raises:
        ConfigurationError: an argument without a type annotation, *args or **kwargs.
    """
    signature = inspect.signature(fn)
    hints = _argument_hints(fn, name)
    fields: dict[str, Any] = {}
    wants_call = False
    params = [p for p in signature.parameters.values()]
    for param in params:
        if param.name == "call":
            wants_call = True
            continue
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ConfigurationError(
                f"tool {name!r}: *args and **kwargs cannot be shown to a model", field="args"
            )
        if param.name not in hints:
            raise ConfigurationError(
                f"tool {name!r}: argument {param.name!r} has no type annotation", field="args"
            )
        default = ... if param.default is param.empty else param.default
        fields[param.name] = (hints[param.name], default)
    if len(fields) == 1:
        (only, (annotation, _)) = next(iter(fields.items()))
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return annotation, only, wants_call
    model: type[BaseModel] = create_model(
        f"{name}_args", __config__=ConfigDict(extra="forbid"), **fields
    )
    return model, None, wants_call


@overload
def tool(
    fn: Callable[P, R],
    *,
    name: str | None = None,
    risk: Risk | str = Risk.IRREVERSIBLE_EXTERNAL_WRITE,
    description: str | None = None,
    requires_approval: bool = False,
    idempotent: bool = False,
) -> FunctionTool[P, R]: ...


@overload
def tool(
    fn: None = None,
    *,
    name: str | None = None,
    risk: Risk | str = Risk.IRREVERSIBLE_EXTERNAL_WRITE,
    description: str | None = None,
    requires_approval: bool = False,
    idempotent: bool = False,
) -> Callable[[Callable[P, R]], FunctionTool[P, R]]: ...


def tool(
    fn: Callable[P, R] | None = None,
    *,
    name: str | None = None,
    risk: Risk | str = Risk.IRREVERSIBLE_EXTERNAL_WRITE,
    description: str | None = None,
    requires_approval: bool = False,
    idempotent: bool = False,
) -> FunctionTool[P, R] | Callable[[Callable[P, R]], FunctionTool[P, R]]:
    """Declare a function as a tool (see the module docstring). Usable bare (``@tool``)
    or with options. The result is a :class:`FunctionTool` with the function's signature
    (overloads for the two forms, so a type checker sees it too); its ``.lookup`` and
    ``.fence`` attributes are decorators for the optional lookup and fence functions.

    Raises:
        ConfigurationError: a bad name, risk or signature (at declaration).
    """

    def declare(f: Callable[P, R]) -> FunctionTool[P, R]:
        made = FunctionTool(
            f,
            name=name or f.__name__,
            risk=risk,
            description=description if description is not None else (inspect.getdoc(f) or ""),
            requires_approval=requires_approval,
            idempotent=idempotent,
        )
        made.spec  # noqa: B018 - declaration errors surface here, not at first call
        return made

    return declare(fn) if fn is not None else declare
