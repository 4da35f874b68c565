"""What the KV block books hold, counted: free, cached, pinned and used blocks, the prefix cache's queries and hits,
the host tier, and the slots that hold a token's KV (against the slots allocated: the pool's waste).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.core.block_manager import BlockManager


@dataclass(slots=True)
class BlockStats:
    num_blocks: int
    num_free_blocks: int  # ref count 0 (some still hold a hash and can be hit)
    num_cached_blocks: int  # in the hash map
    num_pinned_blocks: int  # held by pins (shared system prompts), not evictable
    usage: float  # share of blocks referenced by a sequence (pins alone do not count)
    prefix_queries: int  # tokens looked up at admission
    prefix_hits: int  # of those, tokens found in the cache (on the device or in the host tier)
    prefix_host_hits: int  # of the hits, tokens copied back from the host tier
    num_host_cached_blocks: int  # blocks held by the host tier
    host_cache_stores: int  # evicted blocks copied to the host tier
    evictions: int
    allocated_slots: int  # slots of referenced blocks
    used_slots: int  # of those, slots holding a token's KV


def collect_block_stats(blocks: BlockManager) -> BlockStats:
    """The books' numbers now (for the metrics and the benchmarks)."""
    used_blocks = blocks.num_blocks - blocks.pool.num_free
    pinned_only = _pinned_only_blocks(blocks)
    host_cache = blocks.host_cache
    return BlockStats(
        num_blocks=blocks.num_blocks,
        num_free_blocks=blocks.pool.num_free,
        num_cached_blocks=len(blocks.pool.cached),
        num_pinned_blocks=blocks.num_pinned_blocks,
        usage=(used_blocks - pinned_only) / blocks.num_blocks,
        prefix_queries=blocks.prefix_queries,
        prefix_hits=blocks.prefix_hits,
        prefix_host_hits=blocks.prefix_host_hits,
        num_host_cached_blocks=len(host_cache) if host_cache is not None else 0,
        host_cache_stores=host_cache.num_stored if host_cache is not None else 0,
        evictions=blocks.pool.num_evictions,
        allocated_slots=(used_blocks - pinned_only) * blocks.block_size,
        used_slots=_used_slots(blocks),
    )


def _pinned_only_blocks(blocks: BlockManager) -> int:
    """Pinned blocks no sequence references (their ref count is their pin count)."""
    pin_refs: dict[int, int] = {}
    for block_ids in blocks.pins.values():
        for block_id in block_ids:
            pin_refs[block_id] = pin_refs.get(block_id, 0) + 1
    return sum(1 for block_id, n in pin_refs.items() if blocks.pool.blocks[block_id].ref_count == n)


def _used_slots(blocks: BlockManager) -> int:
    """Slots holding a token's KV; a shared block counts once, as full as its fullest holder. (Set updates over
    the tables' full heads, then the partial tails one by one: a few tenths of a millisecond at 256 sequences
    of 50 blocks, where a Python loop over every block took milliseconds, at every stats snapshot.)"""
    size = blocks.block_size
    full: set[int] = set()
    tails: list[tuple[int, int]] = []
    for seq in blocks.holders.values():
        table, computed = seq.block_table, seq.num_computed_tokens
        num_full = min(computed // size, len(table))
        full.update(table[:num_full])
        if num_full < len(table) and computed > num_full * size:
            tails.append((table[num_full], computed - num_full * size))
    filled: dict[int, int] = {}
    for block_id, n in tails:
        if block_id not in full and n > filled.get(block_id, 0):
            filled[block_id] = n
    return len(full) * size + sum(filled.values())
