"""Prefix caching's key: every full block of tokens has a chained hash

    hash(block i) = H(hash(block i-1), token ids of block i, extra keys)      (block -1's hash = root)

with the root derived from the model id and a secret seed (stable across restarts and replicas of one
deployment), and ``("salt", cache_salt)`` as block 0's extra key. H is sha256 by default (a collision would leak
one tenant's text to another), xxh128 as an option.
"""

from __future__ import annotations

import hashlib
import sys
from array import array

import xxhash


class BlockHasher:
    """Chained block hashes: sha256 (default: a collision would leak one tenant's text) or xxh128."""

    def __init__(self, algo: str, model_id: str, seed: str) -> None:
        self._new = {"sha256": hashlib.sha256, "xxh128": xxhash.xxh3_128}[algo]
        h = self._new()
        # length-prefixed: no ambiguous joins
        for part in ("pagedchat-block-root-v1", model_id, seed):
            data = part.encode()
            h.update(len(data).to_bytes(8, "little") + data)
        self.root = h.digest()

    def __call__(self, parent: bytes, token_ids: list[int], extra_keys: tuple = ()) -> bytes:
        h = self._new(parent)
        tokens = array("q", token_ids)
        if sys.byteorder == "big":  # little-endian int64 everywhere: hashes agree across replicas
            tokens.byteswap()
        h.update(tokens.tobytes())
        # tagged tuples such as ("salt", "tenant-a"); repr is canonical for str/int/tuple
        if extra_keys:
            h.update(repr(extra_keys).encode())
        return h.digest()

    def extend(
        self, hashes: list[bytes], token_ids: list[int], block_size: int, cache_salt: str | None
    ) -> None:
        """Extend ``hashes`` (the chain so far) to every full block of ``token_ids``: hash(block i) =
        H(hash(block i-1), tokens of block i, extra keys), block 0's parent the root, its extra key the salt."""
        for i in range(len(hashes), len(token_ids) // block_size):
            parent = hashes[i - 1] if i else self.root
            extra = (("salt", cache_salt),) if i == 0 and cache_salt is not None else ()
            hashes.append(self(parent, token_ids[i * block_size : (i + 1) * block_size], extra))
