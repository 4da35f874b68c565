"""The vAttention KV backend (arXiv 2405.04437): each request slot keeps its KV contiguous in *virtual*
memory, and physical pages are mapped under it on demand with the CUDA driver's virtual-memory API, so the
attention kernels read ``k[slot, position]`` with no block table.

Layout, per K and per V (``S`` slots, ``L`` layers, ``N`` blocks, ``P`` tokens per page, page = the driver's
minimum granularity, 2 MiB on Hopper, so ``P = 2 MiB / (kv_heads * head_dim * itemsize)``, where itemsize is the
cache's: an FP8 cache's page holds twice the tokens of a bfloat16 one):
- slot range ``[L, S, max_len, kv_heads, head_dim]``: what attention reads and ``store_kv`` writes
  (``slot = row * max_len + position``); page ``i`` of slot ``s`` in layer ``l`` is mapped to block
  ``table[i]``'s page of that layer;
- home range ``[L, N, P, kv_heads, head_dim]``: every block mapped once at start, by block id, so the block
  operations (copy-on-write, swap, the host tier) keep addressing blocks as the paged backend does.
A block is ``2 L`` physical handles of one page each (K and V of every layer; the driver maps a handle only
from its start, offsets inside a handle are refused on Hopper), created at start; the block manager
allocates, shares (prefix cache) and frees blocks exactly as for paging, with block size ``P``. A shared
block is one handle mapped into several slots. The last slot is a scratch slot with a page of its own that
CUDA-graph padding rows read; it is slot 0, so that every range starts at mapped memory.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import numpy as np
import torch

from engine.kv_backend.base import KVBackend, Rotation
from engine.kv_backend.slot_jobs import SlotJobs
from engine.kv_backend.slot_pages import SlotPages
from engine.forward_context import AttentionMetadata
from kernels import ops as kernel_ops

logger = logging.getLogger(__name__)


def tokens_per_page(page_bytes: int, token_bytes: int) -> int:
    """Tokens of one layer's K (or V) in a page of the driver's: a token's bytes must divide the page."""
    if page_bytes % token_bytes:
        raise ValueError(
            f"kv_backend: vattention needs a token's KV ({token_bytes} bytes per layer) to "
            f"divide the driver's page of {page_bytes} bytes"
        )
    return page_bytes // token_bytes


