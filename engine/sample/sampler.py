"""Sampler: one row of logits per sequence in, one next token per sequence out (vLLM semantics).

Per row, in order:
  0. structured output: tokens outside the row's allowed-token bitmask are masked (when a bitmask is given);
  1. logit_bias is added; min_tokens: EOS (unless ignore_eos) and stop_token_ids are masked until the row has
     min_tokens outputs;
  2. penalties: repetition (prompt + output), then frequency and presence (output only);
  3. greedy rows take the argmax; the others divide by temperature and keep top-k, then top-p, then min-p,
     and draw one token.
Logprobs, when asked for, describe the model distribution before steps 1-3 (after step 0, as vLLM's runner
applies the grammar bitmask before its sampler).

No host sync: ``Sampler.__call__`` only launches device work, so the engine can prepare the next step while
the device runs this one. The batch's parameters travel in one int64 and one float32 host-to-device copy
(from pinned memory on CUDA, which the host does not wait for); ``SamplerOutput.logprobs()`` is the one read
that waits for the device.

Seeds: a draw is ``argmax_i p_i / E_i`` with E_i ~ Exp(1). For a seeded row, E_i is a pure function of
(seed, number of output tokens so far, token id i): a splitmix64 hash computed on the device. So the same seed
gives the same tokens whatever else is in the batch, whether the step ran lagged or not, after a preemption's
recomputation, and on any device up to float rounding (CPU and GPU may part only where two candidates' scores
tie to within rounding). Unseeded rows share one batched draw from the device's default generator: the same
race on CUDA; on the CPU, where a generator call per token is the step's largest cost, one uniform per row
through the row's cumulative distribution (``inverse_cdf``).

The steps' parts: sampling_batch.py gathers the batch's parameters, logits_processors.py holds steps 0-2 and the
temperature and filters of step 3, seeded_noise.py the seeded rows' noise; the draw and the logprob table are here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sequence import Sequence
from engine.sample import logits_processors
from engine.sample.logits_processors import (
    apply_logit_bias_,
    apply_min_tokens_,
    apply_penalties_,
    sampling_probs,
    unpack_bitmask,
)
from engine.sample.sampling_batch import BatchParams
from engine.sample.seeded_noise import exponential_noise, exponential_noise_at
from engine.sample.token_logprobs import TokenLogprobs
from kernels import ops as kernel_ops

_NEG_INF = float("-inf")


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [rows] int64 on the logits' device; one sampled token per row
    num_logprobs: list[int | None]  # per row: params.logprobs (None = not asked)
    # [rows asking, 3 + 2k] float64 on the device: see logprob_table
    logprob_table: torch.Tensor | None = None

    def logprobs(self) -> list[TokenLogprobs | None]:
        """Host read (syncs): per row, its TokenLogprobs or None where params.logprobs is None. Returns
        [None] * rows without touching the device when no row asked."""
        if self.logprob_table is None:
            return [None] * len(self.num_logprobs)
        table = iter(self.logprob_table.tolist())  # the one device-to-host copy
        result: list[TokenLogprobs | None] = []
        for k in self.num_logprobs:
            if k is None:
                result.append(None)
                continue
            token_id, logprob, rank, *top = next(table)
            width = len(top) // 2  # the table's k: top ids, then their logprobs
            pairs = [(int(t), lp) for t, lp in zip(top[:k], top[width : width + k])]
            result.append(TokenLogprobs(int(token_id), logprob, int(rank), pairs))
        return result


class Sampler:
    def __call__(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        eos_token_ids: tuple[int, ...],
        allowed: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """Launch the sampling of one token per row; returns without waiting for the device.

        ``allowed``: optional [rows, ceil(vocab / 32)] int32 bitmask (structured output); bit t % 32 of word
        t // 32 is set where token t may be sampled."""
        num_logprobs = [seq.params.logprobs for seq in seqs]
        vocab = logits.shape[-1]
        if all(_is_plain_greedy(seq) for seq in seqs):
            if allowed is None:  # the common decode step: one kernel
                return SamplerOutput(kernel_ops.greedy_argmax(logits), num_logprobs)
            # greedy under a grammar (a tool call, response_format): the masked argmax, without the per-row
            # parameter tables of the general path
            masked = logits.masked_fill(~unpack_bitmask(allowed, vocab), _NEG_INF)
            return SamplerOutput(kernel_ops.greedy_argmax(masked), num_logprobs)
        batch = BatchParams.build(seqs, eos_token_ids, vocab, logits.device)
        # changed in place below; the caller's logits are not
        work = logits.to(torch.float32, copy=True)
        if allowed is not None:
            work.masked_fill_(~unpack_bitmask(allowed, vocab), _NEG_INF)
        raw = (
            work.index_select(0, batch.logprob_rows).log_softmax(dim=-1)
            if batch.logprob_k is not None
            else None
        )
        apply_logit_bias_(work, batch)
        apply_min_tokens_(work, batch)
        apply_penalties_(work, batch)
        token_ids = choose_tokens(work, batch)
        if raw is None:
            return SamplerOutput(token_ids, num_logprobs)
        sampled = token_ids.index_select(0, batch.logprob_rows)
        return SamplerOutput(token_ids, num_logprobs, logprob_table(raw, sampled, batch.logprob_k))


