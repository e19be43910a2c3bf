"""Canonical JSON bytes, domain-separated digests and strict parsing.

Canonical form: keys sorted, compact separators, UTF-8, no floats at all (digested content
holds integers, strings, booleans, null, lists and objects only). Digests are SHA-256 over
``domain + b"\\x00" + canonical bytes`` so that bytes signed or hashed for one purpose can
never be taken for another (an intent digest is never a receipt fingerprint).

Strict parsing rejects duplicate keys, ``NaN``/``Infinity``, floats, integers outside 64 bits,
lone surrogate escapes and nesting deeper than 64 levels, and for YAML also non-JSON types
(dates, binary, sets), aliases, and plain values that YAML 1.1 and 1.2 read differently
(``on``, ``yes``, ``012``), so that what a person wrote is exactly what is fingerprinted.
Every refusal is one line that starts with where it is (``scenario.budgets.proposals``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

import orjson
import yaml
from pydantic import BaseModel

from ratchet.errors import ContractError

__all__ = [
    "Domain",
    "canonical_json",
    "constant_time_equal",
    "digest",
    "is_canonical",
    "json_path",
    "model_digest",
    "model_json",
    "strict_json_loads",
    "strict_yaml_loads",
]


class Domain:
    """Domain prefixes for every digest and signature ratchet makes."""

    INTENT = b"ratchet/intent/v1"
    RECEIPT = b"ratchet/receipt/v1"
    SCENARIO = b"ratchet/scenario/v1"
    APPROVAL = b"ratchet/approval/v1"
    REVIEW = b"ratchet/review/v1"
    CHECKPOINT = b"ratchet/checkpoint/v1"
    STATE = b"ratchet/state/v1"
    ENVIRONMENT = b"ratchet/environment/v1"
    ARCHIVE = b"ratchet/archive/v1"
    DOCUMENT = b"ratchet/document/v1"
    REBASELINE = b"ratchet/rebaseline/v1"
    CONTROL = b"ratchet/control/v1"
    EXPORT = b"ratchet/export/v1"
    INCIDENT = b"ratchet/incident/v1"
    TOOL = b"ratchet/tool/v1"
    TOOL_OUTPUT = b"ratchet/tool-output/v1"
    PLACEMENT = b"ratchet/placement/v1"


def _reject_floats(value: Any, path: str = "$") -> None:
    if isinstance(value, float):
        raise ContractError(f"floats are not allowed in canonical JSON (at {path})", field=path)
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ContractError(f"object keys must be strings (at {path})", field=path)
            _reject_floats(v, f"{path}.{k}")
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _reject_floats(v, f"{path}[{i}]")


_PLAIN_SCALARS = frozenset({str, int, bool, type(None)})


def _plainly_float_free(value: Any) -> bool:
    """True when ``value`` is built only of exact ``dict`` (exact ``str`` keys), ``list``,
    ``tuple``, ``str``, ``int``, ``bool`` and ``None``.

    A fast, path-free pre-check for :func:`_reject_floats`: when it returns True that walk
    would find nothing (no float anywhere, every key a string), so it may be skipped; on
    anything else (a float, a non-string key, a subclass, a Mapping that is not a dict, a
    non-JSON type) it returns False and the exact walk runs and reports as before. It is
    iterative, so deep nesting cannot exhaust the interpreter stack here.
    """
    scalars = _PLAIN_SCALARS
    stack = [value]
    pop, push = stack.pop, stack.append
    while stack:
        node = pop()
        kind = type(node)
        if kind is dict:
            for key, item in node.items():
                if type(key) is not str:
                    return False
                if type(item) not in scalars:
                    push(item)
        elif kind is list or kind is tuple:
            for item in node:
                if type(item) not in scalars:
                    push(item)
        elif kind not in scalars:
            return False
    return True


def canonical_json(value: Any) -> bytes:
    """Return the canonical bytes of a JSON-compatible value.

    Raises:
        ContractError: the value holds a float, a non-string key or a non-JSON type.
    """
    # Floats are refused before encoding. The common case (plain dicts, lists, strings,
    # integers) is proven float-free by a fast walk; anything else takes the exact walk,
    # which names the path of the offending value.
    if not _plainly_float_free(value):
        _reject_floats(value)
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except TypeError as exc:
        raise ContractError(f"value is not JSON-serialisable: {exc}") from None


def model_json(model: BaseModel) -> bytes:
    """Canonical bytes of a ratchet model.

    Ratchet's persisted models declare no float field anywhere (a unit test walks every
    model's JSON schema to pin that), so their JSON dump needs no float walk: it goes
    straight to the encoder.
    """
    return orjson.dumps(model.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS)


def model_digest(domain: bytes, model: BaseModel) -> str:
    """:func:`digest` of a ratchet model, without the float walk (see :func:`model_json`)."""
    return hashlib.sha256(domain + b"\x00" + model_json(model)).hexdigest()


def is_canonical(data: bytes) -> bool:
    """True when ``data`` is exactly the canonical encoding of the JSON it holds.

    Parsing and re-encoding in C rules out duplicate keys (the re-encoding would be
    shorter), any other key order or spacing, and escapes other than orjson's.
    """
    try:
        return orjson.dumps(orjson.loads(data), option=orjson.OPT_SORT_KEYS) == data
    except (orjson.JSONDecodeError, orjson.JSONEncodeError):
        return False


def digest(domain: bytes, value: Any) -> str:
    """SHA-256 hex digest of ``domain NUL canonical_json(value)``."""
    return hashlib.sha256(domain + b"\x00" + canonical_json(value)).hexdigest()


def constant_time_equal(a: str | bytes, b: str | bytes) -> bool:
    """Compare two digests or MACs in constant time (both str or both bytes)."""
    if isinstance(a, str):
        a = a.encode("utf-8")
    if isinstance(b, str):
        b = b.encode("utf-8")
    return hmac.compare_digest(a, b)


MAX_JSON_DEPTH = 64
_SHOWN = 60  # characters of a refused key or value quoted in an error message
_PATH_SEGMENTS = 12  # path segments an error message names before "..."
_INT_LOW, _INT_HIGH = -(2**63), 2**64 - 1  # the integers canonical JSON (orjson) encodes
_PLAIN_KEY = re.compile(r"^[A-Za-z0-9_@+-][A-Za-z0-9_@+/:-]*$")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _shown(text: str) -> str:
    """``text`` quoted on one line and cut to a readable length."""
    quoted = json.dumps(text)
    return quoted if len(quoted) <= _SHOWN else quoted[: _SHOWN - 4] + '..."'


def json_path(parts: Iterable[str | int]) -> str:
    """A location in a parsed document, on one line: ``scenario.budgets.proposals``,
    ``permissions[0]``, ``$`` for the document itself. A key that is not a plain word is
    quoted; a very deep location is cut after a dozen segments and ends in ``...``."""
    out: list[str] = []
    for count, part in enumerate(parts):
        if count == _PATH_SEGMENTS:
            out.append("...")
            break
        if isinstance(part, int):
            out.append(f"[{part}]")
        else:
            key = part if _PLAIN_KEY.match(part) and len(part) <= _SHOWN else _shown(part)
            out.append(f".{key}" if out else key)
    return "".join(out) or "$"


def _refusal(parts: Iterable[str | int], what: str) -> ContractError:
    path = json_path(parts)
    return ContractError(what if path == "$" else f"{path}: {what}", field=path)


class _Refused:
    """Stands, in a freshly parsed JSON value, for what strict JSON refuses (a float, a
    non-finite number, an object with a duplicate key), so that the walk after the parse
    can say where it was."""

    __slots__ = ("key", "what")

    def __init__(self, what: str, key: str | None = None) -> None:
        self.what = what
        self.key = key


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any] | _Refused:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            return _Refused(f"duplicate key {_shown(key)}", key)
        out[key] = value
    return out


def _no_constants(name: str) -> _Refused:
    return _Refused(f"non-finite number {name} is not allowed")


def _no_floats(text: str) -> _Refused:
    shown = text if len(text) <= _SHOWN else text[:_SHOWN] + "..."
    return _Refused(f"floating-point number {shown} is not allowed")


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


# A container being walked: (value, depth, parent entry, key or index in the parent).
_Entry = tuple[Any, int, Any, "str | int"]


def _where(entry: _Entry | None, *more: str | int) -> list[str | int]:
    parts: list[str | int] = list(reversed(more))
    while entry is not None and entry[2] is not None:
        parts.append(entry[3])
        entry = entry[2]
    return parts[::-1]


def _refuse_leaf(
    entry: _Entry | None, segment: tuple[str | int, ...], item: Any, strings: bool
) -> None:
    if type(item) is _Refused:
        key = () if item.key is None else (item.key,)
        raise _refusal(_where(entry, *segment, *key), item.what)
    if type(item) is int and not _INT_LOW <= item <= _INT_HIGH:
        raise _refusal(_where(entry, *segment), "integer does not fit in 64 bits")
    if strings and type(item) is str and _has_surrogate(item):
        raise _refusal(_where(entry, *segment), "string holds a lone surrogate escape")


def _check_parsed(value: Any, limit: int, *, strings: bool) -> None:
    """Walk a freshly parsed value iteratively (no recursion of our own): arrays and
    objects nest at most ``limit`` deep; nothing refused, no integer outside 64 bits,
    and with ``strings`` no lone surrogate in a key or a string.

    Each stack entry keeps its parent and its key or index, so a path is built only for
    the one item refused.
    """
    _refuse_leaf(None, (), value, strings)
    stack: list[_Entry] = [(value, 1, None, "")]
    while stack:
        entry = stack.pop()
        item, depth = entry[0], entry[1]
        kind = type(item)
        if kind is not dict and kind is not list:
            continue
        if depth > limit:
            raise _refusal(_where(entry), f"JSON nests deeper than {limit} levels")
        pairs: Iterable[tuple[str | int, Any]] = item.items() if kind is dict else enumerate(item)
        for segment, child in pairs:
            child_kind = type(child)
            if child_kind is dict or child_kind is list:
                stack.append((child, depth + 1, entry, segment))
            elif child_kind is _Refused or child_kind is int or strings:
                _refuse_leaf(entry, (segment,), child, strings)
            if strings and kind is dict and _has_surrogate(str(segment)):
                raise _refusal(_where(entry), "key holds a lone surrogate escape")


def strict_json_loads(data: str | bytes, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse JSON rejecting duplicate keys, NaN/Infinity, floats, integers outside 64 bits,
    lone surrogate escapes, and nesting deeper than ``max_depth`` (a deep document must
    never reach a recursive validator or renderer).

    Raises:
        ContractError: the text is not strict JSON. ``field`` says where (a path such as
            ``scenario.budgets.proposals``; ``$`` for the document itself) and the
            one-line message starts with it.
    """
    try:
        value = json.loads(
            data,
            object_pairs_hook=_no_duplicates,
            parse_constant=_no_constants,
            parse_float=_no_floats,
        )
    except RecursionError:
        raise ContractError(f"JSON nests deeper than {max_depth} levels", field="$") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ContractError(f"malformed JSON: {exc}", field="$") from None
    # Only an escape puts a lone surrogate into parsed text, so strings are checked only
    # when the text holds one (a valid pair is checked too, and passes).
    raw = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    _check_parsed(value, max_depth, strings=_SURROGATE_ESCAPE.search(raw) is not None)
    return value


