"""The device's blocks and the host's swap slots: who is free, who is referenced, which block holds which hash.

A freed block keeps its hash in the free queue (LRU, O(1) removal on a hit) until it is reused for other tokens;
the block manager (engine/core/block_manager.py) decides which blocks a sequence holds.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set while this block is the hash map's entry for its tokens


class BlockPool:
    """All blocks, the free queues and the hash map.

    The free queue is ordered by eviction priority: blocks without a hash at the front (nothing to lose),
    then hashed blocks from least to most recently freed. ``take`` pops the front. Hashed blocks that a session's
    turn freed last (``release(keep=True)``) wait in a queue of their own, least recently freed first, taken only
    once the free queue is empty: a session coming back outranks one-off prompts.
    """

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.kept_queue: OrderedDict[int, Block] = OrderedDict()
        self.cached: dict[bytes, Block] = {}
        self.num_evictions = 0
        # told before an evicted block is reused
        self.on_evict: Callable[[Block, bytes], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self.free_queue) + len(self.kept_queue)

    def free_blocks(self) -> list[Block]:
        """Every free block, in the order ``take`` would give them."""
        return [*self.free_queue.values(), *self.kept_queue.values()]

    def take(self, keep_evicted: bool = True) -> Block:
        """A free block for new tokens; evicts its old hash if it had one (told to ``on_evict`` unless not
        ``keep_evicted``)."""
        _, block = (self.free_queue or self.kept_queue).popitem(last=False)
        if block.block_hash is not None:
            if self.on_evict is not None and keep_evicted:
                self.on_evict(block, block.block_hash)
            del self.cached[block.block_hash]
            block.block_hash = None
            self.num_evictions += 1
        block.ref_count = 1
        return block

    def acquire(self, block: Block) -> None:
        """One more reference to a block found by hash (it may be sitting in the free queue)."""
        if block.ref_count == 0:
            if self.free_queue.pop(block.block_id, None) is None:
                del self.kept_queue[block.block_id]
        block.ref_count += 1

    def release(self, block: Block, keep: bool = False) -> None:
        """One reference less; at none the block is free (``keep``: a session's, evicted after one-off ones)."""
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.block_hash is None:
                self.free_queue[block.block_id] = block
                self.free_queue.move_to_end(block.block_id, last=False)
            elif keep:
                self.kept_queue[block.block_id] = block
            else:
                self.free_queue[block.block_id] = block

    def register(self, block: Block, block_hash: bytes) -> None:
        """Make a written full block hittable; the first block written with a hash keeps the entry."""
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def reset_cache(self) -> int:
        """Forget the hashes of free blocks (a cold cache); returns how many were dropped."""
        dropped = [b for b in self.free_blocks() if b.block_hash is not None]
        for block in dropped:
            del self.cached[block.block_hash]
            block.block_hash = None
            self.kept_queue.pop(block.block_id, None)
            self.free_queue[block.block_id] = block
            self.free_queue.move_to_end(block.block_id, last=False)
        return len(dropped)


class HostBlocks:
    """The host pool that swapped-out sequences' blocks are copied to: a free list, and a reference count per
    held slot (the sequences of one request swapped out together share the copies of the blocks they shared on
    the device). A slot freed by a swap-in is reused only from the next step on, as this step's copies still
    read it (they run in order on one stream: swap-outs, swap-ins, copy-on-write, then the pass)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.freed_this_step: list[int] = []
        self.refs: dict[int, int] = {}  # held slot -> sequences holding it

    @property
    def num_free(self) -> int:
        return len(self.free)

    def release(self, slots: list[int], reused_next_step: bool) -> None:
        for slot in slots:
            self.refs[slot] -= 1
            if not self.refs[slot]:
                del self.refs[slot]
                (self.freed_this_step if reused_next_step else self.free).append(slot)

    def reclaim(self, slot: int) -> int:
        """A slot freed by this step's swap-in, held again (its contents are still the block's)."""
        self.freed_this_step.remove(slot)
        return slot

    def new_step(self) -> None:
        self.free += self.freed_this_step
        self.freed_this_step = []
