"""How a checkpoint is stored in Redis: a zstd frame of the signed envelope, or as it is.

A checkpoint envelope carries the run's whole evidence (trace, receipts), so it grows with
the run, and every commit sends and fsyncs all of it. Stored compressed (zstd level 1, a
few tens of microseconds), a commit carries several times fewer bytes to Redis, its AOF
and its replicas. Small envelopes (under :data:`COMPRESS_MIN_BYTES`) and ones that do not
shrink by an eighth are stored as they are. The encoding is a storage detail below the
signature:

* the HMAC, the checksum and the commit's digest (history entries, ``already_applied``,
  drill acks) are all over the *envelope*, never over the stored bytes;
* an envelope starts with ``{`` and a zstd frame with its magic number, so a reader tells
  them apart by the first bytes, and runs stored either way (or by an older version) read
  back the same;
* the size cap applies to the envelope, before compression.

Reading fails closed in one place: a frame that does not decompress, has no recorded
content size, or would decompress past the cap is handed on as stored, and restore
refuses it (``CheckpointError``, reason ``malformed``) like any other damaged checkpoint,
so the run's incident keeps the evidence.
"""

from __future__ import annotations

import threading

import zstandard

__all__ = ["COMPRESS_MIN_BYTES", "ZSTD_MAGIC", "decode_checkpoint", "encode_checkpoint"]

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
LEVEL = 1
# Below this an envelope is stored as it is: a few KiB take one or two pages of the AOF
# either way, so compressing costs CPU (scarce when many workers share a host) and saves
# no fsync time. Measured: 4.5 KB checkpoints commit no faster compressed; 11 KB ones
# commit in pairs about 1.6x faster (benchmarks, BENCHMARKS.md).
COMPRESS_MIN_BYTES = 8192

_local = threading.local()  # zstd (de)compressor objects are not safe to share by threads


def _compressor() -> zstandard.ZstdCompressor:
    found: zstandard.ZstdCompressor | None = getattr(_local, "compressor", None)
    if found is None:
        found = zstandard.ZstdCompressor(level=LEVEL, write_checksum=True, write_content_size=True)
        _local.compressor = found
    return found


def _decompressor() -> zstandard.ZstdDecompressor:
    found: zstandard.ZstdDecompressor | None = getattr(_local, "decompressor", None)
    if found is None:
        found = zstandard.ZstdDecompressor()
        _local.decompressor = found
    return found


def encode_checkpoint(
    envelope: bytes, *, compress: bool, min_bytes: int = COMPRESS_MIN_BYTES
) -> bytes:
    """The bytes to store for ``envelope``: a zstd frame when ``compress`` is on, the
    envelope is at least ``min_bytes`` long and the frame saves at least an eighth;
    otherwise the envelope as it is."""
    if not compress or len(envelope) < min_bytes:
        return envelope
    frame = _compressor().compress(envelope)
    return frame if len(frame) <= len(envelope) - len(envelope) // 8 else envelope


def decode_checkpoint(stored: bytes, *, max_bytes: int) -> bytes:
    """The envelope behind ``stored`` (see the module docstring for what fails closed)."""
    if not stored.startswith(ZSTD_MAGIC):
        return stored
    try:
        size = zstandard.frame_content_size(stored)
    except zstandard.ZstdError:
        return stored
    if size < 0 or size > max_bytes:
        return stored
    try:
        envelope = _decompressor().decompress(stored)
    except zstandard.ZstdError:
        return stored
    if len(envelope) != size:
        return stored
    return envelope