# --- YAML --------------------------------------------------------------------------------------

_AMBIGUOUS_TAG = "tag:ratchet,2024:ambiguous"
_DECIMAL = re.compile(r"^[-+]?(?:0|[1-9][0-9]*)$")


class _YamlRefusal(Exception):  # noqa: N818 - internal; never leaves this module
    """Raised while constructing; each enclosing mapping or sequence adds its key or index
    on the way out, so the error names the full path."""

    def __init__(self, what: str, *path: str | int) -> None:
        super().__init__(what)
        self.what = what
        self.path: list[str | int] = list(path)


class _StrictLoader(yaml.SafeLoader):
    """A YAML loader that keeps to what JSON holds and to one reading of every value.

    Plain scalars resolve as YAML 1.1 and 1.2 agree: ``true``/``false``, decimal integers,
    ``null``. What a YAML 1.1 reader takes for a boolean or a number and a 1.2 reader for
    text (``yes``/``no``/``on``/``off``, ``012``, ``0x1f``, ``1_000``, ``1:30``, ``1e3``,
    the merge key ``<<``) is refused, never guessed: quote it. Floats, dates, binary, sets,
    aliases (so no alias bomb), duplicate and non-string keys are refused, and so is
    nesting deeper than ``max_depth``.
    """

    def __init__(self, stream: str | bytes, max_depth: int = MAX_JSON_DEPTH) -> None:
        super().__init__(stream)
        self.max_depth = max_depth
        self.at: list[str | int] = []  # where composition is; left as it was on a failure

    def compose_node(self, parent: Any, index: Any) -> Any:
        # ``index``: the key node for a mapping value, the position in a sequence, None
        # for a mapping key (and for the document itself, which has no parent).
        if parent is not None:
            self.at.append(
                index
                if isinstance(index, int)
                else str(index.value)
                if isinstance(index, yaml.ScalarNode)
                else "?"
            )
        if self.check_event(yaml.AliasEvent):
            raise _refusal(self.at, "YAML aliases are not allowed; write the value out")
        if (
            self.check_event(yaml.SequenceStartEvent, yaml.MappingStartEvent)
            and len(self.at) >= self.max_depth
        ):
            raise _refusal(self.at, f"YAML nests deeper than {self.max_depth} levels")
        node = super().compose_node(parent, index)
        if parent is not None:
            self.at.pop()
        return node


