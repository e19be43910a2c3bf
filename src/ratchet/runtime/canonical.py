"""Canonical JSON bytes, domain-separated digests and strict parsing.

Canonical form: keys sorted, compact separators, UTF-8, no floats at all (digested content
holds integers, strings, booleans, null, lists and objects only). Digests are SHA-256 over
``domain + b"\\x00" + canonical bytes`` so that bytes signed or hashed for one purpose can
never be taken for another (an intent digest is never a receipt fingerprint).

Strict parsing rejects duplicate keys, ``NaN``/``Infinity`` and floats, and for YAML also
duplicate keys and non-JSON types (dates, binary, sets), so that what a person wrote is
exactly what is fingerprinted.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
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


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ContractError(f"duplicate key {key!r}", field=key)
        out[key] = value
    return out


def _no_constants(name: str) -> Any:
    raise ContractError(f"non-finite number {name} is not allowed")


def _no_floats(text: str) -> Any:
    raise ContractError(f"floating-point number {text} is not allowed")


MAX_JSON_DEPTH = 64


def _check_depth(value: Any, limit: int) -> None:
    """Iteratively (no recursion of our own): arrays and objects nest at most ``limit``."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > limit:
                raise ContractError(f"JSON nests deeper than {limit} levels")
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children
                         if isinstance(child, dict | list))


def strict_json_loads(data: str | bytes, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse JSON rejecting duplicate keys, NaN/Infinity, floats, and nesting deeper than
    ``max_depth`` (a deep document must never reach a recursive validator or renderer).

    Raises:
        ContractError: the text is not strict JSON.
    """
    try:
        value = json.loads(
            data,
            object_pairs_hook=_no_duplicates,
            parse_constant=_no_constants,
            parse_float=_no_floats,
        )
    except ContractError:
        raise
    except RecursionError:
        raise ContractError(f"JSON nests deeper than {max_depth} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ContractError(f"malformed JSON: {exc}") from None
    _check_depth(value, max_depth)
    return value


class _StrictLoader(yaml.SafeLoader):
    """A YAML loader that refuses duplicate keys and anything JSON cannot hold."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[str, Any]:
    loader.flatten_mapping(node)
    out: dict[str, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node)
        if not isinstance(key, str):
            raise ContractError(f"YAML keys must be strings, got {key!r}", field=str(key))
        if key in out:
            raise ContractError(f"duplicate key {key!r}", field=key)
        out[key] = loader.construct_object(value_node, deep=True)
    return out


def _refuse(loader: _StrictLoader, node: yaml.Node) -> Any:
    raise ContractError(f"YAML type {node.tag} is not allowed; use plain JSON types")


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
for _tag in (
    "tag:yaml.org,2002:float",
    "tag:yaml.org,2002:timestamp",
    "tag:yaml.org,2002:binary",
    "tag:yaml.org,2002:set",
    "tag:yaml.org,2002:omap",
    "tag:yaml.org,2002:pairs",
):
    _StrictLoader.add_constructor(_tag, _refuse)


def strict_yaml_loads(text: str | bytes) -> Any:
    """Parse one YAML document with the same strictness as :func:`strict_json_loads`.

    Raises:
        ContractError: duplicate keys, floats, NaN, dates or malformed YAML.
    """
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - _StrictLoader is a SafeLoader
    except ContractError:
        raise
    except yaml.YAMLError as exc:
        raise ContractError(f"malformed YAML: {exc}") from None
