"""Logits processing for the sampler (sampler.py), in its order; each works on the batch's float32 copy.

  structured output: token t is allowed where bit t % 32 of word t // 32 of its row's bitmask is set;
  logit_bias added; min_tokens masks EOS and stop_token_ids (unless nothing else is left);
  repetition p (prompt + output tokens):  logit / p if logit > 0 else logit * p
  frequency f, presence r (output counts c):  logit - f * c - r * (c > 0)
then, for the rows that draw: logit / temperature, top-k, top-p, min-p (p_i >= min_p * p_max), softmax.
"""

from __future__ import annotations

import sys

import torch

from engine.sample.sampling_batch import BatchParams

_NEG_INF = float("-inf")


_BYTE_BITS: dict[torch.device, torch.Tensor] = {}


def unpack_bitmask(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, ceil(vocab / 32)] int32 -> [rows, vocab] bool: token t is bit t % 32 of word t // 32. Read a byte
    at a time through a [256, 8] table (byte j of a word holds its bits 8j .. 8j + 7): one bool per token made,
    where shifting each word 32 ways made four bytes per token first (200 rows of a 49k vocabulary: 75 -> 6 ms on
    one CPU thread, benchmarks.kernel.grammar_bitmask)."""
    table = _BYTE_BITS.get(mask.device)
    if table is None:
        values = torch.arange(256, dtype=torch.int32, device=mask.device)
        shifts = torch.arange(8, dtype=torch.int32, device=mask.device)
        table = _BYTE_BITS[mask.device] = ((values[:, None] >> shifts) & 1).bool()
    rows, words = mask.shape
    data = mask.contiguous().view(torch.uint8).view(rows, words, 4)
    # (the bytes of a word low to high, as a little-endian host stores them)
    if sys.byteorder == "big":
        data = data.flip(-1)
    bits = table.index_select(0, data.reshape(-1).int())
    return bits.view(rows, -1)[:, :vocab]


def apply_logit_bias_(logits: torch.Tensor, batch: BatchParams) -> None:
    if batch.bias_rows.numel():
        # each (row, id) at most once: no accumulation needed
        index = (batch.bias_rows, batch.bias_ids)
        logits.index_put_(index, logits[index] + batch.bias_values)


def apply_min_tokens_(logits: torch.Tensor, batch: BatchParams) -> None:
    """Masks the banned ids, except in a row where nothing else is left to sample (structured output whose
    grammar allows only the end): there min_tokens gives way, as the row could produce no token at all
    (argmax over -inf would pick id 0, which the grammar refuses). No host sync: the choice is a where."""
    if batch.banned_rows.numel():
        index = (batch.banned_rows, batch.banned_ids)
        kept = logits[index]
        logits.index_put_(index, logits.new_full((), _NEG_INF))
        nothing_left = torch.isneginf(logits.index_select(0, batch.banned_rows)).all(dim=-1)
        logits.index_put_(index, torch.where(nothing_left, kept, logits.new_full((), _NEG_INF)))


def apply_penalties_(logits: torch.Tensor, batch: BatchParams) -> None:
    """Repetition, frequency and presence penalties on the rows that use them.

    repetition p, for tokens seen in prompt or output: logit / p if logit > 0 else logit * p
    frequency f and presence r, over output counts c:  logit - f * c - r * (c > 0)
    """
    if not batch.penalty_rows.numel():
        return
    output_counts = token_counts(batch.output_ids, batch.vocab)
    seen = token_counts(batch.history_ids, batch.vocab) > 0
    penalised = logits.index_select(0, batch.penalty_rows)
    repetition = batch.repetition[:, None]
    repeated = torch.where(penalised > 0, penalised / repetition, penalised * repetition)
    penalised = torch.where(seen, repeated, penalised)
    penalised -= batch.frequency[:, None] * output_counts + batch.presence[:, None] * (
        output_counts > 0
    )
    logits.index_copy_(0, batch.penalty_rows, penalised)


def token_counts(padded: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] float counts of each token id in each row of `padded` (ids `vocab` are padding)."""
    # the padding's column is dropped
    counts = torch.zeros(padded.shape[0], vocab + 1, device=padded.device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab]


