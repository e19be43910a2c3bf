"""Every Redis key and field name the LangGraph saver uses, spelled once.

All keys of one thread share the hash tag ``{<tag>}`` so that every script touches one
Redis Cluster slot. LangGraph thread ids are free text (a UUID usually, but anything a
caller passes), and a ``{``, ``}``, space or newline in one would break the hash tag or the
key, so the tag is derived:

* a thread id of 1..128 characters from ``[A-Za-z0-9._:@/+=-]`` is used as it is, after
  ``t=`` (``ratchet:lg:{t=3f1c...}:meta``);
* anything else is hashed: ``h=`` and the first 32 hex digits of SHA-256 of its UTF-8
  bytes (``ratchet:lg:{h=9a0b...}:meta``).

The two classes cannot collide (different prefixes), a verbatim id maps to one tag only,
and the original thread id is kept in the ``meta`` hash and inside every signed record, so
a record read through a colliding tag would still fail its binding check.

==================================  ======  ================================================
key (``<T>`` is the tag)            type    holds
==================================  ======  ================================================
``ratchet:lg:{<T>}:meta``           hash    thread_id, generation (the high-water mark),
                                            head (the signed head record), owner,
                                            lease_version, expires_at_ms, acquired_at_ms
``ratchet:lg:{<T>}:heads``          hash    namespace digest -> checkpoint digest (plain
                                            copy of the signed head record, for scripts)
``ratchet:lg:{<T>}:ckpts``          hash    checkpoint digest -> signed checkpoint record
``ratchet:lg:{<T>}:refs``           hash    checkpoint digest -> blob fields it reads
                                            (space separated)
``ratchet:lg:{<T>}:gens``           hash    checkpoint digest -> ``<ns digest>|<generation>``
``ratchet:lg:{<T>}:index``          zset    ``<ns digest>|<generation, 20 digits>|<ckpt
                                            digest>`` (score 0, ordered by lex)
``ratchet:lg:{<T>}:blobs``          hash    blob field -> signed channel value
``ratchet:lg:{<T>}:writes``         hash    ``<ckpt digest>|<write digest>`` -> signed write
``ratchet:lg:{<T>}:windex``         zset    ``<ckpt digest>|<write digest>`` (score 0)
``ratchet:lg:{<T>}:takeovers``      list    the operator takeovers of the thread's lease,
                                            newest first (capped; kept through deletes)
``ratchet:lg:run:<R>``              set     thread ids that stored a checkpoint of run
                                            ``<R>`` (R: digest of the run id); cross-slot,
                                            touched by separate calls only
``ratchet:lg:nonce:<nonce>``        string  which thread and interrupt consumed an approval
                                            nonce (:mod:`ratchet.langgraph.approval`)
==================================  ======  ================================================

Digests are the first 32 hex digits of SHA-256 over a domain prefix and the NUL-separated
parts, so namespaces, checkpoint ids, channel names and versions of any text become fixed,
safe field names.
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass

from ratchet.errors import ContractError
from ratchet.leasing.keyspace import check_id

__all__ = [
    "META_PATTERN",
    "PREFIX",
    "ThreadKeys",
    "blob_field",
    "checkpoint_digest",
    "index_member",
    "meta_tag",
    "namespace_digest",
    "nonce_key",
    "run_index_key",
    "thread_keys",
    "thread_tag",
    "write_digest",
]

PREFIX = "ratchet:lg"
_VERBATIM = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")
# SCAN MATCH pattern of every thread's meta hash (a glob: ``{`` and ``}`` are literal), and
# the exact shape a matched key must have to be one (the glob alone also matches more).
META_PATTERN = "ratchet:lg:{*}:meta"
_META_KEY = re.compile(r"ratchet:lg:\{(t=[A-Za-z0-9._:@/+=-]{1,128}|h=[0-9a-f]{32})\}:meta")
_GEN_WIDTH = 20


def _digest(kind: str, *parts: str) -> str:
    data = ("ratchet/lg/" + kind + "\x00" + "\x00".join(parts)).encode("utf-8")
    return hashlib.sha256(data).hexdigest()[:32]


def thread_tag(thread_id: str) -> str:
    """The hash-tag text for ``thread_id``. Raises ContractError for an empty or non-str id."""
    if not isinstance(thread_id, str) or not thread_id:
        raise ContractError("thread_id must be a non-empty string", field="thread_id")
    if _VERBATIM.fullmatch(thread_id):
        return "t=" + thread_id
    return "h=" + _digest("thread", thread_id)


@dataclass(frozen=True, slots=True)
class ThreadKeys:
    """The keys of one thread; all share the hash tag ``{<tag>}``."""

    thread_id: str
    tag: str
    meta: str
    heads: str
    ckpts: str
    refs: str
    gens: str
    index: str
    blobs: str
    writes: str
    windex: str
    takeovers: str


@functools.lru_cache(maxsize=4096)
def thread_keys(thread_id: str) -> ThreadKeys:
    """The keys of ``thread_id`` (cached). Raises ContractError for an invalid id."""
    tag = thread_tag(thread_id)
    base = f"{PREFIX}:{{{tag}}}"
    return ThreadKeys(
        thread_id=thread_id,
        tag=tag,
        meta=f"{base}:meta",
        heads=f"{base}:heads",
        ckpts=f"{base}:ckpts",
        refs=f"{base}:refs",
        gens=f"{base}:gens",
        index=f"{base}:index",
        blobs=f"{base}:blobs",
        writes=f"{base}:writes",
        windex=f"{base}:windex",
        takeovers=f"{base}:takeovers",
    )


def meta_tag(key: str) -> str | None:
    """The tag of a thread's meta hash key (``t=<id>`` or ``h=<32 hex>``), or None when
    ``key`` is not one (a key :data:`META_PATTERN` matched that the saver did not make)."""
    found = _META_KEY.fullmatch(key)
    return found.group(1) if found else None


def namespace_digest(checkpoint_ns: str) -> str:
    """Field-safe digest of a checkpoint namespace ("" is the root namespace)."""
    return _digest("ns", checkpoint_ns)


def checkpoint_digest(checkpoint_ns: str, checkpoint_id: str) -> str:
    """Field-safe digest of one checkpoint of a thread."""
    return _digest("ckpt", checkpoint_ns, checkpoint_id)


def blob_field(checkpoint_ns: str, channel: str, version: str) -> str:
    """Field of one channel value; ``version`` is the version's key text (see records)."""
    return _digest("blob", checkpoint_ns, channel, version)


def write_digest(task_id: str, idx: int) -> str:
    """Digest of one pending write slot (task id and index) of a checkpoint."""
    return _digest("write", task_id, str(idx))


def index_member(ns_digest: str, generation: int, ckpt_digest: str) -> str:
    """The lex-ordered index entry of a checkpoint."""
    return f"{ns_digest}|{generation:0{_GEN_WIDTH}d}|{ckpt_digest}"


def run_index_key(run_id: str) -> str:
    """The cross-slot set of thread ids that stored checkpoints of LangGraph run ``run_id``."""
    return f"{PREFIX}:run:{_digest('run', run_id)}"


def nonce_key(nonce: str) -> str:
    """The global record of an approval nonce consumed through the saver. Raises ContractError."""
    check_id(nonce, "nonce")
    return f"{PREFIX}:nonce:{nonce}"
