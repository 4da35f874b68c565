"""Paged KV cache bookkeeping: which blocks each sequence holds (the pool itself: engine/core/block_pool.py).

A block holds the KV of ``block_size`` consecutive tokens; a sequence's ``block_table`` lists its blocks in
token order, so token i lives at slot ``block_table[i // block_size] * block_size + i % block_size``.

Prefix caching: every full block of tokens has a chained hash (engine/core/block_hash.py). A block enters the hash
map once its KV is written; a freed block keeps its hash in the free queue (LRU, O(1) removal on a hit) until it
is reused for other tokens.
"""

from __future__ import annotations

import sys

from engine.core.block_hash import BlockHasher
from engine.core.block_pool import Block, BlockPool, HostBlocks
from engine.core.block_stats import BlockStats, PrefixLookups, count_blocks
from engine.core.host_prefix_cache import HostHit, HostPrefixCache
from engine.core.window_blocks import WindowBlocks
from engine.sequence import Sequence


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        hasher: BlockHasher,
        num_host_blocks: int = 0,
        num_host_cache_blocks: int = 0,
        lookahead_tokens: int = 0,
        max_blocks_per_seq: int | None = None,
        window: WindowBlocks | None = None,
    ) -> None:
        """``num_host_blocks`` host slots for swapped-out sequences (slots 0 ..), then ``num_host_cache_blocks``
        for the host tier of the prefix cache (with prefix caching only). ``lookahead_tokens``: a sequence gets
        the block it grows into that many tokens early, while free blocks are plentiful (the vattention
        backend maps its pages in the background meanwhile); never more than ``max_blocks_per_seq``. ``window``:
        the sliding-window layers' own blocks (a model with such layers), kept in step with these."""
        self.window = window
        self.block_size = block_size
        self.lookahead_tokens = lookahead_tokens
        self.max_blocks_per_seq = max_blocks_per_seq or sys.maxsize
        # free blocks kept for admissions before any block is taken early
        self.lookahead_reserve = num_blocks // 8
        self.enable_prefix_caching = enable_prefix_caching
        self.hasher = hasher
        self.pool = BlockPool(num_blocks)
        self.holders: dict[int, Sequence] = {}  # seq_id -> sequence with a non-empty block table
        # copy-on-write (src, dst), drained by the scheduler
        self.pending_copies: list[tuple[int, int]] = []
        # pin id -> cached blocks it holds one reference to each
        self.pins: dict[str, list[int]] = {}
        self.lookups = PrefixLookups()  # the prefix cache's, at admission
        self.host = HostBlocks(num_host_blocks)
        # (device block, host block), drained by the scheduler
        self.pending_swap_out: list[tuple[int, int]] = []
        self.pending_swap_in: list[tuple[int, int]] = []  # (host block, device block)
        self.host_cache: HostPrefixCache | None = None
        if enable_prefix_caching and num_host_cache_blocks > 0:
            self.host_cache = HostPrefixCache(num_host_blocks, num_host_cache_blocks)
            self.pool.on_evict = self._store_on_host

    @property
    def num_blocks(self) -> int:
        return len(self.pool.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def update_block_hashes(self, seq: Sequence) -> None:
        """Extend ``seq.block_hashes`` to every full block of its known tokens (hashes are of tokens only; a
        block holding a token still pending on the device is hashed once that token is resolved)."""
        known = seq.num_known_tokens
        if known // self.block_size > len(seq.block_hashes):
            self.hasher.extend(
                seq.block_hashes, seq.token_ids[:known], self.block_size, seq.cache_salt
            )

    def match_prefix(self, seq: Sequence) -> list[Block | HostHit]:
        """Longest run of cached blocks at the head of ``seq`` (each on the device, or else in the host tier),
        capped so one token is left to compute (its logits are needed). Touches no block (it only extends
        ``seq.block_hashes``)."""
        if not self.enable_prefix_caching:
            return []
        self.update_block_hashes(seq)
        hits: list[Block | HostHit] = []
        host = self.host_cache
        for block_hash in seq.block_hashes[: (seq.num_tokens - 1) // self.block_size]:
            block = self.pool.cached.get(block_hash)
            if block is None:
                slot = host.get(block_hash) if host is not None else None
                if slot is None:
                    break
                block = HostHit(block_hash, slot)
            hits.append(block)
        if self.window is not None:  # (a hit must be one for the sliding-window layers too)
            return hits[: self.window.usable_prefix(seq.block_hashes, len(hits))]
        return hits

    def allocate(
        self, seq: Sequence, num_new_tokens: int, prefix_hits: list[Block | HostHit] | None = None
    ) -> bool:
        """Give ``seq`` the cached ``prefix_hits`` (on admission) and slots for ``num_new_tokens`` more
        tokens after them. All or nothing: False (and no change) when the free blocks do not suffice."""
        table, start = seq.block_table, seq.num_computed_tokens
        ahead = self.lookahead_tokens if self.pool.num_free > self.lookahead_reserve else 0
        if (
            num_new_tokens
            and not prefix_hits
            and start + num_new_tokens + ahead <= len(table) * self.block_size
            and self.pool.blocks[table[start // self.block_size]].ref_count == 1
        ):  # the common decode step: its slots are in blocks it owns alone
            if self.window is not None:
                self.window.release_passed(seq, start)
            return True
        prefix_hits = prefix_hits or []
        num_computed = seq.num_computed_tokens + len(prefix_hits) * self.block_size
        num_table = len(seq.block_table) + len(prefix_hits)
        num_fresh = max(0, self.blocks_needed(num_computed + num_new_tokens) - num_table)
        # hits sitting in the free queue, and host hits (each needs a fresh block to be copied into)
        num_revived = sum(1 for b in prefix_hits if isinstance(b, HostHit) or b.ref_count == 0)
        write_block = num_computed // self.block_size
        needs_copy = (
            write_block < num_table and self._block_of(seq, prefix_hits, write_block).ref_count > 1
        )
        window, counts = self.window, (len(prefix_hits), num_computed, num_new_tokens)
        if num_fresh + num_revived + needs_copy > self.pool.num_free or not (
            window is None or window.fits(seq, *counts)
        ):
            return False
        if window is not None:
            window.allocate(seq, *counts)
        self._take_hits(seq, prefix_hits)
        seq.num_computed_tokens = num_computed
        seq.num_registered_blocks = max(seq.num_registered_blocks, len(prefix_hits))
        if needs_copy:
            self._copy_on_write(seq, write_block)
        seq.block_table.extend(self.pool.take().block_id for _ in range(num_fresh))
        if ahead:
            self._take_ahead(seq, num_computed + num_new_tokens + ahead)
        if seq.block_table:
            self.holders[seq.seq_id] = seq
        return True

    def _take_ahead(self, seq: Sequence, num_tokens: int) -> None:
        """The block ``seq`` grows into within ``num_tokens``, early, while free blocks are plentiful."""
        wanted = min(self.blocks_needed(num_tokens), self.max_blocks_per_seq)
        if self.pool.num_free > self.lookahead_reserve and len(seq.block_table) < wanted:
            seq.block_table.append(self.pool.take().block_id)

    def _take_hits(self, seq: Sequence, prefix_hits: list[Block | HostHit]) -> None:
        """``seq``'s table gains its prefix hits (and an admission's lookup is counted). Device hits first, and
        host hits' slots claimed: taking blocks for host hits must not evict a device hit or store an evicted
        block into the slot of a host hit still to be restored."""
        if not seq.block_table:  # admission: count the lookup
            self.lookups.queries += seq.num_tokens
            self.lookups.hits += len(prefix_hits) * self.block_size
        restores = {}
        for hit in prefix_hits:
            if isinstance(hit, Block):
                self.pool.acquire(hit)
            else:
                restores[hit.block_hash] = self.host_cache.restore(hit.block_hash)
        for hit in prefix_hits:
            seq.block_table.append(
                hit.block_id
                if isinstance(hit, Block)
                else self._restore(hit.block_hash, restores[hit.block_hash])
            )

    def _block_of(
        self, seq: Sequence, prefix_hits: list[Block | HostHit], index: int
    ) -> Block | HostHit:
        if index < len(seq.block_table):
            return self.pool.blocks[seq.block_table[index]]
        return prefix_hits[index - len(seq.block_table)]

    def _restore(self, block_hash: bytes, slot: int) -> int:
        """A fresh device block for a host-tier hit, its copy back from ``slot`` queued (swap-in phase: before
        the pass reads it) and registered under its hash at once (later requests of the same step share it)."""
        block = self.pool.take()
        self.pending_swap_in.append((slot, block.block_id))
        self.pool.register(block, block_hash)
        self.lookups.host_hits += self.block_size
        return block.block_id

    def _store_on_host(self, block: Block, block_hash: bytes) -> None:
        """The pool is about to reuse ``block`` for other tokens: keep its KV in the host tier (the copy runs in
        the step's first phase, before any write of this step)."""
        slot = self.host_cache.store(block_hash)
        if slot is not None:
            self.pending_swap_out.append((block.block_id, slot))

    def _copy_on_write(self, seq: Sequence, index: int) -> None:
        """The block about to be written is shared (after a fork): give ``seq`` its own copy."""
        shared = self.pool.blocks[seq.block_table[index]]
        own = self.pool.take()
        self.pending_copies.append((shared.block_id, own.block_id))
        self.pool.release(shared)
        seq.block_table[index] = own.block_id

    def commit(self, seq: Sequence) -> None:
        """After a step wrote KV: register every newly full, written block under its hash."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_registered_blocks:
            return
        self.update_block_hashes(seq)
        for i in range(seq.num_registered_blocks, num_full):
            self.pool.register(self.pool.blocks[seq.block_table[i]], seq.block_hashes[i])
        seq.num_registered_blocks = num_full
        if self.window is not None:
            self.window.commit(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` (whose tokens equal ``parent``'s) shares every block of ``parent``; the first write into
        a shared block copies it."""
        for block_id in parent.block_table:
            self.pool.acquire(self.pool.blocks[block_id])
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_registered_blocks = parent.num_registered_blocks
        if self.window is not None:
            self.window.share(parent, child)
        if child.block_table:
            self.holders[child.seq_id] = child

    def reassign(self, seqs: list[Sequence], sources: list[Sequence]) -> None:
        """Beam search: each ``seqs[i]`` continues ``sources[i]`` (a beam of the same request, maybe itself,
        maybe the source of several): it drops its own blocks and shares the source's (state as of the call;
        a shared block is copied on the next write into it). Sources are read before any sequence changes."""
        snapshots = [
            (
                list(src.block_table),
                list(src.block_hashes),
                src.num_computed_tokens,
                src.num_registered_blocks,
            )
            for src in sources
        ]
        # references first: a block both dropped and kept never reaches the free queue
        for table, *_ in snapshots:
            for block_id in table:
                self.pool.acquire(self.pool.blocks[block_id])
        windows = [self.window.held_copy(src) for src in sources] if self.window else []
        for seq in seqs:
            self.free(seq)
        for seq, (table, registered) in zip(seqs, windows):
            seq.window_table, seq.window_registered = table, registered
        for seq, (table, hashes, computed, registered) in zip(seqs, snapshots):
            seq.block_table, seq.block_hashes = table, hashes
            seq.num_computed_tokens, seq.num_registered_blocks = computed, registered
            if table:
                self.holders[seq.seq_id] = seq

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s blocks, tail first, so its tail is evicted before its head. A copy-on-write still
        pending into one of its blocks is dropped too (the block may be taken again in the same step)."""
        if self.pending_copies:
            own = set(seq.block_table)
            self.pending_copies = [(src, dst) for src, dst in self.pending_copies if dst not in own]
        for block_id in reversed(seq.block_table):
            self.pool.release(self.pool.blocks[block_id], seq.retain)
        if self.window is not None:
            self.window.free(seq)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        self.holders.pop(seq.seq_id, None)

    def pin(self, pin_id: str, block_hashes: list[bytes], max_pinned_blocks: int) -> int:
        """Hold the cached head run of ``block_hashes`` against eviction (a shared system prompt): each block
        gets one more reference, so it never enters the free queue while pinned. Pins never exceed
        ``max_pinned_blocks`` in all; returns the number of blocks pinned (0 when over the cap)."""
        self.unpin(pin_id)
        blocks = []
        for block_hash in block_hashes:
            block = self.pool.cached.get(block_hash) if self.enable_prefix_caching else None
            if block is None:
                break
            blocks.append(block)
        if not blocks or self.num_pinned_blocks + len(blocks) > max_pinned_blocks:
            return 0
        for block in blocks:
            self.pool.acquire(block)
        self.pins[pin_id] = [block.block_id for block in blocks]
        return len(blocks)

    def unpin(self, pin_id: str) -> None:
        for block_id in reversed(self.pins.pop(pin_id, [])):  # tail first, as sequences free theirs
            self.pool.release(self.pool.blocks[block_id])

    def unpin_all(self) -> int:
        """Drop every pin; returns the number of block references released."""
        released = self.num_pinned_blocks
        for pin_id in list(self.pins):
            self.unpin(pin_id)
        return released

    @property
    def num_pinned_blocks(self) -> int:
        return sum(len(ids) for ids in self.pins.values())

    # swapping -----------------------------------------------------------------------------------------

    def _computed_blocks(self, seq: Sequence) -> list[int]:
        """The blocks holding ``seq``'s computed tokens (a preempted step's allocation may have added more)."""
        return seq.block_table[: self.blocks_needed(seq.num_computed_tokens)]

    def can_swap_out(self, *seqs: Sequence) -> bool:
        """Room in the host pool for the distinct blocks of ``seqs`` (a request's sequences go together); no
        when one of them is being filled from the host tier in this step (its data is not on the device yet)."""
        blocks = {b for seq in seqs for b in self._computed_blocks(seq)}
        # slots whose copy back runs this step (not host-tier ones)
        swapped_in = set(self.host.freed_this_step)
        filling = {dst for src, dst in self.pending_swap_in if src not in swapped_in}
        return (
            all(self._computed_blocks(seq) for seq in seqs)
            and blocks.isdisjoint(filling)
            and len(blocks) <= self.host.num_free
        )

    def swap_out(self, *seqs: Sequence) -> None:
        """Copy the blocks of ``seqs`` holding computed tokens to the host pool, all or nothing (check
        ``can_swap_out``), and drop every block of theirs from the device (their computed tokens stay
        computed). A block the sequences share is copied once and its host copy shared. A copy-on-write still
        pending into one of their blocks is read from its source; a block being swapped in this very step
        keeps the host copy it comes from (the copy back is dropped: the step's swap-outs run before it)."""
        cow_source = {dst: src for src, dst in self.pending_copies}
        swapped_in = set(self.host.freed_this_step)
        swap_source = {dst: src for src, dst in self.pending_swap_in if src in swapped_in}
        own = {b for seq in seqs for b in seq.block_table}
        self.pending_copies = [(src, dst) for src, dst in self.pending_copies if dst not in own]
        slots: dict[int, int] = {}  # device block -> its host copy
        for seq in seqs:
            computed = self._computed_blocks(seq)
            for block_id in computed:
                if block_id not in slots:
                    if block_id in swap_source:  # still in the host slot it came from
                        slots[block_id] = self.host.reclaim(swap_source[block_id])
                        self.pending_swap_in.remove((swap_source[block_id], block_id))
                    else:
                        slots[block_id] = self.host.free.pop()
                        self.pending_swap_out.append(
                            (cow_source.get(block_id, block_id), slots[block_id])
                        )
                slot = slots[block_id]
                self.host.refs[slot] = self.host.refs.get(slot, 0) + 1
            seq.host_blocks = [slots[b] for b in computed]
        for seq in seqs:
            computed = seq.num_computed_tokens
            self.free(seq)
            seq.num_computed_tokens = computed

    def can_swap_in(self, *seqs: Sequence, spare: int = 0) -> bool:
        """Room on the device for the distinct host copies of ``seqs`` (plus ``spare`` blocks)."""
        return len({slot for seq in seqs for slot in seq.host_blocks}) + spare <= self.pool.num_free

    def swap_in(self, *seqs: Sequence) -> None:
        """Back from the host pool into fresh device blocks, a host copy that several of ``seqs`` share into one
        shared block again (full blocks are registered again on the next commit)."""
        blocks: dict[int, Block] = {}  # host slot -> its device block
        for seq in seqs:
            table = []
            for slot in seq.host_blocks:
                block = blocks.get(slot)
                if block is None:
                    block = blocks[slot] = self.pool.take()
                    self.pending_swap_in.append((slot, block.block_id))
                else:
                    self.pool.acquire(block)
                table.append(block.block_id)
            seq.block_table = table
            self.host.release(seq.host_blocks, reused_next_step=True)
            seq.host_blocks = []
            seq.num_registered_blocks = 0
            self.holders[seq.seq_id] = seq

    def drop_host_blocks(self, seq: Sequence) -> None:
        """A swapped-out sequence ended: its host copies are not needed (no copy reads them any more)."""
        self.host.release(seq.host_blocks, reused_next_step=False)
        seq.host_blocks = []

    def take_pending_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        out, into = self.pending_swap_out, self.pending_swap_in
        self.pending_swap_out, self.pending_swap_in = [], []
        self.host.new_step()
        if self.host_cache is not None:
            self.host_cache.new_step()
        return out, into

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def reset_prefix_cache(self) -> int:
        """Forget every cached block that no sequence holds, on the device and in the host tier."""
        dropped = self.pool.reset_cache()
        return dropped + (self.host_cache.clear() if self.host_cache is not None else 0)

    def stats(self) -> BlockStats:
        return count_blocks(
            self.pool,
            self.block_size,
            self.holders.values(),
            self.pins,
            self.lookups,
            self.host_cache,
        )
