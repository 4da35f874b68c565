"""Sampler: one row of logits per sequence in, one next token per sequence out (vLLM semantics).

Per row, in order:
  1. min_tokens: EOS (unless ignore_eos) and stop_token_ids are masked until the row has min_tokens outputs;
  2. penalties: repetition (prompt + output), then frequency and presence (output only);
  3. greedy rows take the argmax; the others divide by temperature and keep top-k, then top-p, then min-p,
     and draw one token.
Logprobs, when asked for, describe the raw model distribution: the logits before steps 1-3.

Rows with a seed draw on the CPU with their own generator, so that a seed gives the same tokens whatever
else is in the batch and whichever device ran the model; the other rows share one batched draw.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

_NEG_INF = float("-inf")


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int  # the sampled token
    logprob: float  # its log-probability under the raw model distribution
    rank: int  # 1 = most likely; ties share the worse rank (tokens at least as likely, itself included)
    top: list[tuple[int, float]]  # params.logprobs most likely (token_id, logprob), most likely first


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # one sampled token per row
    logprobs: list[TokenLogprobs | None]  # per row; None where params.logprobs is None


class Sampler:
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: tuple[int, ...]) -> SamplerOutput:
        if all(_is_plain_greedy(seq) for seq in seqs):
            # The common decode step: one kernel and one device-to-host copy.
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * len(seqs))
        logits = logits.float()
        processed = apply_penalties(apply_min_tokens(logits, seqs, eos_token_ids), seqs)
        token_ids = choose_tokens(processed, seqs)
        return SamplerOutput(token_ids, compute_logprobs(logits, seqs, token_ids))


def _is_plain_greedy(seq: Sequence) -> bool:
    params = seq.params
    return (params.greedy and not params.uses_penalties and params.logprobs is None
            and seq.num_output_tokens >= params.min_tokens)


def apply_min_tokens(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """Mask EOS and stop token ids of rows that have fewer than min_tokens outputs (out of place)."""
    vocab = logits.shape[-1]
    rows: list[int] = []
    cols: list[int] = []
    for i, seq in enumerate(seqs):
        if seq.num_output_tokens >= seq.params.min_tokens:
            continue
        banned = set(seq.params.stop_token_ids)
        if not seq.params.ignore_eos:  # with ignore_eos, EOS ends nothing, so there is nothing to delay
            banned.update(eos_token_ids)
        ids = sorted(t for t in banned if t < vocab)  # an id outside the vocabulary is never produced
        rows.extend([i] * len(ids))
        cols.extend(ids)
    if not rows:
        return logits
    index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
    return logits.index_put(index, torch.tensor(_NEG_INF, device=logits.device))


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Repetition, frequency and presence penalties on the rows that use them (out of place).

    repetition p, for tokens seen in prompt or output: logit / p if logit > 0 else logit * p
    frequency f and presence r, over output counts c:  logit - f * c - r * (c > 0)
    """
    rows = [i for i, seq in enumerate(seqs) if seq.params.uses_penalties]
    if not rows:
        return logits
    device, vocab = logits.device, logits.shape[-1]
    group = [seqs[i] for i in rows]
    output_counts = token_counts([seq.output_token_ids for seq in group], vocab, device)
    seen = (token_counts([seq.prompt_token_ids for seq in group], vocab, device) > 0) | (output_counts > 0)
    repetition = _column([seq.params.repetition_penalty for seq in group], device)
    frequency = _column([seq.params.frequency_penalty for seq in group], device)
    presence = _column([seq.params.presence_penalty for seq in group], device)

    row_index = torch.tensor(rows, device=device)
    penalised = logits[row_index]
    repeated = torch.where(penalised > 0, penalised / repetition, penalised * repetition)
    penalised = torch.where(seen, repeated, penalised)
    penalised = penalised - frequency * output_counts - presence * (output_counts > 0).float()
    return logits.index_put((row_index,), penalised)


