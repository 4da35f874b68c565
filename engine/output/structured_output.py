"""Structured output on the engine's step: a request's tokens constrained to its grammar (compiled by
engine/output/grammar_compiler.py).

Per step, the engine fills one row of a packed bitmask (32 tokens per int32) for each constrained sequence
(``token_masks``); the sampler turns it into -inf logits for the disallowed tokens. After sampling, the
sequence's matcher consumes the token (``accept``); a token the grammar refuses ends that request only.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.output.matcher_step import consume, next_mask
from engine.output.remote_matchers import RemoteMatcher
from engine.sequence import Sequence


def token_masks(
    seqs: list[Sequence], vocab_size: int
) -> tuple[torch.Tensor | None, dict[int, str]]:
    """Packed allowed-token bitmask ``[rows, ceil(vocab / 32)]`` int32 for the rows with a grammar (other
    rows allow everything), or None when no row has one; plus the rows whose grammar failed (row -> error),
    which allow everything and are ended by the engine."""
    rows = [i for i, seq in enumerate(seqs) if seq.grammar is not None]
    if not rows:
        return None, {}
    mask = torch.full((len(seqs), -(-vocab_size // 32)), -1, dtype=torch.int32)
    failed: dict[int, str] = {}
    # matchers in the matcher server: every row's mask in one round trip
    remote = [i for i in rows if isinstance(seqs[i].grammar, RemoteMatcher)]
    if remote:
        owner = seqs[remote[0]].grammar.owner
        # (a failed row is left as it was: all allowed)
        failed = owner.fill_masks([seqs[i].grammar for i in remote], mask.numpy(), remote)
        rows = [i for i in rows if not isinstance(seqs[i].grammar, RemoteMatcher)]
    for i in rows:
        if (error := next_mask(seqs[i].grammar, *row_span(mask, i))) is not None:
            failed[i] = error
            mask[i] = -1
    return mask, failed


def fill_mask(matcher: Any, mask: torch.Tensor, row: int) -> None:
    """The matcher's next-token mask into row ``row`` of the packed bitmask (a contiguous CPU int32 tensor), as
    ``llguidance.torch.fill_next_token_bitmask`` does; that module compiles a kernel with torch.compile as it is
    imported, which imports torch's compiler: seconds of imports on the first grammar's step."""
    matcher.unsafe_compute_mask_ptr(*row_span(mask, row))


def row_span(mask: torch.Tensor, row: int) -> tuple[int, int]:
    """Where row ``row`` of the packed bitmask lives: its address and its size in bytes."""
    words = mask[row]
    return words.data_ptr(), words.numel() * words.element_size()


def accept(seq: Sequence, token_id: int) -> None:
    """Advance ``seq``'s grammar by its sampled token (ValueError if the grammar refuses it). A matcher in the matcher
    server is sent the token without waiting (its next mask is computed meanwhile); a refusal, never expected of a
    token sampled under the grammar's mask, ends the request at its next mask."""
    if isinstance(seq.grammar, RemoteMatcher):
        seq.grammar.advance(token_id)
    elif seq.grammar is not None:
        consume(seq.grammar, token_id)


def unpack_mask(mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Packed int32 bitmask -> bool ``[rows, vocab_size]`` (True = allowed); bit j of word w is token 32w + j."""
    ids = torch.arange(vocab_size, device=mask.device)
    return ((mask[:, ids // 32] >> (ids % 32)) & 1).bool()
