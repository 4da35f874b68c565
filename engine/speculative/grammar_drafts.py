"""Drafts under a grammar (structured output, tool calls): only the drafts the grammar allows, and each verify row
sampled under the grammar's mask at its own position.

Before the pass, the sequence's matcher keeps the longest run of drafts it accepts (``validate_tokens``: no state
change), then walks them: the mask before each draft is a row's mask, the one after the last the bonus row's; it is
rolled back to where it was. Each verify row's sampler stand-in holds its mask as a ``FixedMask``, which the
sampler's mask building (engine/output/structured_output.py ``token_masks``) reads as it reads a matcher. The tokens
kept are consumed by the real matcher afterwards, one by one (engine/runtime/speculative_steps.py).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from engine.output.structured_output import fill_mask


class FixedMask:
    """A verify row's allowed-token mask, computed before the pass: a matcher as far as the sampler asks."""

    def __init__(self, words: torch.Tensor) -> None:
        self.words = words  # [ceil(vocab / 32)] int32, contiguous, on the CPU

    def unsafe_compute_mask_ptr(self, pointer: int, num_bytes: int) -> None:
        ctypes.memmove(pointer, self.words.data_ptr(), min(num_bytes, self.words.nbytes))

    def is_error(self) -> bool:
        return False

    def get_error(self) -> str:
        return ""


def grammar_rows(matcher: Any, drafts: list[int], vocab_size: int) -> list[FixedMask] | None:
    """The masks of a sequence's ``len(kept) + 1`` verify rows, or None when the grammar allows none of the drafts
    (or fails on them); ``drafts`` is cut to the run the grammar accepts, in place."""
    del drafts[matcher.validate_tokens(drafts) :]
    if not drafts:
        return None
    masks = torch.full((len(drafts) + 1, -(-vocab_size // 32)), -1, dtype=torch.int32)
    consumed = 0
    try:
        for row, token in enumerate(drafts):
            fill_mask(matcher, masks, row)
            if not matcher.consume_token(token):
                return None
            consumed += 1
        fill_mask(matcher, masks, len(drafts))
        if matcher.is_error():
            return None
    finally:
        if consumed:
            matcher.rollback(consumed)
    return [FixedMask(words) for words in masks]
