"""Independent reference for the block manager's specification: the documented hash chain, a model of the
KV cache contents (which token each slot holds), and the bookkeeping invariants of the block pool.

Nothing here calls the code under test to compute an expected value; it only reads the manager's state.
"""
from __future__ import annotations

import hashlib
import struct

import xxhash

from engine.block_manager import BlockManager
from engine.sequence import Sequence

ROOT_TAG = "pagedchat-block-root-v1"

# ---------------------------------------------------------------- the documented hash chain, by hand
#
#   root          = H(len|"pagedchat-block-root-v1" | len|model_id | len|seed)   (len: 8-byte little endian)
#   hash(block 0) = H(root          | token ids as int64 little endian | repr((("salt", salt),)) if salted)
#   hash(block i) = H(hash(block i-1) | token ids as int64 little endian)


def digest(algo: str, data: bytes) -> bytes:
    if algo == "sha256":
        return hashlib.sha256(data).digest()
    assert algo == "xxh128"
    return xxhash.xxh3_128_digest(data)


def reference_root(algo: str, model_id: str, seed: str) -> bytes:
    data = b""
    for part in (ROOT_TAG, model_id, seed):
        raw = part.encode("utf-8")
        data += struct.pack("<Q", len(raw)) + raw
    return digest(algo, data)


def reference_block_hash(algo: str, parent: bytes, tokens: list[int], salt: str | None = None) -> bytes:
    data = parent + struct.pack(f"<{len(tokens)}q", *tokens)
    if salt is not None:
        data += ("(('salt', " + repr(salt) + "),)").encode()  # the tagged tuple, spelled out
    return digest(algo, data)


def reference_chain(algo: str, root: bytes, tokens: list[int], salt: str | None, block_size: int) -> list[bytes]:
    hashes, parent = [], root
    for i in range(len(tokens) // block_size):
        parent = reference_block_hash(algo, parent, tokens[i * block_size : (i + 1) * block_size],
                                      salt if i == 0 else None)
        hashes.append(parent)
    return hashes


class ReferenceHashes:
    """Memoised reference chain; remembers, for every hash it produced, the (salt, token prefix) behind it."""

    def __init__(self, algo: str, model_id: str, seed: str, block_size: int) -> None:
        self.algo, self.block_size = algo, block_size
        self.root = reference_root(algo, model_id, seed)
        self.origin: dict[bytes, tuple[str | None, tuple[int, ...]]] = {}

    def chain(self, tokens: list[int], salt: str | None) -> list[bytes]:
        bs, hashes, parent = self.block_size, [], self.root
        for i in range(len(tokens) // bs):
            key = (salt, tuple(tokens[: (i + 1) * bs]))
            parent = reference_block_hash(self.algo, parent, tokens[i * bs : (i + 1) * bs], salt if i == 0 else None)
            assert self.origin.setdefault(parent, key) == key, "hash collision between different prefixes"
            hashes.append(parent)
        return hashes

    def block_tokens(self, block_hash: bytes) -> list[int]:
        """The token ids of the block that ``block_hash`` names (its prefix's last block_size tokens)."""
        return list(self.origin[block_hash][1][-self.block_size :])


# ---------------------------------------------------------------- KV contents model

KV = dict[int, list]  # block id -> the token id whose KV each slot holds (None: never written)


def with_copies(kv: KV, copies: list[tuple[int, int]]) -> KV:
    """The cache after copy-on-write copies (src, dst), applied in order before the next forward pass."""
    view = dict(kv)
    for src, dst in copies:
        view[dst] = list(view[src])
    return view


def kv_tokens(kv: KV, seq: Sequence, block_size: int) -> list:
    """What the attention kernel reads for ``seq``: slot of token i = table[i // bs] * bs + i % bs."""
    return [kv[seq.block_table[i // block_size]][i % block_size] for i in range(seq.num_computed_tokens)]


# ---------------------------------------------------------------- bookkeeping invariants


def snapshot(bm: BlockManager, seqs: list[Sequence]) -> tuple:
    """Everything an allocation may change; equal snapshots mean no state change."""
    pool = bm.pool
    return (
        [(b.block_id, b.ref_count, b.block_hash) for b in pool.blocks],
        list(pool.free_queue),
        {h: b.block_id for h, b in pool.cached.items()},
        pool.num_evictions, bm.prefix_queries, bm.prefix_hits, list(bm.pending_copies),
        sorted(bm.holders),
        [(s.seq_id, list(s.block_table), s.num_computed_tokens, s.num_registered_blocks) for s in seqs],
    )


def check_pool(bm: BlockManager, seqs: list[Sequence]) -> None:
    pool, bs = bm.pool, bm.block_size
    assert [b.block_id for b in pool.blocks] == list(range(bm.num_blocks))
    refs = [0] * bm.num_blocks
    for seq in seqs:
        assert len(set(seq.block_table)) == len(seq.block_table), f"block twice in seq {seq.seq_id}'s table"
        for block_id in seq.block_table:
            refs[block_id] += 1
        # (a swapped-out sequence's computed tokens are in its host blocks)
        assert (len(seq.block_table) + len(seq.host_blocks)) * bs >= seq.num_computed_tokens
    for block_ids in bm.pins.values():  # a pin holds one reference to each of its blocks
        for block_id in block_ids:
            refs[block_id] += 1
    assert [b.ref_count for b in pool.blocks] == refs, "ref counts differ from the block tables"
    for block_id, block in pool.free_queue.items():
        assert block is pool.blocks[block_id]
    free, referenced = set(pool.free_queue), {i for i, r in enumerate(refs) if r > 0}
    assert free.isdisjoint(referenced), "a block is both free and referenced"
    assert free | referenced == set(range(bm.num_blocks)), "a block is neither free nor referenced"
    assert bm.num_free_blocks + len(referenced) == bm.num_blocks
    for block_hash, block in pool.cached.items():
        assert block.block_hash == block_hash
    hashed = [b for b in pool.blocks if b.block_hash is not None]
    assert all(pool.cached.get(b.block_hash) is b for b in hashed)
    assert len(hashed) == len(pool.cached)
    assert bm.holders == {s.seq_id: s for s in seqs if s.block_table}


def check_contents(bm: BlockManager, seqs: list[Sequence], kv: KV, ref: ReferenceHashes) -> None:
    """A sequence reads its own tokens; a cached block holds the tokens its hash was computed from."""
    bs = bm.block_size
    for seq in seqs:
        assert kv_tokens(kv, seq, bs) == seq.token_ids[: seq.num_computed_tokens], f"seq {seq.seq_id} reads foreign KV"
        chain = ref.chain(seq.token_ids, seq.cache_salt)
        assert seq.block_hashes == chain[: len(seq.block_hashes)], "block hashes differ from the documented chain"
        for i, block_id in enumerate(seq.block_table):
            block_hash = bm.pool.blocks[block_id].block_hash
            if block_hash is not None:  # a hashed block in a table is that sequence's block for those tokens
                assert i < seq.num_computed_tokens // bs and block_hash == chain[i]
    for block_hash, block in bm.pool.cached.items():
        assert block_hash in ref.origin, "cached hash not produced by the documented chain of any sequence"
        assert kv[block.block_id] == ref.block_tokens(block_hash), "a prefix hit would serve wrong tokens"
