"""One KV block as stored below the host: a header, then the block's bytes (K of every layer, then V).

    header = magic "PCKV" | version u32 | key (32 bytes) | payload length u64 | xxh3-128 of the payload (16 bytes)

The key is the block's tier key (engine/kv_tiers/fingerprint.py: its chain hash and everything that shapes its
bytes), so a file renamed or a Redis value copied under another key is refused; the checksum finds a block torn by
a crash or corrupted on disk. A block that fails either check is recomputed, never used.

A payload is handled as its *parts*, buffers in order (on the CPU each layer's K and V of the block, straight in the
KV tensors: read and written without a copy; on CUDA one staging row), so the checksum runs over the parts.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

MAGIC = b"PCKV"
VERSION = 1
HEADER = struct.Struct("<4sI32sQ16s")

Parts = Sequence[memoryview]


class CorruptBlock(ValueError):
    """A stored block that is not what its key says: torn, truncated, corrupted or another block's."""


def payload_size(parts: Parts) -> int:
    return sum(part.nbytes for part in parts)


def checksum(parts: Parts) -> bytes:
    digest = xxhash.xxh3_128()
    for part in parts:
        digest.update(part)
    return digest.digest()


def header(key: bytes, parts: Parts) -> bytes:
    """The header that goes before the payload ``parts`` in their stored form."""
    return HEADER.pack(MAGIC, VERSION, key, payload_size(parts), checksum(parts))


def encode(key: bytes, parts: Parts) -> bytes:
    """The stored form of a block in one piece: header then payload."""
    return b"".join([header(key, parts), *parts])


def check(head: bytes | memoryview, parts: Parts, key: bytes) -> None:
    """CorruptBlock unless ``head`` is the header of ``key``'s block and ``parts`` hold its payload."""
    magic, version, stored_key, size, stored_checksum = HEADER.unpack_from(head)
    if magic != MAGIC or version != VERSION:
        raise CorruptBlock("not a pagedchat KV block of this version")
    if stored_key != key or size != payload_size(parts):
        raise CorruptBlock("the header names another block")
    if checksum(parts) != stored_checksum:
        raise CorruptBlock("checksum mismatch")


def decode_into(data: bytes | memoryview, parts: Parts, key: bytes) -> None:
    """A stored block in one piece (a Redis value) into ``parts``, checked."""
    view = memoryview(data)
    if len(view) != HEADER.size + payload_size(parts):
        raise CorruptBlock(
            f"{len(view)} bytes where {HEADER.size + payload_size(parts)} were expected"
        )
    offset = HEADER.size
    for part in parts:
        part[:] = view[offset : offset + part.nbytes]
        offset += part.nbytes
    check(view, parts, key)