def sampling_probs(logits: torch.Tensor, batch: BatchParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p; the renormalised probabilities of the kept tokens."""
    logits = logits / batch.temperature[:, None]
    if batch.filters_top_k_top_p:
        logits = apply_top_k_top_p(logits, batch.top_k[:, None], batch.top_p[:, None])
    if batch.filters_min_p:
        logits = apply_min_p(logits, batch.min_p[:, None])
    return logits.softmax(dim=-1)


# On the CPU, top-k / top-p look at each row's 64 largest logits first (torch.topk), then at its 1,024 largest
# where the kept tokens reach past those, and sort a whole row only where they reach past these too: a sort of
# 49,152 logits costs ~2 ms a row on one core, its 64 largest ~0.05 ms (docs/BENCHMARKS.md, "CPU sampling").
# CUDA sorts every row (fast there, and deciding per row would need a host sync).
CPU_CANDIDATES = (64, 1024)
# a row undecided by its 64 largest goes on to its 1,024 largest only where the 64 hold this share of its top_p
# (the default model's and the benchmark's language-like rows: 0.82-0.90 of 0.9; rows of randn * 2: 0.35-0.52)
NEXT_LEVEL_MASS = 0.75


def decides_on_host(tensor: torch.Tensor) -> bool:
    """Whether the sampler takes its host paths for ``tensor`` (top-k / top-p from candidates, the draw through
    the cumulative distribution), which read values back: CPU tensors, already on the host."""
    return tensor.device.type == "cpu"


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Keep each row's top_k largest, then the smallest most-likely prefix whose probability >= top_p."""
    if decides_on_host(logits):
        return top_k_top_p_from_candidates(logits, top_k, top_p, CPU_CANDIDATES)
    return top_k_top_p_sorted(logits, top_k, top_p)


def top_k_top_p_sorted(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """apply_top_k_top_p over each whole row, sorted."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    position = torch.arange(logits.shape[-1], device=logits.device)
    sorted_logits.masked_fill_(position >= top_k, _NEG_INF)

    probs = sorted_logits.softmax(dim=-1)  # renormalised over the top-k survivors
    # Keep a token while the mass of the strictly more likely ones is below top_p; the first always stays
    # (also when a tiny top_p rounds to 0 in float32). top_p = 1 keeps everything, even where rounding brings
    # the running sum to 1 early.
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits.masked_fill_((mass_before >= top_p) & (top_p < 1) & (position > 0), _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def top_k_top_p_from_candidates(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, widths: tuple[int, ...]
) -> torch.Tensor:
    """apply_top_k_top_p from each row's ``widths[0]`` largest logits where they decide the row; the rows they do
    not decide from ``widths[1:]`` the same way where those can, the rest sorted whole (CPU: reads on the host)."""
    vocab = logits.shape[-1]
    if not widths or widths[0] >= vocab:
        return top_k_top_p_sorted(logits, top_k, top_p)
    following = widths[1] if len(widths) > 1 and widths[1] < vocab else None
    out, decided, next_may_decide = filter_among_largest(logits, top_k, top_p, widths[0], following)
    for rows, later in (
        (~decided & next_may_decide, widths[1:]),
        (~decided & ~next_may_decide, ()),
    ):
        rest = rows.nonzero().squeeze(-1)
        if rest.numel():
            out[rest] = top_k_top_p_from_candidates(logits[rest], top_k[rest], top_p[rest], later)
    return out


def filter_among_largest(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    width: int,
    following: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(apply_top_k_top_p's rows, which of them are right, which of the others the ``following`` largest could
    decide) from each row's ``width`` largest logits. A row is decided where its top_k is within them, or its
    top_p prefix ends among them (probabilities normalised over the whole row, as top_k then keeps every token),
    or it has neither filter (passed as is). The following largest can decide a row whose top_k is within them
    or whose prefix can end there: the candidates' mass plus the next ones', each at most the last candidate's."""
    vocab = logits.shape[-1]
    values, ids = logits.topk(width, dim=-1)  # sorted, largest first
    position = torch.arange(width)
    in_top_k = position < top_k
    whole_row = top_k >= vocab
    normaliser = torch.where(
        whole_row,
        logits.logsumexp(dim=-1, keepdim=True),
        values.masked_fill(~in_top_k, _NEG_INF).logsumexp(dim=-1, keepdim=True),
    )
    probs = (values - normaliser).exp_().masked_fill_(~in_top_k, 0.0)
    mass_before = probs.cumsum(dim=-1) - probs
    dropped = ~in_top_k | ((mass_before >= top_p) & (top_p < 1) & (position > 0))
    out = torch.full_like(logits, _NEG_INF).scatter_(1, ids, values.masked_fill(dropped, _NEG_INF))
    unfiltered = (whole_row & (top_p >= 1)).squeeze(-1)
    if unfiltered.any():
        out[unfiltered] = logits[unfiltered]
    decided = ((top_k <= width) | (whole_row & dropped[:, -1:])).squeeze(-1) | unfiltered
    if following is None:
        return out, decided, torch.zeros_like(decided)
    mass = mass_before[:, -1:] + probs[:, -1:]
    reach = mass + probs[:, -1:] * (following - width - 1)
    # (and, a cost guess that never changes a result: a row whose candidates hold under NEXT_LEVEL_MASS of its
    # top_p has a flat tail, its prefix thousands of tokens long: sorted at once)
    likely = (reach >= top_p) & (mass >= NEXT_LEVEL_MASS * top_p)
    next_may_decide = (top_k <= following) | (whole_row & likely)
    return out, decided, next_may_decide.squeeze(-1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p); no softmax needed, and min_p = 0 gives -inf.
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p)
    return logits.masked_fill(logits < threshold, _NEG_INF)