def _is_plain_greedy(seq: Sequence) -> bool:
    """Greedy without penalties, logprobs or logit bias, its min_tokens reached (``Sequence.plain_greedy_from``:
    decided once from its params; this runs per row per step)."""
    return 0 <= seq.plain_greedy_from <= len(seq.token_ids)


# ---------------------------------------------------------------- choosing tokens


def choose_tokens(logits: torch.Tensor, batch: BatchParams) -> torch.Tensor:
    """Greedy rows: argmax (the lowest id among ties). Other rows: a filtered, renormalised draw."""
    num_sampled = batch.sampled_rows.numel()
    if not num_sampled:
        return logits.argmax(dim=-1)
    some_greedy = num_sampled < logits.shape[0]
    chosen = logits.argmax(dim=-1) if some_greedy else None
    probs = sampling_probs(
        logits.index_select(0, batch.sampled_rows) if some_greedy else logits, batch
    )
    if logits_processors.decides_on_host(probs):
        drawn = draw_on_cpu(probs, batch)
    else:
        drawn = (probs / race_noise(probs, batch)).argmax(dim=-1)
    return chosen.index_copy_(0, batch.sampled_rows, drawn) if some_greedy else drawn


def draw_on_cpu(probs: torch.Tensor, batch: BatchParams) -> torch.Tensor:
    """The CPU's draw: seeded rows race their hashed noise (``seeded_race``: the same token as on any device),
    the others invert their distribution at one uniform each (``inverse_cdf``): the race's Exp(1) noise costs a
    generator call per token (~17 ms for 16 rows x 49,152 on two cores), the inversion one pass over the row."""
    if not batch.seeded.numel():
        return inverse_cdf(probs)
    if not batch.unseeded.numel():
        return seeded_race(probs, batch.seed_keys)
    drawn = torch.empty(probs.shape[0], dtype=torch.int64)
    drawn.index_copy_(0, batch.unseeded, inverse_cdf(probs.index_select(0, batch.unseeded)))
    raced = seeded_race(probs.index_select(0, batch.seeded), batch.seed_keys)
    return drawn.index_copy_(0, batch.seeded, raced)


# a seeded row races among its possible tokens alone (noise hashed for those only) where they are at most
# vocab / SPARSE_RACE: a top-p prefix, a grammar's allowed tokens
SPARSE_RACE = 4


