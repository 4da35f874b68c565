"""One KV block as stored below the host: a header, then the block's bytes (K then V of every layer).

    header = magic "PCKV" | version u32 | key (32 bytes) | payload length u64 | xxh3-128 of the payload (16 bytes)

The key is the block's tier key (engine/kv_tiers/fingerprint.py: its chain hash and everything that shapes its
bytes), so a file renamed or a Redis value copied under another key is refused; the checksum finds a block torn by
a crash or corrupted on disk. A block that fails either check is recomputed, never used.
"""

from __future__ import annotations

import struct

import xxhash

MAGIC = b"PCKV"
VERSION = 1
HEADER = struct.Struct("<4sI32sQ16s")


class CorruptBlock(ValueError):
    """A stored block that is not what its key says: torn, truncated, corrupted or another block's."""


def encode(key: bytes, payload: bytes | memoryview) -> bytes:
    """The stored form of a block: header then payload."""
    checksum = xxhash.xxh3_128_digest(payload)
    return HEADER.pack(MAGIC, VERSION, key, len(payload), checksum) + bytes(payload)


def decode(data: bytes | memoryview, key: bytes, payload_size: int) -> memoryview:
    """The payload of a stored block, checked against its ``key``, the expected size and its checksum."""
    view = memoryview(data)
    if len(view) != HEADER.size + payload_size:
        raise CorruptBlock(f"{len(view)} bytes where {HEADER.size + payload_size} were expected")
    magic, version, stored_key, size, checksum = HEADER.unpack_from(view)
    if magic != MAGIC or version != VERSION:
        raise CorruptBlock("not a pagedchat KV block of this version")
    if stored_key != key or size != payload_size:
        raise CorruptBlock("the header names another block")
    payload = view[HEADER.size :]
    if xxhash.xxh3_128_digest(payload) != checksum:
        raise CorruptBlock("checksum mismatch")
    return payload
