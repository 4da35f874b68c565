"""The KV backend contract (ARCHITECTURE.md, "KV backends"): the block manager decides which tokens live in
which block; a backend owns the memory behind the blocks and says how attention addresses it.

Every backend keeps block-addressed ``k_caches``/``v_caches`` (``[layers, blocks, block_size, kv_heads,
head_dim]``), through which copy-on-write, swap and the host tier move whole blocks, whatever the backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.forward_context import AttentionMetadata
from kernels import ops as kernel_ops


@dataclass(slots=True, frozen=True)
class QKNorm:
    """Qwen3's per-head RMSNorm of q and k, which the store applies before the rotation (same launch): each norm's
    ``[head_dim]`` weight, in q's dtype, and their epsilon."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float

    def kernel_args(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """The trailing arguments of ``kernels.ops.rotary_store_kv``."""
        return self.q_weight, self.k_weight, self.eps


@dataclass(slots=True, frozen=True)
class Rotation:
    """The rotary embedding a layer hands its KV backend, so that q and k are rotated in the launch that stores
    K and V (``kernels.ops.rotary_store_kv``): each token's position and the ``[max_position, head_dim]`` cos and
    sin rows (engine/layers/rotary.py)."""

    positions: torch.Tensor
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor
    qk_norm: QKNorm | None = None  # q and k are normed first


class KVBackend(ABC):
    # each sequence's KV contiguous in a request slot (no block table in the kernels)
    contiguous: bool = False
    lookahead_tokens: int = 0  # a sequence is given the block it grows into this many tokens early
    scratch_slot: int = 0  # what padding rows of a CUDA graph read: always allocated memory
    block_size: int  # tokens per block, for the block manager
    bytes_per_block: (
        int  # device bytes of one block, K and V of every layer (of the full-attention group)
    )
    k_caches: torch.Tensor  # [layers, blocks, block_size, kv_heads, head_dim]
    v_caches: torch.Tensor
    # a model with sliding-window and full-attention layers: the window layers' own group of blocks
    # (engine/core/window_blocks.py): its window (0: no such group), bytes of one of its blocks, its caches
    window: int = 0
    window_bytes_per_block: int = 0
    window_k_caches: torch.Tensor
    window_v_caches: torch.Tensor

    @abstractmethod
    def allocate(self, num_blocks: int, num_window_blocks: int = 0) -> None:
        """The memory of ``num_blocks`` blocks (zeroed: a masked-out stale slot never carries NaN), and of the
        window group's ``num_window_blocks``."""

    @abstractmethod
    def free(self) -> None:
        """Give the memory back (the warm-up's scratch cache; shutdown)."""

    @abstractmethod
    def layer_caches(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What the attention layer ``layer`` reads and writes: its K and V."""

    @abstractmethod
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
        """One attention layer's pass over its caches (``layer_caches``): store this pass's ``k``/``v``
        ``[T, kv_heads, head_dim]`` at their slots, then attend each row of ``q`` ``[T, heads, head_dim]`` over its
        sequence's KV, the decode rows (the first ``meta.num_decodes``) and the prefill chunks after them each by
        their own kernel -> ``[T, heads * head_dim]``. ``k_scale``/``v_scale``: an FP8 cache's scales.
        ``rotation``: q and k are not rotated yet; ``store`` rotates them in place as it stores. ``window`` > 0:
        a sliding-window layer (its keys: the last ``window`` positions; its slots and tables: the window
        group's where the pass has one, ``kv_group``)."""

    def store(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        k_scale: float,
        v_scale: float,
        rotation: Rotation | None,
        window: int = 0,
    ) -> None:
        """``attend``'s first part: ``k``/``v`` into their slots, after ``rotation`` (if any) of ``q`` and
        ``k`` in place, in the same launch."""
        slot_mapping, _ = kv_group(meta, window)
        if rotation is None:
            kernel_ops.store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
            return
        kernel_ops.rotary_store_kv(
            rotation.positions,
            q,
            k,
            v,
            rotation.cos_cache,
            rotation.sin_cache,
            k_cache,
            v_cache,
            slot_mapping,
            k_scale,
            v_scale,
            *(rotation.qk_norm.kernel_args() if rotation.qk_norm is not None else ()),
        )

    # where a step's tokens live: the step inputs' slot math (engine/worker/step_inputs.py) ------------------

    def slot_mapping(
        self, table: np.ndarray, token_rows: np.ndarray, positions: np.ndarray
    ) -> np.ndarray:
        """Each token's KV slot, where ``store`` writes it: ``token_rows[i]`` is the row of the step inputs' table
        ``table`` that holds token i's sequence, ``positions[i]`` the token's position. Block-addressed: the
        slot of its block's first token plus its offset in the block."""
        blocks = table[token_rows, positions // self.block_size]
        return blocks.astype(np.int64) * self.block_size + positions % self.block_size

    def table_shape(self, num_seqs: int, padded_seqs: int, width: int) -> tuple[int, int]:
        """Rows and columns of a step's packed tables, for ``num_seqs`` sequences (``padded_seqs`` with a CUDA
        graph's padding rows) whose block tables are at most ``width`` long. Padding rows need none here: the
        graphs' static tables keep harmless rows of their own."""
        return num_seqs, width

    def pack_tables(self, out: np.ndarray, table: np.ndarray, rows: np.ndarray) -> None:
        """A step's tables into ``out`` (``table_shape``): each sequence's block-table row, ``rows`` giving
        its row of ``table``."""
        out[:] = table[rows, : out.shape[1]]

    def slot_ids(self, tables: torch.Tensor) -> torch.Tensor | None:
        """What the kernels address a sequence's KV by, beside its block table (None: the table itself)."""
        return None

    # the step inputs' rows ------------------------------------------------------------------------------

    @property
    def reserved_row(self) -> int | None:
        """A row of the step inputs' table no sequence may take (None: every row is free for one)."""
        return None

    def choose_slot(self, first_block: int) -> int | None:
        """A row for a new sequence whose first block is ``first_block`` (None: any free row)."""
        return None

    def claim_slot(self, slot: int) -> None:
        """Row ``slot`` gets a new sequence."""

    def map_rows(
        self,
        rows: np.ndarray,
        tables: np.ndarray,
        widths: np.ndarray,
        ends: np.ndarray,
        wait_in_flight: Callable[[], None],
    ) -> None:
        """Before a step: make each row's blocks (its ``tables[i, :widths[i]]``) addressable up to ``ends``;
        ``wait_in_flight`` waits for the step the device still runs. Nothing to do where kernels read tables."""

    def release_row(self, row: int) -> None:
        """A request slot no step reads any more."""

    def reclaim(self) -> None:
        """The engine went idle: deferred clean-up may run now."""

    def flush(self) -> None:
        """Finish background work (before the memory is inspected or freed)."""

    def stats(self) -> dict[str, float]:
        """Backend numbers for the metrics (mapping time, pages mapped, ...)."""
        return {}


def kv_group(meta: AttentionMetadata, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The slot mapping and block tables a layer reads: a sliding-window layer's (``window`` > 0) are its own
    group's where the pass has one (a model with such layers), every other layer's the pass's."""
    if window > 0 and meta.window_slot_mapping is not None:
        return meta.window_slot_mapping, meta.window_block_tables
    return meta.slot_mapping, meta.block_tables
