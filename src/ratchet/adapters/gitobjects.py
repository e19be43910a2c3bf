"""A git repository's objects, read as data: loose or packed, capped, their ids checked.

Part of :mod:`ratchet.adapters.gitread` (which reads HEAD, the index and the status):
every file is opened under :class:`~ratchet.adapters.ground.Ground`'s rules, every
object is inflated to at most its declared size (and at most :data:`MAX_OBJECT_BYTES`),
a delta's declared result size is checked before dulwich applies it, and every object's
id is checked against its bytes. Pack indexes are parsed by dulwich from bytes, never
mapped (a file truncated under a mapping would kill the reader with SIGBUS).
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import stat
import zlib

from dulwich.object_format import SHA1
from dulwich.objects import parse_tree
from dulwich.pack import PackIndex, apply_delta, load_pack_index_file

from ratchet.adapters.ground import Ground
from ratchet.errors import AdapterError

__all__ = [
    "GIT_DIR",
    "HEX",
    "MAX_OBJECT_BYTES",
    "TREE_MODE",
    "ObjectStore",
    "corrupt",
    "stat_key",
    "unsupported",
]

GIT_DIR = ".git"
MAX_OBJECT_BYTES = 32 << 20
MAX_PACK_INDEX_BYTES = 512 << 20
TREE_MODE = 0o040000
_MAX_DELTA_DEPTH = 64
HEX = re.compile(rb"^[0-9a-f]{40}$")
_TYPES = {1: b"commit", 2: b"tree", 3: b"blob", 4: b"tag"}
_OFS_DELTA, _REF_DELTA = 6, 7


def unsupported(message: str, **context: object) -> AdapterError:
    """A repository this reader does not read (``reason="git"``), never retryable."""
    return AdapterError(
        f"the workspace's git repository {message}", retryable=False, reason="git", **context
    )


def corrupt(message: str, **context: object) -> AdapterError:
    """Bytes that do not read as git (``reason="git_corrupt"``), never retryable."""
    return AdapterError(
        f"the workspace's git repository cannot be read: {message}",
        retryable=False,
        reason="git_corrupt",
        **context,
    )


def stat_key(info: os.stat_result) -> tuple[int, int, int, int, int]:
    """What a cached reading of a file is keyed by: it changes whenever the file does."""
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


class ObjectStore:
    """The objects under ``.git/objects`` of the repository at ``ground``'s root (no
    alternates are read). Caches parsed pack indexes (by their ``stat``) and trees (an id
    names its bytes).

    Raises (every method): AdapterError (``reason="git_corrupt"``), UntrustedGroundError.
    """

    def __init__(self, ground: Ground) -> None:
        self.ground = ground
        self._packs: dict[str, tuple[tuple[int, int, int, int, int], PackIndex]] = {}
        self._trees: dict[str, dict[str, tuple[int, str]]] = {}

    def _git(self, rel: str) -> str:
        return f"{GIT_DIR}/{rel}"

    def read_object(self, hexsha: str, *, _depth: int = 0) -> tuple[bytes, bytes]:
        """``(type, body)`` of object ``hexsha`` (loose or packed), its id checked.

        Raises:
            AdapterError: missing, corrupt, or larger than the cap.
        """
        if not HEX.match(hexsha.encode()):
            raise corrupt("an object id is malformed")
        loose = self.ground.read(
            self._git(f"objects/{hexsha[:2]}/{hexsha[2:]}"), limit=MAX_OBJECT_BYTES
        )
        if loose is not None:
            kind, body = self._inflate_loose(loose, hexsha)
        else:
            kind, body = self._packed(hexsha, _depth)
        actual = hashlib.sha1(
            kind + b" %d\x00" % len(body) + body, usedforsecurity=False
        ).hexdigest()
        if actual != hexsha:
            raise corrupt("an object does not match its id", object=hexsha)
        return kind, body

    def _inflate_loose(self, data: bytes, hexsha: str) -> tuple[bytes, bytes]:
        inflater = zlib.decompressobj()
        try:
            raw = inflater.decompress(data, MAX_OBJECT_BYTES + 64)
        except zlib.error:
            raise corrupt("a loose object does not inflate", object=hexsha) from None
        if inflater.unconsumed_tail:
            raise _too_big(hexsha)
        header, sep, body = raw.partition(b"\x00")
        kind, _, size = header.partition(b" ")
        if not sep or not size.isdigit() or int(size) != len(body):
            raise corrupt("a loose object's header is malformed", object=hexsha)
        return kind, body

    def _pack_indexes(self) -> list[tuple[str, PackIndex]]:
        found: list[tuple[str, PackIndex]] = []
        pack_dir = self._git("objects/pack")
        for rel, info in self.ground.walk(pack_dir):
            name = rel.rsplit("/", 1)[-1]
            if "/" in rel[len(pack_dir) + 1 :] or not stat.S_ISREG(info.st_mode):
                continue
            if not (name.startswith("pack-") and name.endswith(".idx")):
                continue
            key = stat_key(info)
            cached = self._packs.get(rel)
            if cached is None or cached[0] != key:
                data = self.ground.read(rel, limit=MAX_PACK_INDEX_BYTES)
                if data is None:
                    continue
                try:
                    # From bytes, never mapped: a file truncated under a mapping would
                    # kill the reader with SIGBUS. Closing drops only the BytesIO.
                    index = load_pack_index_file(rel, io.BytesIO(data), SHA1)
                    index.close()
                except Exception:
                    raise corrupt("a pack index is malformed", pack=name) from None
                cached = (key, index)
                self._packs[rel] = cached
            found.append((rel[: -len(".idx")] + ".pack", cached[1]))
        return found

    def _packed(self, hexsha: str, depth: int) -> tuple[bytes, bytes]:
        for pack, index in self._pack_indexes():
            try:
                offset = index.object_offset(hexsha.encode())  # type: ignore[arg-type]
            except KeyError:
                continue
            if offset is None:
                continue
            return self._pack_entry(pack, int(offset), depth)
        raise corrupt("an object is missing", object=hexsha)

    def _pack_entry(self, pack: str, offset: int, depth: int) -> tuple[bytes, bytes]:
        if depth > _MAX_DELTA_DEPTH:
            raise corrupt("a delta chain is too long", pack=pack)
        with self.ground.open(pack) as opened:
            if opened is None:
                raise corrupt("a pack file is missing", pack=pack)
            fd, _ = opened
            head = os.pread(fd, 64, offset)
            if not head:
                raise corrupt("a pack offset is past the end", pack=pack)
            pos = 0
            byte = head[pos]
            kind = (byte >> 4) & 7
            size = byte & 0x0F
            shift = 4
            while byte & 0x80:
                pos += 1
                if pos >= len(head) or shift > 60:
                    raise corrupt("a pack entry header is malformed", pack=pack)
                byte = head[pos]
                size |= (byte & 0x7F) << shift
                shift += 7
            pos += 1
            base: tuple[bytes, bytes] | None = None
            if kind == _OFS_DELTA:
                byte = head[pos]
                rel_offset = byte & 0x7F
                while byte & 0x80:
                    pos += 1
                    if pos >= len(head):
                        raise corrupt("a pack delta offset is malformed", pack=pack)
                    byte = head[pos]
                    rel_offset = ((rel_offset + 1) << 7) | (byte & 0x7F)
                pos += 1
                if rel_offset <= 0 or rel_offset > offset:
                    raise corrupt("a pack delta offset is out of range", pack=pack)
                base = self._pack_entry(pack, offset - rel_offset, depth + 1)
            elif kind == _REF_DELTA:
                base_id = head[pos : pos + 20].hex()
                pos += 20
                base = self.read_object(base_id, _depth=depth + 1)
            elif kind not in _TYPES:
                raise corrupt("a pack entry has an unknown type", pack=pack)
            if size > MAX_OBJECT_BYTES:
                raise _too_big(f"{pack}@{offset}")
            data = _inflate_at(fd, offset + pos, size, pack)
        if base is None:
            return _TYPES[kind], data
        target = _delta_target_size(data, pack)
        if target > MAX_OBJECT_BYTES:
            raise _too_big(f"{pack}@{offset}")
        try:
            out = apply_delta(base[1], data)
        except Exception:
            raise corrupt("a pack delta does not apply", pack=pack) from None
        body = b"".join(out) if isinstance(out, list) else bytes(out)
        if len(body) != target:
            raise corrupt("a pack delta's result has the wrong size", pack=pack)
        return base[0], body

    def tree(self, tree_id: str) -> dict[str, tuple[int, str]]:
        """``{name: (mode, id)}`` of tree ``tree_id`` (cached: an id names its bytes)."""
        cached = self._trees.get(tree_id)
        if cached is not None:
            return cached
        kind, body = self.read_object(tree_id)
        if kind != b"tree":
            raise corrupt("an object named as a tree is not one", object=tree_id)
        try:
            entries = {
                name.decode("utf-8", "surrogateescape"): (mode, sha.decode())
                for name, mode, sha in parse_tree(body, 20)
            }
        except Exception:
            raise corrupt("a tree is malformed", object=tree_id) from None
        if len(self._trees) > 4096:
            self._trees.clear()
        self._trees[tree_id] = entries
        return entries

    def commit_tree(self, commit_id: str) -> str:
        """The root tree id of commit ``commit_id``."""
        kind, body = self.read_object(commit_id)
        if kind != b"commit" or not body.startswith(b"tree ") or len(body) < 45:
            raise corrupt("HEAD does not name a commit", object=commit_id)
        tree_id = body[5:45]
        if not HEX.match(tree_id):
            raise corrupt("a commit's tree id is malformed", object=commit_id)
        return tree_id.decode()


def _inflate_at(fd: int, start: int, size: int, pack: str) -> bytes:
    """Inflate the zlib stream at ``start`` of the open pack ``fd`` to exactly ``size``
    bytes, never producing more than one byte past that."""
    inflater = zlib.decompressobj()
    out = bytearray()
    pos = start
    while not inflater.eof:
        data = inflater.unconsumed_tail
        if not data:
            data = os.pread(fd, 1 << 16, pos)
            if not data:
                raise corrupt("a pack entry is cut off", pack=pack)
            pos += len(data)
        try:
            out += inflater.decompress(data, size + 1 - len(out))
        except zlib.error:
            raise corrupt("a pack entry does not inflate", pack=pack) from None
        if len(out) > size:
            raise corrupt("a pack entry is larger than it says", pack=pack)
    if len(out) != size:
        raise corrupt("a pack entry is not the size it says", pack=pack)
    return bytes(out)


def _delta_target_size(delta: bytes, pack: str) -> int:
    """The result size a delta declares (its second varint)."""
    pos = 0
    values: list[int] = []
    for _ in range(2):
        value = shift = 0
        while True:
            if pos >= len(delta) or shift > 63:
                raise corrupt("a pack delta header is malformed", pack=pack)
            byte = delta[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        values.append(value)
    return values[1]


def _too_big(what: str) -> AdapterError:
    return corrupt(f"an object is larger than {MAX_OBJECT_BYTES} bytes", object=what)
