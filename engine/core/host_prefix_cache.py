"""The host tier of the prefix cache: the KV of hashed blocks evicted from the device pool, kept in host memory.

When the device pool reuses a free block that still holds a cached prefix block, the block's KV is first copied
to a host slot (in the step's first copy phase, before anything can overwrite it) and its hash is kept here, in
least-recently-used order. A later prefix match that misses on the device but finds the hash here takes a fresh
device block, copies the host slot back (in the step's swap-in phase, before the pass reads it) and registers the
block under its hash again, so the prompt's tokens count as cached and are not computed again (SGLang's HiCache,
vLLM's CPU offloading).

A slot read or written by a copy of the current step is not given to another hash in the same step: the copies
run later, in order on one stream (device-to-host copies first, host-to-device after), so a slot reused within
the step could hand a restore the wrong block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class HostHit:
    """A prefix block found in the host tier (not on the device): admission copies it back into a fresh block."""

    block_hash: bytes
    slot: int


class HostPrefixCache:
    def __init__(self, first_slot: int, num_slots: int) -> None:
        """Slots ``first_slot .. first_slot + num_slots - 1`` of the host KV pool belong to this tier."""
        self.first_slot = first_slot
        self.num_slots = num_slots
        # block hash -> slot, least recently used first
        self.entries: OrderedDict[bytes, int] = OrderedDict()
        self.free: list[int] = list(range(first_slot + num_slots - 1, first_slot - 1, -1))
        self.busy: set[int] = set()  # slots a copy of this step reads or writes
        self.freed_this_step: list[int] = []  # busy slots of entries dropped by clear()
        self.num_stored = 0  # blocks copied in from the device
        self.num_restored = 0  # blocks copied back to the device
        self.num_dropped = 0  # entries given up for newer ones (or not stored: every slot busy)
        self.num_steps = 0
        self.stored_at: dict[int, int] = {}  # slot -> the step its entry was stored in
        # told of an entry leaving the tier while its slot still holds its KV (the disk tier keeps it)
        self.on_drop: Callable[[bytes, int], None] | None = None

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, block_hash: bytes) -> int | None:
        return self.entries.get(block_hash)

    def store(self, block_hash: bytes) -> int | None:
        """The slot to copy an evicted device block into, or None when no copy is needed (the hash is already
        here: it becomes most recent) or possible (every slot is busy this step)."""
        if block_hash in self.entries:
            self.entries.move_to_end(block_hash)
            return None
        slot = self.free.pop() if self.free else self._reclaim()
        if slot is None:
            self.num_dropped += 1
            return None
        self.entries[block_hash] = slot
        self.busy.add(slot)
        self.stored_at[slot] = self.num_steps
        self.num_stored += 1
        return slot

    def restore(self, block_hash: bytes) -> int:
        """The slot holding ``block_hash``'s KV, for a copy back to the device this step; the entry stays (most
        recent), so a later eviction of the restored block needs no copy."""
        slot = self.entries[block_hash]
        self.entries.move_to_end(block_hash)
        self.busy.add(slot)
        self.num_restored += 1
        return slot

    def new_step(self) -> None:
        self.num_steps += 1
        self.busy.clear()
        self.free += self.freed_this_step
        self.freed_this_step = []

    def clear(self) -> int:
        """Forget every entry (a cold cache); returns how many were dropped. Busy slots stay out of the free list
        until the step ends (a copy may still read them)."""
        dropped = len(self.entries)
        for slot in self.entries.values():
            (self.freed_this_step if slot in self.busy else self.free).append(slot)
        self.entries.clear()
        return dropped

    def _reclaim(self) -> int | None:
        """The least recently used entry's slot that no copy of this step touches."""
        for block_hash, slot in self.entries.items():
            if slot not in self.busy:
                # (its copy in has surely finished when it ran two steps ago or more: async scheduling reads
                # step N-1's outputs, and so waits for its copies, before it schedules step N+1)
                if self.on_drop is not None and self.num_steps - self.stored_at[slot] >= 2:
                    self.on_drop(block_hash, slot)
                del self.entries[block_hash]
                self.num_dropped += 1
                return slot
        return None