_StrictLoader.yaml_implicit_resolvers = {}
for _first, _resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items():
    for _tag, _regexp in _resolvers:
        # Floats and dates still resolve, so that they are refused by name, never taken
        # for text.
        if _tag in (
            "tag:yaml.org,2002:float",
            "tag:yaml.org,2002:null",
            "tag:yaml.org,2002:timestamp",
        ):
            _StrictLoader.yaml_implicit_resolvers.setdefault(_first, []).append((_tag, _regexp))
for _tag, _pattern, _firsts in (
    ("tag:yaml.org,2002:bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
    ("tag:yaml.org,2002:int", _DECIMAL.pattern, "-+0123456789"),
    (_AMBIGUOUS_TAG, r"^(?:yes|Yes|YES|no|No|NO|on|On|ON|off|Off|OFF)$", "yYnNoO"),
    (
        _AMBIGUOUS_TAG,
        r"^(?:[-+]?0[0-9_]+|[-+]?0[bBoOxX][0-9a-fA-F_]*"
        r"|[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+|[-+]?[0-9]+_[0-9_]*"
        r"|[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+|<<)$",
        "-+0123456789<",
    ),
):
    _StrictLoader.add_implicit_resolver(_tag, re.compile(_pattern), list(_firsts))


def _nest(loader: _StrictLoader, segment: str | int, node: yaml.Node) -> Any:
    """Construct ``node``, the value at ``segment`` of a mapping or sequence."""
    try:
        return loader.construct_object(node, deep=True)
    except _YamlRefusal as exc:
        exc.path.insert(0, segment)
        raise
    except yaml.YAMLError as exc:
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
        raise _YamlRefusal(problem, segment) from None


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node)
        if not isinstance(key, str):
            raise _YamlRefusal(f"YAML keys must be strings, got {_shown(str(key))}")
        if key in out:
            raise _YamlRefusal(f"duplicate key {_shown(key)}", key)
        out[key] = _nest(loader, key, value_node)
    return out