def seeded_race(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``argmax_i p_i / E_i`` per row with its hashed noise (``exponential_noise``), the lowest id among ties:
    the token race_noise's race picks. A row with few possible tokens (p_i > 0: no other can win, 0 / E = 0)
    hashes the noise of those only. For CPU tensors (it reads on the host)."""
    vocab = probs.shape[-1]
    possible = probs > 0
    few = possible.sum(dim=-1) <= vocab // SPARSE_RACE
    chosen = torch.empty(probs.shape[0], dtype=torch.int64)
    if not few.all():
        many = ~few
        chosen[many] = (probs[many] / exponential_noise(keys[many], vocab)).argmax(dim=-1)
    if few.any():
        rows, ids = possible[few].nonzero(as_tuple=True)  # (ids ascending within a row)
        scores = probs[few][rows, ids] / exponential_noise_at(keys[few][rows], ids[:, None])[:, 0]
        best = torch.zeros(int(few.sum())).scatter_reduce_(0, rows, scores, "amax")
        winners = scores == best[rows]
        # (a row with no possible token, from degenerate logits: 0, as the whole row's argmax)
        lowest = torch.zeros_like(best, dtype=torch.int64)
        chosen[few] = lowest.scatter_reduce_(
            0, rows[winners], ids[winners], "amin", include_self=False
        )
    return chosen


def inverse_cdf(probs: torch.Tensor) -> torch.Tensor:
    """One token per row with probability proportional to ``probs`` (unnormalised, >= 0): the first token whose
    running sum passes a uniform draw from torch's default generator times the row's total. torch sums in
    float64 on the CPU, so each running sum is its float32 rounding (within 6e-8 of the exact one). A token of
    probability 0 adds nothing to the running sum, so it is never the first to pass; where rounding puts the
    draw at the total, the row's most likely token is taken. For CPU tensors (it reads on the host)."""
    cdf = probs.cumsum(dim=-1)
    target = torch.rand(probs.shape[0], 1, device=probs.device) * cdf[:, -1:]
    chosen = torch.searchsorted(cdf, target, right=True).clamp_max_(probs.shape[-1] - 1).squeeze(-1)
    missed = (probs.gather(1, chosen[:, None]) <= 0).squeeze(-1)
    if missed.any():  # (a host read: this runs on the CPU)
        chosen[missed] = probs[missed].argmax(dim=-1)
    return chosen


def race_noise(probs: torch.Tensor, batch: BatchParams) -> torch.Tensor:
    """Exp(1) noise for the exponential race ``argmax_i p_i / E_i``, which picks i with probability p_i.

    Unlike multinomial it needs no host sync, and a zero-probability token can never win (0 / E = 0 while the
    kept tokens score > 0). Seeded rows get their hashed noise, the others one batched draw, clamped so that
    a zero E cannot turn 0 / 0 into a NaN that argmax would pick."""
    num_seeded = batch.seeded.numel()
    if not num_seeded:
        return torch.empty_like(probs).exponential_().clamp_min_(torch.finfo(probs.dtype).tiny)
    seeded = exponential_noise(batch.seed_keys, batch.vocab)
    if num_seeded == probs.shape[0]:
        return seeded
    unseeded = probs.new_empty(batch.unseeded.numel(), batch.vocab).exponential_()
    noise = torch.empty_like(probs)
    noise.index_copy_(0, batch.unseeded, unseeded.clamp_min_(torch.finfo(probs.dtype).tiny))
    return noise.index_copy_(0, batch.seeded, seeded)


# ---------------------------------------------------------------- logprobs


def logprob_table(raw: torch.Tensor, sampled: torch.Tensor, k: int) -> torch.Tensor:
    """[rows, 3 + 2k] float64, read in one copy: the sampled id, its raw logprob, its rank (vLLM's: the tokens
    at least as likely, itself included), then the k most likely ids and their logprobs."""
    sampled_logprobs = raw.gather(1, sampled[:, None])
    ranks = (raw >= sampled_logprobs).sum(dim=-1, keepdim=True)
    top_logprobs, top_ids = raw.topk(k, dim=-1)
    columns = (sampled[:, None], sampled_logprobs, ranks, top_ids, top_logprobs)
    return torch.cat([column.to(torch.float64) for column in columns], dim=1)  # ids < 2^53: exact
