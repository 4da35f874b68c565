"""The KV blocks of a model's sliding-window layers (Gemma 3's local layers): a pool of their own, so that they
hold only what a window can still read.

A token at position p of a sliding-window layer attends positions p - window + 1 .. p. A sequence's
``window_table`` is positional like its ``block_table`` (block i holds positions i B .. i B + B - 1), but a block
wholly before the window of the next token to compute is released at once and its entry becomes ``NULL`` (block
0, never handed out, never read: the kernels start at the window). In decode a sequence holds at most
``ceil(window / B) + 1`` blocks; a prefill chunk of C tokens, ``ceil((window + C) / B) + 1``.

The prefix cache still hits. A full block is registered under its chain hash, the same hash as the full layers'
block of the same tokens (engine/core/block_hash.py), and a released block keeps it in the free queue (LRU) until
it is reused. A prefix of h blocks is usable for the window layers when the blocks a token at position h B reads
(those from ``(h B - window + 1) // B`` to h - 1) are all cached here; the block manager caps a hit at the longest
such prefix (``usable_prefix``). The last window of a conversation is freed last, so the next turn finds it.

Invariants (tests/block_invariants.py): every block but NULL is free or referenced; a block's references equal
the non-NULL table entries and pins naming it.
"""

from __future__ import annotations

from engine.config import EngineConfig
from engine.core.block_pool import Block, BlockPool
from engine.sequence import Sequence

NULL = 0  # the table entry of a released block


class WindowBlocks:
    def __init__(self, num_blocks: int, block_size: int, window: int, prefix_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"KV cache: the sliding-window layers need 2 or more blocks ({num_blocks})"
            )
        self.block_size, self.window, self.prefix_caching = block_size, window, prefix_caching
        self.pool = BlockPool(num_blocks)
        self.pool.take()  # NULL: held forever, so never handed out
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) into this pool

    @classmethod
    def of(cls, num_blocks: int, config: EngineConfig, window: int) -> WindowBlocks | None:
        """The window group of a model whose sliding-window layers got ``num_blocks`` (None: it has none)."""
        if not num_blocks:
            return None
        return cls(num_blocks, config.block_size, window, config.enable_prefix_caching)

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    def first_kept(self, num_computed: int) -> int:
        """The first block the next token (at position ``num_computed``) reads."""
        return max(0, num_computed - self.window + 1) // self.block_size

    def usable_prefix(self, block_hashes: list[bytes], num_hits: int) -> int:
        """The longest prefix of at most ``num_hits`` blocks whose window is cached here."""
        if not self.prefix_caching:
            return 0
        for hits in range(num_hits, 0, -1):
            first = self.first_kept(hits * self.block_size)
            if all(h in self.pool.cached for h in block_hashes[first:hits]):
                return hits
        return 0

    def fits(self, seq: Sequence, num_hits: int, num_computed: int, num_new: int) -> bool:
        return self.blocks_needed(seq, num_hits, num_computed, num_new) <= self.pool.num_free

    def blocks_needed(self, seq: Sequence, num_hits: int, num_computed: int, num_new: int) -> int:
        """Free blocks an allocation takes: fresh ones for the new tokens past the table, cached hits that sit in
        the free queue, and a copy of a shared block about to be written."""
        table = seq.window_table
        if num_hits:  # admission: the table is the hits' window
            hits = self._hits(seq, num_hits)
            revived = sum(1 for b in hits if b.ref_count == 0)
            return revived + max(0, self._length(num_computed + num_new) - num_hits)
        fresh = max(0, self._length(num_computed + num_new) - len(table))
        write = num_computed // self.block_size
        shared = write < len(table) and self.pool.blocks[table[write]].ref_count > 1
        return fresh + int(shared)

    def allocate(self, seq: Sequence, num_hits: int, num_computed: int, num_new: int) -> None:
        """Slots for ``num_new`` tokens after ``num_computed`` (after ``num_hits`` cached blocks on admission);
        blocks the window has passed are released first. The caller checked ``blocks_needed``."""
        if num_hits:
            first = self.first_kept(num_hits * self.block_size)
            hits = self._hits(seq, num_hits)
            for block in hits:
                self.pool.acquire(block)
            seq.window_table = [NULL] * first + [b.block_id for b in hits]
            seq.window_registered = num_hits
        self.release_passed(seq, num_computed)
        write = num_computed // self.block_size
        table = seq.window_table
        if write < len(table) and table[write] != NULL:
            shared = self.pool.blocks[table[write]]
            if shared.ref_count > 1:  # (after a fork: this sequence's own copy)
                own = self.pool.take()
                self.pending_copies.append((shared.block_id, own.block_id))
                self.pool.release(shared)
                table[write] = own.block_id
        table.extend(
            self.pool.take().block_id
            for _ in range(self._length(num_computed + num_new) - len(table))
        )

    def _hits(self, seq: Sequence, num_hits: int) -> list[Block]:
        first = self.first_kept(num_hits * self.block_size)
        return [self.pool.cached[h] for h in seq.block_hashes[first:num_hits]]

    def _length(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def release_passed(self, seq: Sequence, num_computed: int) -> None:
        """Release the blocks before the window of the token at ``num_computed`` (tail first: the older block
        is evicted first, the last window of a conversation last)."""
        table = seq.window_table
        for i in range(min(self.first_kept(num_computed), len(table)) - 1, -1, -1):
            if table[i] == NULL:
                break
            self.pool.release(self.pool.blocks[table[i]])
            table[i] = NULL

    def commit(self, seq: Sequence) -> None:
        """Register the newly full, written blocks under their hashes (the sequence's ``block_hashes``)."""
        if not self.prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        for i in range(seq.window_registered, num_full):
            if seq.window_table[i] != NULL:
                self.pool.register(self.pool.blocks[seq.window_table[i]], seq.block_hashes[i])
        seq.window_registered = max(seq.window_registered, num_full)

    def free(self, seq: Sequence) -> None:
        """Drop every block the sequence holds, tail first, and any copy still pending into one of them."""
        own = set(seq.window_table)
        self.pending_copies = [(s, d) for s, d in self.pending_copies if d not in own]
        for block_id in reversed(seq.window_table):
            if block_id != NULL:
                self.pool.release(self.pool.blocks[block_id])
        seq.window_table = []
        seq.window_registered = 0

    def held_copy(self, seq: Sequence) -> tuple[list[int], int]:
        """``seq``'s table and registered count, each block of it one reference more (for a new holder)."""
        for block_id in seq.window_table:
            if block_id != NULL:
                self.pool.acquire(self.pool.blocks[block_id])
        return list(seq.window_table), seq.window_registered

    def share(self, parent: Sequence, child: Sequence) -> None:
        """``child`` (a fork) holds ``parent``'s blocks; the first write into a shared one copies it."""
        child.window_table, child.window_registered = self.held_copy(parent)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def held(self, seq: Sequence) -> int:
        """Blocks ``seq`` holds here."""
        return sum(1 for b in seq.window_table if b != NULL)
