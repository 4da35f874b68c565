"""A block's key below the host: its chain hash (engine/core/block_hash.py: the tokens up to it, the model id, the
deployment's seed and the tenant's salt) joined with a fingerprint of everything else that shapes its bytes, so a
stored block is only ever read back by an engine that would have computed the same bytes:

    key = sha256(fingerprint | chain hash)
    fingerprint = sha256(the weights' files (path, size, modification time) or dummy weights' architecture and seed,
                         dtype, KV dtype, block size, KV layout, weight format, CPU kernel level, torch's version)
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path


def fingerprint(parts: Mapping[str, object]) -> bytes:
    """The fingerprint of ``parts`` (names and values with a canonical repr: str, int, tuple)."""
    return hashlib.sha256(repr(sorted(parts.items())).encode()).digest()


def tier_key(fingerprint_bytes: bytes, block_hash: bytes) -> bytes:
    return hashlib.sha256(fingerprint_bytes + block_hash).digest()


def files_identity(path: str | None) -> tuple:
    """What identifies the weights at ``path`` without reading them: each file's name, size and modification time
    (a re-downloaded file becomes another model for the tiers: its blocks are recomputed once)."""
    if path is None:
        return ()
    root = Path(path)
    files = [root] if root.is_file() else sorted(p for p in root.iterdir() if p.is_file())
    identity = []
    for file in files:
        stat = file.stat()
        identity.append((str(file.resolve()), stat.st_size, stat.st_mtime_ns))
    return tuple(identity)
