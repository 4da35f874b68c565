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
tie to within rounding). Unseeded rows share one batched draw from the device's default generator.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import torch

from engine.core.sequence import Sequence

_NEG_INF = float("-inf")
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's state increment
_MULTIPLIERS = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)  # splitmix64's finaliser
_SHIFTS = (30, 27, 31)


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int  # the sampled token
    logprob: float  # its log-probability under the raw model distribution
    rank: int  # 1 = most likely; ties share the worse rank (tokens at least as likely, itself included)
    top: list[tuple[int, float]]  # params.logprobs most likely (token_id, logprob), most likely first


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [rows] int64 on the logits' device; one sampled token per row
    num_logprobs: list[int | None]  # per row: params.logprobs (None = not asked)
    logprob_table: torch.Tensor | None = None  # [rows asking, 3 + 2k] float64 on the device: see logprob_table

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
            pairs = [(int(t), lp) for t, lp in zip(top[:k], top[width:width + k])]
            result.append(TokenLogprobs(int(token_id), logprob, int(rank), pairs))
        return result


class Sampler:
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: tuple[int, ...],
                 allowed: torch.Tensor | None = None) -> SamplerOutput:
        """Launch the sampling of one token per row; returns without waiting for the device.

        ``allowed``: optional [rows, ceil(vocab / 32)] int32 bitmask (structured output); bit t % 32 of word
        t // 32 is set where token t may be sampled."""
        num_logprobs = [seq.params.logprobs for seq in seqs]
        if allowed is None and all(_is_plain_greedy(seq) for seq in seqs):
            return SamplerOutput(logits.argmax(dim=-1), num_logprobs)  # the common decode step: one kernel
        vocab = logits.shape[-1]
        batch = BatchParams.build(seqs, eos_token_ids, vocab, logits.device)
        work = logits.to(torch.float32, copy=True)  # changed in place below; the caller's logits are not
        if allowed is not None:
            work.masked_fill_(~unpack_bitmask(allowed, vocab), _NEG_INF)
        raw = work.index_select(0, batch.logprob_rows).log_softmax(dim=-1) if batch.logprob_k is not None else None
        apply_logit_bias_(work, batch)
        apply_min_tokens_(work, batch)
        apply_penalties_(work, batch)
        token_ids = choose_tokens(work, batch)
        if raw is None:
            return SamplerOutput(token_ids, num_logprobs)
        sampled = token_ids.index_select(0, batch.logprob_rows)
        return SamplerOutput(token_ids, num_logprobs, logprob_table(raw, sampled, batch.logprob_k))


def _is_plain_greedy(seq: Sequence) -> bool:
    params = seq.params
    return (params.greedy and not params.uses_penalties and params.logprobs is None and not params.logit_bias
            and seq.num_output_tokens >= params.min_tokens)


# ---------------------------------------------------------------- the batch's parameters

_INT_FIELDS = ("sampled_rows", "top_k", "seeded", "seed_keys", "unseeded", "banned_rows", "banned_ids",
               "bias_rows", "bias_ids", "penalty_rows", "output_ids", "history_ids", "logprob_rows")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "bias_values", "repetition", "frequency", "presence")


@dataclass(slots=True)
class BatchParams:
    """The batch's parameters as device tensors. Rows are rows of the batch unless said otherwise."""

    vocab: int
    logprob_k: int | None  # alternatives in the logprob table (most asked, at most vocab); None: none asked
    filters_top_k_top_p: bool  # some sampled row keeps fewer than all tokens by top-k or top-p
    filters_min_p: bool
    sampled_rows: torch.Tensor  # [S] rows that draw (not greedy)
    temperature: torch.Tensor  # [S] per sampled row, as are top_k (vocab when off), top_p and min_p
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seeded: torch.Tensor  # [S'] positions among the sampled rows of the rows with a seed
    seed_keys: torch.Tensor  # [S'] their draw keys (draw_key)
    unseeded: torch.Tensor  # positions among the sampled rows of the others
    banned_rows: torch.Tensor  # (banned_rows[j], banned_ids[j]): masked by min_tokens
    banned_ids: torch.Tensor
    bias_rows: torch.Tensor  # logit_bias: bias_values[j] is added at (bias_rows[j], bias_ids[j])
    bias_ids: torch.Tensor
    bias_values: torch.Tensor
    penalty_rows: torch.Tensor  # [P] rows with penalties; repetition, frequency, presence per penalty row
    repetition: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor
    output_ids: torch.Tensor  # [P, width] output token ids, padded with the id `vocab`
    history_ids: torch.Tensor  # [P, width] prompt and output token ids, padded likewise
    logprob_rows: torch.Tensor  # [L] rows asking for logprobs

    @classmethod
    def build(cls, seqs: list[Sequence], eos_token_ids: tuple[int, ...], vocab: int,
              device: torch.device) -> BatchParams:
        ints: dict[str, list[int]] = {name: [] for name in _INT_FIELDS}
        floats: dict[str, list[float]] = {name: [] for name in _FLOAT_FIELDS}
        for row, seq in enumerate(seqs):
            if seq.params.logprobs is not None:
                ints["logprob_rows"].append(row)
            _gather_draw(row, seq, vocab, ints, floats)
            _gather_masks(row, seq, eos_token_ids, vocab, ints, floats)
        penalised = _gather_penalties(seqs, ints, floats)
        output_width = _pad_into(ints["output_ids"], [seq.output_token_ids for seq in penalised], vocab)
        history_width = _pad_into(ints["history_ids"], [seq.token_ids for seq in penalised], vocab)

        tensors = _upload(ints, torch.int64, device) | _upload(floats, torch.float32, device)
        tensors["output_ids"] = tensors["output_ids"].view(len(penalised), output_width)
        tensors["history_ids"] = tensors["history_ids"].view(len(penalised), history_width)
        asked = [seq.params.logprobs for seq in seqs if seq.params.logprobs is not None]
        return cls(vocab=vocab, logprob_k=min(max(asked), vocab) if asked else None,
                   filters_top_k_top_p=any(k < vocab for k in ints["top_k"]) or any(p < 1 for p in floats["top_p"]),
                   filters_min_p=any(p > 0 for p in floats["min_p"]), **tensors)