class VAttentionKV(KVBackend):
    contiguous = True
    # a sequence is given the block it grows into this many tokens early, so that its pages are mapped in the
    # background while it decodes the last tokens of the page before
    lookahead_tokens = 64

    def __init__(
        self,
        driver: Any,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        num_slots: int,
    ) -> None:
        self.driver, self.dtype, self.device = driver, dtype, device
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.page_bytes = driver.granularity
        self.block_size = tokens_per_page(self.page_bytes, num_kv_heads * head_dim * dtype.itemsize)
        self.pages_per_slot = math.ceil(max_model_len / self.block_size)
        self.max_len = self.pages_per_slot * self.block_size
        # slot 0 is the scratch slot: its first page stays mapped, so each layer's slot range starts at mapped
        # memory (Triton checks a tensor's base address before a launch) and graph padding rows read it
        self.num_slots = num_slots + 1
        self.scratch_slot = 0
        self.bytes_per_block = 2 * num_layers * self.page_bytes
        self.num_blocks = 0
        self.map_seconds = self.unmap_seconds = 0.0
        self._ranges: list[tuple[int, int]] = []
        self._handles: list[Any] = []
        self.pages: SlotPages | None = None
        # deferred reclamation and eager allocation (the paper's two ways to keep the driver off the critical
        # path): a free slot keeps its pages mapped, and a new request whose first block is what a free slot
        # maps at page 0 takes that slot and maps nothing for it. At start, free slots get the pool's first
        # blocks (a new pool hands them out in id order) mapped at page 0. Past ``max_deferred`` free slots with
        # mappings, the oldest are unmapped off the engine thread; a slot is mapped again only after that.
        self.max_deferred = num_slots // 2
        # free slots whose pages are still mapped, oldest release first
        self._deferred: dict[int, None] = {}
        self._first_page: dict[int, int] = {}  # block -> a free slot that maps it at page 0
        # slots given a new request this step, with a previous one's pages
        self._claimed_stale: set[int] = set()
        self.jobs = SlotJobs("vattention-vmm")  # the driver's work off the engine thread
        # slot -> first page whose background mapping may still be running
        self._ahead: dict[int, int] = {}

    # memory -------------------------------------------------------------------------------------------

    def allocate(self, num_blocks: int, num_window_blocks: int = 0) -> None:
        """Create ``num_blocks`` blocks (+ the scratch page), map each into the home range and reserve the
        slot ranges (nothing mapped there until a request needs it)."""
        self.free()
        start = time.perf_counter()
        d, L, N, S = self.driver, self.num_layers, num_blocks, self.num_slots
        page, kv_shape = self.page_bytes, (self.num_kv_heads, self.head_dim)
        # block b's page (kv, layer) is handle [b][kv * L + layer]; [N] is the scratch block
        self._handles = [[d.create(page) for _ in range(2 * L)] for _ in range(N + 1)]
        self.num_blocks = N
        self.home = [self._reserve(L * N * page) for _ in range(2)]
        self.slots = [self._reserve(L * S * self.pages_per_slot * page) for _ in range(2)]
        for kv in range(2):
            for layer in range(L):
                for block in range(N):
                    d.map(
                        self.home[kv] + (layer * N + block) * page,
                        page,
                        self._handles[block][kv * L + layer],
                        0,
                    )
        self.k_caches, self.v_caches = (
            d.tensor(self.home[kv], (L, N, self.block_size, *kv_shape), self.dtype)
            for kv in range(2)
        )
        self.k_slots, self.v_slots = (
            d.tensor(self.slots[kv], (L, S, self.max_len, *kv_shape), self.dtype) for kv in range(2)
        )
        self.pages = SlotPages(S, self.pages_per_slot, self)
        self.pages.apply(self.scratch_slot, [N], np.array([0]))
        self._map_ahead(min(N, self.max_deferred))
        # padding rows read one (finite) token
        self.k_slots[:, self.scratch_slot, : self.block_size].zero_()
        self.v_slots[:, self.scratch_slot, : self.block_size].zero_()
        logger.info(
            "vattention KV: %d blocks of %d tokens (%d pages of %d MiB each), %d slots x %d tokens, "
            "set up in %.2f s",
            N,
            self.block_size,
            2 * L,
            page >> 20,
            S - 1,
            self.max_len,
            time.perf_counter() - start,
        )

    def _map_ahead(self, count: int) -> None:
        """Eager allocation: the pool's first ``count`` blocks mapped at page 0 of the last free slots."""
        for block in range(count):
            slot = self.num_slots - 1 - block
            self.pages.apply(slot, [block], np.array([0]))
            self._deferred[slot] = None
            self._first_page[block] = slot

    def slot_mapping(
        self, table: np.ndarray, token_rows: np.ndarray, positions: np.ndarray
    ) -> np.ndarray:
        """A row is the sequence's request slot, and its KV sits at ``slot * max_len + position``."""
        return token_rows * self.max_len + positions

    def table_shape(self, num_seqs: int, padded_seqs: int, width: int) -> tuple[int, int]:
        """One slot id per sequence, padding rows included (they read the scratch slot)."""
        return padded_seqs, 1

    def pack_tables(self, out: np.ndarray, table: np.ndarray, rows: np.ndarray) -> None:
        out[: len(rows), 0] = rows
        out[len(rows) :, 0] = self.scratch_slot

    def slot_ids(self, tables: torch.Tensor) -> torch.Tensor | None:
        return tables[:, 0]

    @property
    def reserved_row(self) -> int | None:
        return self.scratch_slot

    def choose_slot(self, first_block: int) -> int | None:
        """A free slot that already maps ``first_block`` at page 0 (the caller checks it is free), or None."""
        slot = self._first_page.get(first_block)
        return slot if slot in self._deferred else None

    def claim_slot(self, slot: int) -> None:
        """``slot`` gets a new request (before its first ``map_rows``)."""
        if self._take_free(slot):
            self._claimed_stale.add(slot)

    def _reserve(self, size: int) -> int:
        address = self.driver.reserve(size)
        self._ranges.append((address, size))
        return address

    def free(self) -> None:
        """Unmap and release everything (at shutdown, or after the warm-up pass that sized the pool)."""
        self.flush()
        self._release()

    def _release(self) -> None:
        d, L, page = self.driver, self.num_layers, self.page_bytes
        if self.pages is not None:
            for slot in range(self.num_slots):
                self.pages.clear(slot)
            for kv in range(2):
                for layer in range(L):
                    for block in range(self.num_blocks):
                        d.unmap(self.home[kv] + (layer * self.num_blocks + block) * page, page)
        for handles in self._handles:
            for handle in handles:
                d.release(handle)
        for address, size in self._ranges:
            d.free_address(address, size)
        self._handles, self._ranges, self.pages, self.num_blocks = [], [], None, 0
        self._deferred.clear()
        self._first_page.clear()
        self.k_caches = self.v_caches = self.k_slots = self.v_slots = torch.empty(0)

    def __del__(self) -> None:
        """The driver's memory is not torch's: nothing else gives it back when the backend goes away. Never
        waits for the worker: when this object is collected with its executor (SlotPages refers back to it,
        a cycle), the worker has been told to exit first and runs nothing more, so a job it never started is
        run here instead."""
        try:
            self.jobs.close()
            self._ahead.clear()
            self._release()
        except Exception:  # noqa: BLE001 - at interpreter exit the driver may be gone first
            pass

    def layer_caches(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What layer ``layer``'s attention reads and writes: its slot ranges ``[S, max_len, kv_heads, dim]``."""
        return self.k_slots[layer], self.v_slots[layer]

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        rotation: Rotation | None = None,
        window: int = 0,
    ) -> torch.Tensor:
        """Each sequence's KV is its request slot (``meta.slot_ids``): no block table in the kernels. (Models
        with sliding-window layers run on the paged backend: EngineConfig refuses them here, ``window`` is 0.)"""
        assert window == 0, "sliding-window layers need the paged KV backend"
        self.store(q, k, v, k_cache, v_cache, meta, k_scale, v_scale, rotation)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            kernel_ops.contiguous_decode_attention(
                out[:nd],
                q[:nd],
                k_cache,
                v_cache,
                meta.slot_ids[:nd],
                meta.context_lens[:nd],
                scale,
                meta.max_context_len,
                k_scale,
                v_scale,
                meta.decode_order,
            )
        if nd < q.shape[0]:
            kernel_ops.contiguous_prefill_attention(
                out[nd:],
                q[nd:],
                k_cache,
                v_cache,
                meta.slot_ids[nd:],
                meta.prefill_cu_seqlens_q,
                meta.context_lens[nd:],
                scale,
                k_scale,
                v_scale,
                k[nd:],
                v[nd:],
            )
        return out.view(q.shape[0], -1)

    # PageMapper --------------------------------------------------------------------------------------

    def _slot_page_address(self, kv: int, layer: int, slot: int, page: int) -> int:
        return (
            self.slots[kv]
            + ((layer * self.num_slots + slot) * self.pages_per_slot + page) * self.page_bytes
        )

    def map_block(self, slot: int, page: int, block: int) -> None:
        start = time.perf_counter()
        for kv in range(2):
            for layer in range(self.num_layers):
                self.driver.map(
                    self._slot_page_address(kv, layer, slot, page),
                    self.page_bytes,
                    self._handles[block][kv * self.num_layers + layer],
                    0,
                )
        self.map_seconds += time.perf_counter() - start

    def unmap_block(self, slot: int, page: int) -> None:
        start = time.perf_counter()
        for kv in range(2):
            for layer in range(self.num_layers):
                self.driver.unmap(self._slot_page_address(kv, layer, slot, page), self.page_bytes)
        self.unmap_seconds += time.perf_counter() - start

    # per step -----------------------------------------------------------------------------------------

    def map_rows(
        self,
        rows: np.ndarray,
        tables: np.ndarray,
        widths: np.ndarray,
        ends: np.ndarray,
        wait_in_flight: Any,
    ) -> None:
        """Before a step launches: map each row's blocks ``tables[i, :widths[i]]`` into its slot. Pages the step
        reads or writes (below ``ends[i]`` tokens) are mapped now; pages a sequence was given ahead of need
        (``lookahead_tokens``) are mapped in the background, and a later step waits for them only if they are
        not mapped by then. A page that must change under a live slot (copy-on-write) is remapped only after
        ``wait_in_flight()``."""
        needed = -(-ends // self.block_size)
        if self._ahead:
            self._wait_for_needed_ahead(rows, needed)
        have = self.pages.mapped[rows, : tables.shape[1]]
        wanted = np.arange(tables.shape[1])[None, :] < widths[:, None]
        # most steps: none (one numpy pass)
        changed = np.flatnonzero((wanted & (have != tables)).any(axis=1))
        plans = []
        waited = False
        for i in changed.tolist():
            row, table, width = int(rows[i]), tables[i], int(widths[i])
            pages, replaces = self.pages.changes(row, table[:width])
            # (a new occupant's replaced pages are a finished request's: no step in flight reads them)
            if replaces and row not in self._claimed_stale and not waited:
                wait_in_flight()
                waited = True
            plans.append((row, table[:width], pages[pages < needed[i]], pages[pages >= needed[i]]))
        for row, blocks, now, ahead in plans:
            if len(now):
                self.jobs.wait_for(row)
                self.pages.apply(row, blocks, now)
            if len(ahead):
                self.jobs.submit(row, self.pages.execute, row, self.pages.plan(row, blocks, ahead))
                self._ahead[row] = min(self._ahead.get(row, self.pages_per_slot), int(ahead[0]))
        self._unmap_past_tables(rows, widths)

    def _wait_for_needed_ahead(self, rows: np.ndarray, needed: np.ndarray) -> None:
        for i in np.flatnonzero(np.isin(rows, list(self._ahead))).tolist():
            row = int(rows[i])
            if needed[i] > self._ahead[row]:
                self.jobs.wait_for(row)
                del self._ahead[row]

    def _unmap_past_tables(self, rows: np.ndarray, widths: np.ndarray) -> None:
        """A finished request's pages past its slot's new request's table are unmapped in the background, so
        a live slot maps exactly its table (the new request waits for it only if it grows there)."""
        for i in np.flatnonzero(np.isin(rows, list(self._claimed_stale))).tolist():
            row = int(rows[i])
            extra = self.pages.forget(row, int(widths[i]))
            if extra:
                self.jobs.submit(row, self._unmap_pages, row, extra)
        self._claimed_stale.clear()

    def release_row(self, row: int) -> None:
        """A slot no step in flight reads any more: its pages are unmapped later (their blocks live on in the
        pool; a stale mapping in a free slot is harmless)."""
        if self.pages.mapped[row, 0] >= 0:
            self._deferred[row] = None
            self._first_page[int(self.pages.mapped[row, 0])] = row
        while len(self._deferred) > self.max_deferred:
            self._unmap_in_background(next(iter(self._deferred)))

    def _take_free(self, row: int) -> bool:
        """``row`` gets an occupant: no longer a free slot with mappings (True if it was one)."""
        if row not in self._deferred:
            return False
        del self._deferred[row]
        block = int(self.pages.mapped[row, 0])
        if self._first_page.get(block) == row:
            del self._first_page[block]
        return True

    def _unmap_in_background(self, row: int) -> None:
        self._take_free(row)
        self.jobs.submit(row, self._unmap_pages, row, self.pages.forget(row))

    def _unmap_pages(self, row: int, pages: list[int]) -> None:
        for page in pages:
            self.unmap_block(row, page)

    def reclaim(self) -> None:
        """Unmap every free slot's pages, in the background."""
        while self._deferred:
            self._unmap_in_background(next(iter(self._deferred)))

    def wait_background(self) -> None:
        """Wait for the background mapping and unmapping submitted so far."""
        self.jobs.wait_all()
        self._ahead.clear()

    def flush(self) -> None:
        """Unmap every released slot now and wait until all are unmapped."""
        self.reclaim()
        self.wait_background()

    @property
    def released_slots(self) -> set[int]:
        """Free slots whose pages may still be mapped (deferred or being unmapped)."""
        return set(self._deferred) | self.jobs.slots

    def stats(self) -> dict[str, float]:
        pages = self.pages
        return {
            "mapped_pages": pages.num_mapped_pages if pages else 0,
            "maps": pages.num_maps if pages else 0,
            "unmaps": pages.num_unmaps if pages else 0,
            "map_seconds": self.map_seconds,
            "unmap_seconds": self.unmap_seconds,
        }
