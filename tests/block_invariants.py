"""Independent reference for the block manager's specification: the documented hash chain, a model of the
KV cache contents (which token each slot holds), and the bookkeeping invariants of the block pool.

Nothing here calls the code under test to compute an expected value; it only reads the manager's state.
"""

from __future__ import annotations

import hashlib
import struct

import xxhash

from engine.core.block_manager import BlockManager
from engine.core.tier_blocks import TierBlocks
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


def reference_block_hash(
    algo: str, parent: bytes, tokens: list[int], salt: str | None = None
) -> bytes:
    data = parent + struct.pack(f"<{len(tokens)}q", *tokens)
    if salt is not None:
        data += ("(('salt', " + repr(salt) + "),)").encode()  # the tagged tuple, spelled out
    return digest(algo, data)


def reference_chain(
    algo: str, root: bytes, tokens: list[int], salt: str | None, block_size: int
) -> list[bytes]:
    hashes, parent = [], root
    for i in range(len(tokens) // block_size):
        parent = reference_block_hash(
            algo, parent, tokens[i * block_size : (i + 1) * block_size], salt if i == 0 else None
        )
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
            parent = reference_block_hash(
                self.algo, parent, tokens[i * bs : (i + 1) * bs], salt if i == 0 else None
            )
            assert self.origin.setdefault(parent, key) == key, (
                "hash collision between different prefixes"
            )
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


def with_pending(
    kv: KV,
    host_kv: KV,
    swap_out: list[tuple[int, int]],
    copies: list[tuple[int, int]],
    swap_in: list[tuple[int, int]],
) -> tuple[KV, KV]:
    """(device, host) contents after one step's copies, in the documented order: every swap-out (device block ->
    host slot, host-tier stores included), then every swap-in (host slot -> device block, host-tier restores
    included), then the copy-on-write copies (which may read a block swapped in). Pure: the inputs are not
    changed."""
    dev, host = dict(kv), dict(host_kv)
    for block_id, slot in swap_out:
        host[slot] = list(dev[block_id])
    for slot, block_id in swap_in:
        dev[block_id] = list(host[slot])
    for src, dst in copies:
        dev[dst] = list(dev[src])
    return dev, host


def kv_tokens(kv: KV, seq: Sequence, block_size: int) -> list:
    """What the attention kernel reads for ``seq``: slot of token i = table[i // bs] * bs + i % bs."""
    return [
        kv[seq.block_table[i // block_size]][i % block_size] for i in range(seq.num_computed_tokens)
    ]


# ---------------------------------------------------------------- bookkeeping invariants


def snapshot(bm: BlockManager, seqs: list[Sequence]) -> tuple:
    """Everything an allocation may change; equal snapshots mean no state change."""
    pool = bm.pool
    return (
        [(b.block_id, b.ref_count, b.block_hash) for b in pool.blocks],
        list(pool.free_queue),
        list(pool.kept_queue),
        {h: b.block_id for h, b in pool.cached.items()},
        pool.num_evictions,
        bm.lookups.queries,
        bm.lookups.hits,
        list(bm.pending_copies),
        sorted(bm.holders),
        [
            (
                s.seq_id,
                list(s.block_table),
                s.num_computed_tokens,
                s.num_registered_blocks,
                list(s.host_blocks),
            )
            for s in seqs
        ],
        bm.lookups.host_hits,
        list(bm.pending_swap_out),
        list(bm.pending_swap_in),
        list(bm.host.free),
        list(bm.host.freed_this_step),
        host_cache_state(bm),
    )


def host_cache_state(bm: BlockManager) -> tuple | None:
    hc = bm.host_cache
    if hc is None:
        return None
    return (
        list(hc.entries.items()),
        list(hc.free),
        sorted(hc.busy),
        list(hc.freed_this_step),
        hc.num_stored,
        hc.num_restored,
        hc.num_dropped,
    )


def check_pool(bm: BlockManager, seqs: list[Sequence], tiers: TierBlocks | None = None) -> None:
    pool, bs = bm.pool, bm.block_size
    assert [b.block_id for b in pool.blocks] == list(range(bm.num_blocks))
    refs = [0] * bm.num_blocks
    for seq in seqs:
        assert len(set(seq.block_table)) == len(seq.block_table), (
            f"block twice in seq {seq.seq_id}'s table"
        )
        for block_id in seq.block_table:
            refs[block_id] += 1
        # (a swapped-out sequence's computed tokens are in its host blocks)
        assert (len(seq.block_table) + len(seq.host_blocks)) * bs >= seq.num_computed_tokens
    for block_ids in bm.pins.values():  # a pin holds one reference to each of its blocks
        for block_id in block_ids:
            refs[block_id] += 1
    for block_id in tiers.held_blocks() if tiers is not None else ():  # (saved or loaded now)
        refs[block_id] += 1
    assert [b.ref_count for b in pool.blocks] == refs, "ref counts differ from the block tables"
    for block_id, block in [*pool.free_queue.items(), *pool.kept_queue.items()]:
        assert block is pool.blocks[block_id]
    assert set(pool.free_queue).isdisjoint(pool.kept_queue), "a block in both free queues"
    assert all(b.block_hash is not None for b in pool.kept_queue.values()), "an unhashed kept block"
    free = {b.block_id for b in pool.free_blocks()}
    referenced = {i for i, r in enumerate(refs) if r > 0}
    assert free.isdisjoint(referenced), "a block is both free and referenced"
    assert free | referenced == set(range(bm.num_blocks)), "a block is neither free nor referenced"
    assert bm.num_free_blocks + len(referenced) == bm.num_blocks
    for block_hash, block in pool.cached.items():
        assert block.block_hash == block_hash
    hashed = [b for b in pool.blocks if b.block_hash is not None]
    assert all(pool.cached.get(b.block_hash) is b for b in hashed)
    assert len(hashed) == len(pool.cached)
    assert bm.holders == {s.seq_id: s for s in seqs if s.block_table}
    if bm.window is not None:
        check_window_pool(bm.window, seqs)


def check_window_pool(window, seqs: list[Sequence]) -> None:
    """The sliding-window layers' pool (engine/core/window_blocks.py): block 0 is the null entry, held once and
    never in a table's live part; every other block free or referenced, references equal table entries."""
    pool = window.pool
    refs = [0] * len(pool.blocks)
    refs[0] = 1  # (null: held by the pool itself)
    for seq in seqs:
        live = [b for b in seq.window_table if b != 0]
        assert len(set(live)) == len(live), f"window block twice in seq {seq.seq_id}'s table"
        for block_id in live:
            refs[block_id] += 1
    assert [b.ref_count for b in pool.blocks] == refs, "window ref counts differ from the tables"
    free = set(pool.free_queue)
    referenced = {i for i, r in enumerate(refs) if r > 0}
    assert free.isdisjoint(referenced) and free | referenced == set(range(len(pool.blocks)))
    assert all(pool.cached.get(b.block_hash) is b for b in pool.blocks if b.block_hash is not None)


def check_contents(bm: BlockManager, seqs: list[Sequence], kv: KV, ref: ReferenceHashes) -> None:
    """A sequence reads its own tokens; a cached block holds the tokens its hash was computed from."""
    bs = bm.block_size
    for seq in seqs:
        assert kv_tokens(kv, seq, bs) == seq.token_ids[: seq.num_computed_tokens], (
            f"seq {seq.seq_id} reads foreign KV"
        )
        chain = ref.chain(seq.token_ids, seq.cache_salt)
        assert seq.block_hashes == chain[: len(seq.block_hashes)], (
            "block hashes differ from the documented chain"
        )
        for i, block_id in enumerate(seq.block_table):
            block_hash = bm.pool.blocks[block_id].block_hash
            # a hashed block in a table is that sequence's block for those tokens
            if block_hash is not None:
                assert i < seq.num_computed_tokens // bs and block_hash == chain[i]
    for block_hash, block in bm.pool.cached.items():
        assert block_hash in ref.origin, (
            "cached hash not produced by the documented chain of any sequence"
        )
        assert kv[block.block_id] == ref.block_tokens(block_hash), (
            "a prefix hit would serve wrong tokens"
        )


def check_host(
    bm: BlockManager,
    seqs: list[Sequence],
    swapped: list[Sequence],
    host_kv: KV,
    ref: ReferenceHashes,
) -> None:
    """The swap pool and the host tier of the prefix cache: every slot has one owner, a host-tier entry holds
    the tokens its hash names, a swapped-out sequence's host blocks hold its computed tokens."""
    bs, host, hc = bm.block_size, bm.host, bm.host_cache
    num_swap = host.num_blocks
    held = [slot for seq in swapped for slot in seq.host_blocks]
    assert len(set(held)) == len(held), (
        "a swap slot held by two swapped sequences (or twice by one)"
    )
    assert all(0 <= slot < num_swap for slot in held), (
        "a swapped sequence holds a slot outside the swap pool"
    )
    free, freed = list(host.free), list(host.freed_this_step)
    assert len(set(free)) == len(free) and len(set(freed)) == len(freed)
    assert set(held).isdisjoint(free) and set(held).isdisjoint(freed), (
        "a held swap slot is also free"
    )
    assert set(free).isdisjoint(freed)
    assert len(held) + len(free) + len(freed) == num_swap, "swap slots leaked or double-counted"
    assert set(held) | set(free) | set(freed) == set(range(num_swap))
    swapped_ids = {s.seq_id for s in swapped}
    for seq in seqs:
        if seq.seq_id not in swapped_ids:
            assert seq.host_blocks == [], (
                f"seq {seq.seq_id} is not swapped out but holds host blocks"
            )
    for seq in swapped:
        assert seq.block_table == [] and seq.seq_id not in bm.holders, (
            "a swapped sequence holds device blocks"
        )
        assert len(seq.host_blocks) * bs >= seq.num_computed_tokens
        read = [host_kv[seq.host_blocks[i // bs]][i % bs] for i in range(seq.num_computed_tokens)]
        assert read == seq.token_ids[: seq.num_computed_tokens], (
            f"swapped seq {seq.seq_id} lost its KV on the host"
        )
    if hc is None:
        return
    first, num = hc.first_slot, hc.num_slots
    assert first == num_swap, "the host tier's slots overlap the swap pool"
    slots = list(hc.entries.values())
    assert len(set(slots)) == len(slots), "two host-tier entries share a slot"
    assert all(first <= slot < first + num for slot in slots), (
        "a host-tier entry outside the tier's slots"
    )
    hc_free, later = list(hc.free), list(hc.freed_this_step)
    assert len(set(hc_free)) == len(hc_free) and len(set(later)) == len(later)
    assert set(slots).isdisjoint(hc_free) and set(slots).isdisjoint(later), (
        "a host-tier slot is both used and free"
    )
    assert set(hc_free).isdisjoint(later)
    assert len(slots) + len(hc_free) + len(later) == num, "host-tier slots leaked or double-counted"
    assert set(slots) | set(hc_free) | set(later) == set(range(first, first + num))
    assert set(held).isdisjoint(range(first, first + num)), "a swap slot is a host-tier slot"
    for block_hash, slot in hc.entries.items():
        assert block_hash in ref.origin, (
            "host-tier hash not produced by the documented chain of any sequence"
        )
        assert host_kv[slot] == ref.block_tokens(block_hash), "a host hit would serve wrong tokens"


def run_checked(engine, prompt_ids: list[list[int]], params, check_step=None) -> list[list[int]]:
    """Step ``engine`` (an LLMEngine) through ``prompt_ids`` with ``params``, checking the pool's invariants
    (and ``check_step(engine)``, when given) after every step; the final token ids in prompt order."""
    return [out.token_ids for out in run_checked_outputs(engine, prompt_ids, params, check_step)]


def run_checked_outputs(engine, prompt_ids: list[list[int]], params, check_step=None) -> list:
    """``run_checked``'s run; the final RequestOutputs in prompt order (logprobs included, where asked)."""
    for i, ids in enumerate(prompt_ids):
        engine.add_request(f"r{i}", ids, params)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        s = engine.core.scheduler
        check_pool(engine.core.block_manager, list(s.running) + list(s.waiting) + list(s.swapped))
        if check_step is not None:
            check_step(engine)
    return [finals[f"r{i}"] for i in range(len(prompt_ids))]