def token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] float counts of each token id in each list."""
    width = max((len(tokens) for tokens in token_lists), default=0)
    # Pad with the id `vocab`, which lands in an extra column that is dropped afterwards.
    padded = torch.tensor([tokens + [vocab] * (width - len(tokens)) for tokens in token_lists],
                          dtype=torch.long, device=device).view(len(token_lists), width)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab]


def choose_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """Greedy rows: argmax. Other rows: filtered, renormalised draw (seeded rows on the CPU)."""
    chosen = logits.argmax(dim=-1)
    sampled = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
    if not sampled:
        return chosen.tolist()
    sampled_index = torch.tensor(sampled, device=logits.device)
    probs = sampling_probs(logits[sampled_index], [seqs[i].params for i in sampled])
    unseeded = [j for j, i in enumerate(sampled) if seqs[i].generator is None]
    seeded = [j for j, i in enumerate(sampled) if seqs[i].generator is not None]
    if unseeded:
        local = torch.tensor(unseeded, device=logits.device)
        chosen[sampled_index[local]] = exponential_race(probs[local])
    token_ids = chosen.tolist()
    if seeded:
        seeded_probs = probs[torch.tensor(seeded, device=logits.device)].cpu()  # one transfer for all
        for row_probs, j in zip(seeded_probs, seeded):
            i = sampled[j]
            token_ids[i] = int(exponential_race(row_probs[None], seqs[i].generator)[0])
    return token_ids


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p; the renormalised probabilities of the kept tokens."""
    temperature = _column([p.temperature for p in params], logits.device)
    logits = apply_top_k_top_p(logits / temperature, params)
    logits = apply_min_p(logits, params)
    return logits.softmax(dim=-1)


def apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Keep each row's top_k largest, then the smallest most-likely prefix whose probability >= top_p."""
    vocab, device = logits.shape[-1], logits.device
    top_k = [p.top_k if p.top_k > 0 else vocab for p in params]
    top_p = [p.top_p for p in params]
    if min(top_k) >= vocab and min(top_p) >= 1:
        return logits  # no row filters: skip the sort, the costly part
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    position = torch.arange(vocab, device=device)
    sorted_logits = sorted_logits.masked_fill(position >= torch.tensor(top_k, device=device)[:, None], _NEG_INF)

    probs = sorted_logits.softmax(dim=-1)  # renormalised over the top-k survivors
    # Keep a token while the mass of the strictly more likely ones is below top_p; the first always stays.
    # top_p = 1 keeps everything, even where rounding brings the running sum to 1 early.
    mass_before = probs.cumsum(dim=-1) - probs
    top_p_column = _column(top_p, device)
    drop = (mass_before >= top_p_column) & (top_p_column < 1)
    sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.full_like(logits, _NEG_INF).scatter(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    if all(p.min_p == 0 for p in params):
        return logits
    min_p = _column([p.min_p for p in params], logits.device)
    # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p); no softmax needed, and min_p = 0 gives -inf.
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p)
    return logits.masked_fill(logits < threshold, _NEG_INF)


def exponential_race(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row: argmax_i p_i / E_i with E_i ~ Exp(1) picks i with probability p_i.

    Unlike multinomial it needs no host sync, and a zero-probability token can never win (0 / E = 0 while
    the kept tokens score > 0). The clamp keeps a zero E from turning 0 / 0 into a NaN that argmax would pick.
    """
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def compute_logprobs(logits: torch.Tensor, seqs: list[Sequence], token_ids: list[int]) -> list[TokenLogprobs | None]:
    """Raw-distribution logprob and rank of each sampled token, plus the top params.logprobs alternatives."""
    result: list[TokenLogprobs | None] = [None] * len(seqs)
    rows = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
    if not rows:
        return result
    device = logits.device
    logprobs = torch.log_softmax(logits[torch.tensor(rows, device=device)], dim=-1)
    sampled = torch.tensor([token_ids[i] for i in rows], device=device)[:, None]
    sampled_logprobs = logprobs.gather(1, sampled)
    ranks = (logprobs >= sampled_logprobs).sum(dim=-1)  # vLLM's rank: ties count against the token
    k = min(max(seqs[i].params.logprobs for i in rows), logprobs.shape[-1])
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)

    sampled_list, rank_list = sampled_logprobs[:, 0].tolist(), ranks.tolist()
    top_lp_list, top_id_list = top_logprobs.tolist(), top_ids.tolist()
    for j, i in enumerate(rows):
        k_i = seqs[i].params.logprobs
        top = list(zip(top_id_list[j][:k_i], top_lp_list[j][:k_i]))
        result[i] = TokenLogprobs(token_ids[i], sampled_list[j], rank_list[j], top)
    return result


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    """A per-row parameter as a [rows, 1] float32 tensor, ready to broadcast over the vocabulary."""
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]
