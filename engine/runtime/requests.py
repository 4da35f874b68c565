"""A request's samples: how they are made, what each sends, and when one of them stops.

A beam search request is ``beam_width`` sequences, its beam group deciding which of them go on (beam_search.py).
A request of ``n`` samples (or ``best_of``) is ``num_sequences`` sequences over the same prompt. The first is
scheduled; the others wait as its ``unforked`` sequences and fork from it once the prompt is computed, sharing
its blocks. A seeded request gives sample ``i`` its own seed (``SamplingParams.sample_seed``), so each sample's
tokens are what that sample alone would give. A grammar's matcher is built once and deep-copied for the other
samples. ``best_of`` ranks samples by cumulative logprob, so each sample's token logprobs are computed (handed
out only where asked for, by the output processor).

A sample stops at EOS (unless ``ignore_eos``; the sampler masks EOS until ``min_tokens``), at one of its stop
tokens, or at its length limit (``max_tokens`` output tokens, or ``max_model_len`` in all). Stop strings are the
output processor's: it sees text.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from engine.sequence import Sequence, SequenceGroup, SequenceStatus
from engine.sample.token_logprobs import TokenLogprobs
from engine.output.beam_search import BeamGroup
from engine.output.outputs import SampleDelta
from engine.sampling_params import SamplingParams


@dataclass(slots=True, eq=False)
class Sample:
    """One sample of a request and how many of its output tokens were sent."""

    seq: Sequence
    num_sent: int = 0
    error: str | None = None

    def take_delta(self, logprobs: list[TokenLogprobs] | None = None) -> SampleDelta:
        """The sample's output tokens known and not sent yet (now counted as sent), and how it ended if it has:
        its next delta (``logprobs``: the new tokens', where asked for)."""
        # (per row per step: plain attributes, no properties; a running sequence's status is not hashed)
        seq, first_output = self.seq, self.seq.num_prompt_tokens
        known = len(seq.token_ids) - seq.num_pending_tokens
        new_ids = seq.token_ids[first_output + self.num_sent : known]
        self.num_sent = known - first_output
        first_scheduled, status = seq.first_scheduled_time, seq.status
        queued = None if first_scheduled is None else first_scheduled - seq.arrival_time
        return SampleDelta(
            seq.request_id,
            seq.index,
            new_ids,
            logprobs,
            None if status is SequenceStatus.RUNNING else status.finish_reason,
            seq.stop_reason if isinstance(seq.stop_reason, int) else None,
            max(seq.num_cached_tokens, 0),
            queued,
            None,
            self.error,
        )


@dataclass(slots=True, eq=False)
class Request:
    group: SequenceGroup
    samples: list[Sample]
    num_open: int  # samples not finished yet
    beam: BeamGroup | None = None


def new_sequences(
    seq_ids: itertools.count,
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
    grammar: Any | None,
    cache_salt: str | None,
    tenant: str,
    priority: int,
) -> list[Sequence]:
    """The request's sequences, one per sample (or beam); the first computes the prompt, the others fork from
    it (a beam search's hold their places until the prompt's step)."""
    # (beam search takes no best_of, logprobs or grammar, SamplingParams checks; its beams share its params)
    seq_params = (
        params
        if params.best_of is None or params.logprobs is not None
        else dataclasses.replace(params, logprobs=0)
    )
    seqs = []
    for index in range(params.num_sequences):
        own = (
            seq_params
            if index == 0 or params.seed is None or params.use_beam_search
            else dataclasses.replace(seq_params, seed=params.sample_seed(index))
        )
        seq = Sequence(
            seq_id=next(seq_ids),
            request_id=request_id,
            token_ids=list(prompt),
            params=own,
            cache_salt=cache_salt,
            tenant=tenant,
            priority=priority,
            index=index,
        )
        if grammar is not None:
            seq.grammar = grammar if index == 0 else grammar.deep_copy()
        seqs.append(seq)
    seqs[0].unforked = seqs[1:]  # computed once, then forked (sharing the prompt's blocks)
    return seqs


def reaches_length_limit(seq: Sequence, num_tokens: int, max_model_len: int) -> bool:
    """``num_tokens`` tokens in all reach ``seq``'s length limit."""
    num_output = num_tokens - seq.num_prompt_tokens
    max_tokens = seq.params.max_tokens
    return (max_tokens is not None and num_output >= max_tokens) or num_tokens >= max_model_len


def stop_status(
    seq: Sequence, token_id: int, eos_token_ids: Collection[int], max_model_len: int
) -> SequenceStatus | None:
    """How ``seq`` stops now that it has ``token_id`` (None: it goes on): EOS, a stop token, or its length."""
    params = seq.params
    if token_id in eos_token_ids and not params.ignore_eos:
        return SequenceStatus.FINISHED_STOPPED
    if token_id in params.stop_token_ids:
        seq.stop_reason = token_id
        return SequenceStatus.FINISHED_STOPPED
    if reaches_length_limit(seq, seq.num_known_tokens, max_model_len):
        return SequenceStatus.FINISHED_LENGTH
    return None


def hold_places(seqs: list[Sequence], max_model_len: int) -> list[int]:
    """Each sequence sampled by a launched step holds its pending token's place: its index, or -1 for a beam
    (whose next token comes from its request's beam step, not from its own sampled row)."""
    indices = []
    for seq in seqs:
        if seq.params.use_beam_search:
            seq.awaiting_beam_step = True
            indices.append(-1)
        else:
            indices.append(seq.append_pending())
            seq.awaiting_last_token = reaches_length_limit(seq, seq.num_tokens, max_model_len)
    return indices