def _gather_draw(row: int, seq: Sequence, vocab: int, ints: dict[str, list[int]],
                 floats: dict[str, list[float]]) -> None:
    params = seq.params
    if params.greedy:
        return
    position = len(ints["sampled_rows"])
    ints["sampled_rows"].append(row)
    ints["top_k"].append(params.top_k if 0 < params.top_k < vocab else vocab)
    floats["temperature"].append(params.temperature)
    floats["top_p"].append(params.top_p)
    floats["min_p"].append(params.min_p)
    if params.seed is None:
        ints["unseeded"].append(position)
    else:
        ints["seeded"].append(position)
        ints["seed_keys"].append(draw_key(params.seed, seq.num_output_tokens))


def _gather_masks(row: int, seq: Sequence, eos_token_ids: tuple[int, ...], vocab: int,
                  ints: dict[str, list[int]], floats: dict[str, list[float]]) -> None:
    """min_tokens' banned ids and logit_bias entries (an id outside the vocabulary is never produced)."""
    params = seq.params
    if seq.num_output_tokens < params.min_tokens:
        banned = set(params.stop_token_ids)
        if not params.ignore_eos:  # with ignore_eos, EOS ends nothing, so there is nothing to delay
            banned.update(eos_token_ids)
        ids = sorted(t for t in banned if t < vocab)
        ints["banned_rows"].extend([row] * len(ids))
        ints["banned_ids"].extend(ids)
    for token_id, bias in (params.logit_bias or {}).items():
        if token_id < vocab:
            ints["bias_rows"].append(row)
            ints["bias_ids"].append(token_id)
            floats["bias_values"].append(bias)


def _gather_penalties(seqs: list[Sequence], ints: dict[str, list[int]],
                      floats: dict[str, list[float]]) -> list[Sequence]:
    penalised = []
    for row, seq in enumerate(seqs):
        if seq.params.uses_penalties:
            penalised.append(seq)
            ints["penalty_rows"].append(row)
            floats["repetition"].append(seq.params.repetition_penalty)
            floats["frequency"].append(seq.params.frequency_penalty)
            floats["presence"].append(seq.params.presence_penalty)
    return penalised


def _pad_into(flat: list[int], token_lists: list[list[int]], pad: int) -> int:
    """Append the lists to `flat` as rows padded with `pad` to a common width; returns that width."""
    width = max((len(tokens) for tokens in token_lists), default=0)
    for tokens in token_lists:
        flat.extend(tokens)
        flat.extend([pad] * (width - len(tokens)))
    return width


