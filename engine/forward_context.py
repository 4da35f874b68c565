"""The forward context: attention metadata set by the model runner before each pass and read by the
attention layers, so model code keeps the plain ``forward(input_ids, positions)`` signature."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Per pass. Tokens are laid out sequence by sequence; the first ``num_decodes`` sequences contribute
    one token each (decode-shaped), the rest a chunk of prompt (prefill, possibly after a cached prefix)."""

    # [num_tokens] int64: slot = block_id * block_size + offset; -1 = padding
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, rows padded with 0
    context_lens: torch.Tensor  # [num_seqs] int32: tokens with KV after this pass (prefix + chunk)
    num_decodes: int  # decode tokens are rows 0 .. num_decodes - 1
    # [num_prefills + 1] int32, from row num_decodes: prefill b owns
    prefill_cu_seqlens_q: torch.Tensor
    #                                     rows num_decodes + cu[b] .. num_decodes + cu[b + 1] - 1
    # contiguous KV backend (vAttention): [num_seqs] int32 request slot of each sequence (its KV at
    # k[slot, position]); then block_tables is the same ids as a [num_seqs, 1] column and slot_mapping is
    # slot * max_len + position. None for the paged backend.
    slot_ids: torch.Tensor | None = None
    # host-known bound of context_lens (contiguous decode sizes split-K from it)
    max_context_len: int = 0
    # sliding-window layers' own KV group (a model with such layers): its slots and block tables, laid out as
    # slot_mapping and block_tables; blocks wholly before a sequence's window are left out (null). None: the
    # model's layers all read the one group above.
    window_slot_mapping: torch.Tensor | None = None
    window_block_tables: torch.Tensor | None = None
    # several decode rows of one sequence (speculative decoding's verify rows): a row attends the KV that the rows
    # before it write in this pass, so a kernel that stores and attends row by row without waiting for the others
    # (the persistent decode) may not run it
    rows_share_sequences: bool = False
    # [>= num_decodes] int32: the decode rows, longest context first (a permutation of 0 .. num_decodes - 1
    # there), the order the decode kernel may take them in; None: row order
    decode_order: torch.Tensor | None = None
    # values derived from the above once per pass and shared by every layer (the lean CPU path, kernels/cpu.py)
    memo: dict[str, Any] = field(default_factory=dict)


_current: AttentionMetadata | None = None


@contextmanager
def forward_context(metadata: AttentionMetadata) -> Iterator[None]:
    global _current
    previous, _current = _current, metadata
    try:
        yield
    finally:
        _current = previous


def get_attention_metadata() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("attention layer called outside a forward_context")
    return _current


def current_attention_metadata() -> AttentionMetadata | None:
    """The pass's metadata, or None outside a pass (a model called on its own)."""
    return _current


def pass_memo() -> dict[str, Any]:
    """The current pass's memo; a throwaway dict outside a pass (a layer called on its own)."""
    return _current.memo if _current is not None else {}