def _construct_sequence(loader: _StrictLoader, node: yaml.SequenceNode) -> list[Any]:
    return [_nest(loader, index, child) for index, child in enumerate(node.value)]


def _construct_int(loader: _StrictLoader, node: yaml.ScalarNode) -> int:
    text = str(loader.construct_scalar(node))
    if not _DECIMAL.match(text) or len(text) > 21:
        raise _YamlRefusal(f"integer {_shown(text)} is not a 64-bit decimal integer")
    value = int(text)
    if not _INT_LOW <= value <= _INT_HIGH:
        raise _YamlRefusal("integer does not fit in 64 bits")
    return value


def _construct_bool(loader: _StrictLoader, node: yaml.ScalarNode) -> bool:
    text = str(loader.construct_scalar(node))
    if text.lower() not in ("true", "false"):
        raise _YamlRefusal(f"boolean {_shown(text)} is ambiguous; write true or false")
    return text.lower() == "true"


def _construct_str(loader: _StrictLoader, node: yaml.ScalarNode) -> str:
    text = str(loader.construct_scalar(node))
    if _has_surrogate(text):
        raise _YamlRefusal("string holds a lone surrogate escape")
    return text


def _ambiguous(loader: _StrictLoader, node: yaml.ScalarNode) -> Any:
    raise _YamlRefusal(
        f"plain value {_shown(str(node.value))} reads differently in YAML 1.1 "
        "and 1.2; quote it for text, or write true/false or a decimal integer"
    )


def _refuse(loader: _StrictLoader, node: yaml.Node) -> Any:
    raise _YamlRefusal(f"YAML type {node.tag} is not allowed; use plain JSON types")


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, _construct_sequence)
_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SCALAR_TAG, _construct_str)
_StrictLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_StrictLoader.add_constructor("tag:yaml.org,2002:bool", _construct_bool)
_StrictLoader.add_constructor(_AMBIGUOUS_TAG, _ambiguous)
for _tag in (
    "tag:yaml.org,2002:float",
    "tag:yaml.org,2002:timestamp",
    "tag:yaml.org,2002:binary",
    "tag:yaml.org,2002:set",
    "tag:yaml.org,2002:omap",
    "tag:yaml.org,2002:pairs",
    "tag:yaml.org,2002:merge",
    "tag:yaml.org,2002:value",
):
    _StrictLoader.add_constructor(_tag, _refuse)


def strict_yaml_loads(text: str | bytes, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse one YAML document with the strictness of :func:`strict_json_loads` and one
    reading of every plain value (see :class:`_StrictLoader`).

    Raises:
        ContractError: duplicate or non-string keys, floats, dates, integers outside 64
            bits, YAML 1.1 booleans and numbers, aliases, nesting deeper than
            ``max_depth``, or malformed YAML. ``field`` says where, as for JSON, and the
            one-line message starts with it.
    """
    loader = _StrictLoader(text, max_depth)
    try:
        return loader.get_single_data()
    except _YamlRefusal as exc:
        raise _refusal(exc.path, exc.what) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
        raise _refusal(loader.at, f"malformed YAML{where}: {problem}") from None
    except RecursionError:
        raise _refusal(loader.at, f"YAML nests deeper than {max_depth} levels") from None
    finally:
        loader.dispose()
