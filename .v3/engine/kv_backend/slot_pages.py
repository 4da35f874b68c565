"""Page accounting of the vAttention backend, in pure Python: which KV block each request slot maps at each
page index, and the driver calls that bring a slot in line with its sequence's block table.

A request slot is a contiguous virtual range ``[max_len]`` tokens long (per layer, for K and for V); page ``i``
of the slot holds tokens ``i * P .. (i + 1) * P - 1`` (``P`` = tokens per page = the block manager's block
size), backed by the physical pages of KV block ``table[i]``. The block manager still decides which block
holds which tokens (and shares prefix blocks by hash); here those blocks are *mapped* into each slot, so a
shared block is one physical page seen at two virtual addresses, never a copy.

Rules the tests check with a fake driver (tests/engine/test_slot_pages.py):
- a slot's page is mapped to exactly the block its sequence's table names (maps only where it differs);
- a page already mapped to another block is unmapped first, and that happens only for a live slot whose own
  block changed (copy-on-write), after the caller made sure no step in flight still reads it;
- ``clear`` unmaps every page of a slot (``forget`` hands them to the caller to unmap); after all slots are
  cleared the driver holds no slot mapping.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np


class PageMapper(Protocol):
    """Maps/unmaps the physical pages of one KV block (all layers, K and V) at one page of one slot."""

    def map_block(self, slot: int, page: int, block: int) -> None: ...

    def unmap_block(self, slot: int, page: int) -> None: ...


class SlotPages:
    def __init__(self, num_slots: int, pages_per_slot: int, mapper: PageMapper) -> None:
        # block id per page, -1 = none
        self.mapped = np.full((num_slots, pages_per_slot), -1, dtype=np.int64)
        self.mapper = mapper
        self.num_maps = 0
        self.num_unmaps = 0

    @property
    def num_mapped_pages(self) -> int:
        return int((self.mapped >= 0).sum())

    def changes(self, slot: int, blocks: Sequence[int] | np.ndarray) -> tuple[np.ndarray, bool]:
        """Pages of ``slot`` that must change to map ``blocks`` at pages 0..len-1, and whether any of them
        replaces a mapped page (which a step in flight may read: the caller waits for it first)."""
        want = np.asarray(blocks, dtype=np.int64)
        have = self.mapped[slot, : len(want)]
        pages = np.flatnonzero(have != want)
        return pages, bool((have[pages] >= 0).any())

    def apply(self, slot: int, blocks: Sequence[int] | np.ndarray, pages: np.ndarray) -> None:
        """Map ``blocks[page]`` at each of ``pages`` of ``slot`` (unmapping what was there)."""
        self.execute(slot, self.plan(slot, blocks, pages))

    def plan(
        self, slot: int, blocks: Sequence[int] | np.ndarray, pages: np.ndarray
    ) -> list[tuple[int, bool, int]]:
        """The bookkeeping of ``apply`` now; the driver calls, (page, unmap first, block) each, for ``execute``
        (which may run later on another thread, before anything else touches these pages)."""
        calls = []
        for page in pages.tolist():
            mapped = bool(self.mapped[slot, page] >= 0)
            block = int(blocks[page])
            calls.append((page, mapped, block))
            self.mapped[slot, page] = block
            self.num_unmaps += mapped
            self.num_maps += 1
        return calls

    def execute(self, slot: int, calls: list[tuple[int, bool, int]]) -> None:
        for page, unmap_first, block in calls:
            if unmap_first:
                self.mapper.unmap_block(slot, page)
            self.mapper.map_block(slot, page, block)

    def forget(self, slot: int, first_page: int = 0) -> list[int]:
        """Mark the pages of ``slot`` from ``first_page`` on unmapped and return those that were mapped: the
        caller unmaps them (maybe later, but before anything is mapped there again)."""
        pages = (np.flatnonzero(self.mapped[slot, first_page:] >= 0) + first_page).tolist()
        self.mapped[slot, first_page:] = -1
        self.num_unmaps += len(pages)
        return pages

    def clear(self, slot: int) -> None:
        """Unmap every page of ``slot`` (its request ended and no step in flight reads it any more)."""
        for page in np.flatnonzero(self.mapped[slot] >= 0).tolist():
            self.mapper.unmap_block(slot, page)
            self.num_unmaps += 1
        self.mapped[slot] = -1
