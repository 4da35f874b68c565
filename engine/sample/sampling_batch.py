"""BatchParams: the sampler's per-row parameters for a batch, gathered on the host, uploaded as device tensors.

Every int list travels in one int64 and every float list in one float32 host-to-device copy (from pinned memory
on CUDA, which the host does not wait for), handed back as views. Sampled rows are indexed among themselves
(temperature, top_k, top_p, min_p, seeds); a seeded row's draw key is draw_key(seed, outputs so far)
(seeded_noise.py). Penalised rows carry their output ids and their prompt + output ids as [rows, width]
tables padded with the id ``vocab``.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import torch

from engine.sequence import Sequence
from engine.sample.seeded_noise import draw_key

_INT_FIELDS = (
    "sampled_rows",
    "top_k",
    "seeded",
    "seed_keys",
    "unseeded",
    "banned_rows",
    "banned_ids",
    "bias_rows",
    "bias_ids",
    "penalty_rows",
    "output_ids",
    "history_ids",
    "logprob_rows",
)
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "bias_values",
    "repetition",
    "frequency",
    "presence",
)


@dataclass(slots=True)
class BatchParams:
    """The batch's parameters as device tensors. Rows are rows of the batch unless said otherwise."""

    vocab: int
    # alternatives in the logprob table (most asked, at most vocab); None: none asked
    logprob_k: int | None
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
    # [P] rows with penalties; repetition, frequency, presence per penalty row
    penalty_rows: torch.Tensor
    repetition: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor
    output_ids: torch.Tensor  # [P, width] output token ids, padded with the id `vocab`
    history_ids: torch.Tensor  # [P, width] prompt and output token ids, padded likewise
    logprob_rows: torch.Tensor  # [L] rows asking for logprobs

    @classmethod
    def build(
        cls, seqs: list[Sequence], eos_token_ids: tuple[int, ...], vocab: int, device: torch.device
    ) -> BatchParams:
        ints: dict[str, list[int]] = {name: [] for name in _INT_FIELDS}
        floats: dict[str, list[float]] = {name: [] for name in _FLOAT_FIELDS}
        for row, seq in enumerate(seqs):
            if seq.params.logprobs is not None:
                ints["logprob_rows"].append(row)
            _gather_draw(row, seq, vocab, ints, floats)
            _gather_masks(row, seq, eos_token_ids, vocab, ints, floats)
        penalised = _gather_penalties(seqs, ints, floats)
        output_width = _pad_into(
            ints["output_ids"], [seq.output_token_ids for seq in penalised], vocab
        )
        history_width = _pad_into(ints["history_ids"], [seq.token_ids for seq in penalised], vocab)

        tensors = _upload(ints, torch.int64, device) | _upload(floats, torch.float32, device)
        tensors["output_ids"] = tensors["output_ids"].view(len(penalised), output_width)
        tensors["history_ids"] = tensors["history_ids"].view(len(penalised), history_width)
        asked = [seq.params.logprobs for seq in seqs if seq.params.logprobs is not None]
        return cls(
            vocab=vocab,
            logprob_k=min(max(asked), vocab) if asked else None,
            filters_top_k_top_p=any(k < vocab for k in ints["top_k"])
            or any(p < 1 for p in floats["top_p"]),
            filters_min_p=any(p > 0 for p in floats["min_p"]),
            **tensors,
        )


def _gather_draw(
    row: int, seq: Sequence, vocab: int, ints: dict[str, list[int]], floats: dict[str, list[float]]
) -> None:
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


def _gather_masks(
    row: int,
    seq: Sequence,
    eos_token_ids: tuple[int, ...],
    vocab: int,
    ints: dict[str, list[int]],
    floats: dict[str, list[float]],
) -> None:
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


def _gather_penalties(
    seqs: list[Sequence], ints: dict[str, list[int]], floats: dict[str, list[float]]
) -> list[Sequence]:
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


def _upload(
    lists: dict[str, list], dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """Every list in one host-to-device copy, handed back as views. On CUDA the copy is from pinned memory
    and non-blocking: a copy from pageable memory would make the host wait for the stream."""
    host = torch.tensor(list(chain.from_iterable(lists.values())), dtype=dtype)
    if device.type == "cuda":
        host = host.pin_memory()
    views = host.to(device, non_blocking=True).split([len(values) for values in lists.values()])
    return dict(zip(lists, views))