def _upload(lists: dict[str, list], dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Every list in one host-to-device copy, handed back as views. On CUDA the copy is from pinned memory
    and non-blocking: a copy from pageable memory would make the host wait for the stream."""
    host = torch.tensor(list(chain.from_iterable(lists.values())), dtype=dtype)
    if device.type == "cuda":
        host = host.pin_memory()
    views = host.to(device, non_blocking=True).split([len(values) for values in lists.values()])
    return dict(zip(lists, views))


# ---------------------------------------------------------------- logits processing (in place)

def unpack_bitmask(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, ceil(vocab / 32)] int32 -> [rows, vocab] bool: token t is bit t % 32 of word t // 32."""
    shifts = torch.arange(32, dtype=torch.int32, device=mask.device)
    bits = (mask[:, :, None] >> shifts) & 1  # an arithmetic shift still leaves bit j at the bottom
    return bits.view(mask.shape[0], -1)[:, :vocab].bool()


def apply_logit_bias_(logits: torch.Tensor, batch: BatchParams) -> None:
    if batch.bias_rows.numel():
        index = (batch.bias_rows, batch.bias_ids)  # each (row, id) at most once: no accumulation needed
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
    penalised -= batch.frequency[:, None] * output_counts + batch.presence[:, None] * (output_counts > 0)
    logits.index_copy_(0, batch.penalty_rows, penalised)


def token_counts(padded: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] float counts of each token id in each row of `padded` (ids `vocab` are padding)."""
    counts = torch.zeros(padded.shape[0], vocab + 1, device=padded.device)  # the padding's column is dropped
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab]


# ---------------------------------------------------------------- choosing tokens

def choose_tokens(logits: torch.Tensor, batch: BatchParams) -> torch.Tensor:
    """Greedy rows: argmax (the lowest id among ties). Other rows: a filtered, renormalised draw."""
    chosen = logits.argmax(dim=-1)
    num_sampled = batch.sampled_rows.numel()
    if not num_sampled:
        return chosen
    if num_sampled < logits.shape[0]:
        logits = logits.index_select(0, batch.sampled_rows)
    probs = sampling_probs(logits, batch)
    drawn = (probs / race_noise(probs, batch)).argmax(dim=-1)
    return chosen.index_copy_(0, batch.sampled_rows, drawn)


def sampling_probs(logits: torch.Tensor, batch: BatchParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p; the renormalised probabilities of the kept tokens."""
    logits = logits / batch.temperature[:, None]
    if batch.filters_top_k_top_p:
        logits = apply_top_k_top_p(logits, batch.top_k[:, None], batch.top_p[:, None])
    if batch.filters_min_p:
        logits = apply_min_p(logits, batch.min_p[:, None])
    return logits.softmax(dim=-1)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's top_k largest, then the smallest most-likely prefix whose probability >= top_p."""
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


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p); no softmax needed, and min_p = 0 gives -inf.
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p)
    return logits.masked_fill(logits < threshold, _NEG_INF)


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


# ---------------------------------------------------------------- counter-based noise for seeded rows

def draw_key(seed: int, position: int) -> int:
    """The key of a seeded row's draw of its `position`-th output token: mix(mix(seed) + position), as int64."""
    key = _mix64((_mix64(seed & _MASK64) + position) & _MASK64)
    return _signed(key)


def splitmix64(keys: torch.Tensor, count: int) -> torch.Tensor:
    """[len(keys), count] int64: outputs 1..count of splitmix64 started at each key (output n is
    mix(key + n * golden)), in wrapping int64 arithmetic, so that every device agrees bit for bit."""
    steps = torch.arange(1, count + 1, device=keys.device) * _signed(_GOLDEN)
    z = keys[:, None] + steps
    for shift, multiplier in zip(_SHIFTS, _MULTIPLIERS):
        z.bitwise_xor_(_shift_right(z, shift)).mul_(_signed(multiplier))
    return z.bitwise_xor_(_shift_right(z, _SHIFTS[-1]))


def exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[len(keys), vocab] float32 Exp(1) noise, a pure function of each key and token id: -log(u) with
    u = (2m + 1) / 2^24 from the top 23 bits m of the token's splitmix64 output (exact in float32, in (0, 1))."""
    top_bits = _shift_right(splitmix64(keys, vocab), 41)
    uniform = (top_bits * 2 + 1).to(torch.float32) * 2.0**-24
    return uniform.log_().neg_()


def _mix64(z: int) -> int:
    """splitmix64's finaliser on a Python int in [0, 2^64)."""
    for shift, multiplier in zip(_SHIFTS, _MULTIPLIERS):
        z = ((z ^ (z >> shift)) * multiplier) & _MASK64
    return z ^ (z >> _SHIFTS[-1])


def _shift_right(z: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic: it copies the sign bit)."""
    return (z >> shift).bitwise_and_((1 << (64 - shift)) - 1)


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 that holds it."""
    return value - (1 << 64) if value >= 1 << 63 else value


# ---------------------------------------------------------------- logprobs

def logprob_table(raw: torch.Tensor, sampled: torch.Tensor, k: int) -> torch.Tensor:
    """[rows, 3 + 2k] float64, read in one copy: the sampled id, its raw logprob, its rank (vLLM's: the tokens
    at least as likely, itself included), then the k most likely ids and their logprobs."""
    sampled_logprobs = raw.gather(1, sampled[:, None])
    ranks = (raw >= sampled_logprobs).sum(dim=-1, keepdim=True)
    top_logprobs, top_ids = raw.topk(k, dim=-1)
    columns = (sampled[:, None], sampled_logprobs, ranks, top_ids, top_logprobs)
    return torch.cat([column.to(torch.float64) for column in columns], dim=1)  # ids < 2^53: exact
