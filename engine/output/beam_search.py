"""Beam search for one request, one step at a time: the selection rules of transformers'
``generate(num_beams=k, do_sample=False)`` (its vectorized implementation), so that our output equals theirs
token for token.

Each step takes the log-probabilities of the next token for every live beam (``[beams, vocab]``, float32, in
beam order), adds each beam's running score, keeps the best ``max(2, 1 + #eos) * k`` continuations over all
beams, and from them

- the best ``k`` that do not end (EOS, or the length limit) become the next running beams (if fewer than
  ``k`` exist, ending ones fill up with a score pushed down by 1e9, as transformers does);
- those among the first ``k`` that end are finished hypotheses, scored ``sum logprob / length ** penalty``;
  the best ``k`` hypotheses are kept;

and the search stops when no continuation is left (every candidate ends), or when the best running beam can
no longer beat the worst of ``k`` kept hypotheses (``early_stopping``: False is transformers' default
heuristic, True stops once ``k`` hypotheses exist, "never" keeps going while a longer beam could still win).

The caller owns the beams' tokens and KV: ``step`` says which beam each new running beam continues and with
which token; the engine then forks the blocks (copy-on-write), so beams share their common history.
``BeamGroup`` is one request's side of it in the engine core: its beams, and the log-probs collected per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

_NEG = -1.0e9  # transformers' "impossible" score


@dataclass(slots=True)
class Hypothesis:
    """A finished beam: its output tokens (ending with EOS unless it hit the length limit) and scores."""

    token_ids: list[int]
    score: float  # sum of logprobs / generated length ** length_penalty
    sum_logprobs: float


@dataclass(slots=True)
class NextBeam:
    parent: int  # the running beam it continues (index into the beams of the step)
    token_id: int


@dataclass(slots=True)
class BeamSearch:
    width: int
    max_new_tokens: int  # the length limit, in generated tokens
    eos_token_ids: tuple[int, ...]
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_generated: int = 0  # tokens each running beam has generated so far
    # [live beams] float32
    running_scores: torch.Tensor = field(default_factory=lambda: torch.zeros(1))
    # [width] float32, -1e9 where empty, best first
    finished_scores: torch.Tensor = field(init=False)
    finished: list[Hypothesis | None] = field(init=False)
    improvement_possible: bool = True
    done: bool = False

    def __post_init__(self) -> None:
        if self.width < 1:
            raise ValueError("beam_width: must be >= 1")
        self.finished_scores = torch.full((self.width,), _NEG, dtype=torch.float32)
        self.finished = [None] * self.width
        # one beam (the prompt) to start from
        self.running_scores = torch.zeros(1, dtype=torch.float32)

    @property
    def num_candidates(self) -> int:
        return max(2, 1 + len(self.eos_token_ids)) * self.width

    def step(self, log_probs: torch.Tensor, outputs: list[list[int]]) -> list[NextBeam]:
        """``log_probs`` ``[live beams, vocab]`` (any device) and each live beam's output tokens so far;
        returns the next running beams, best first (empty once the search is done)."""
        beams, vocab = log_probs.shape
        assert beams == self.running_scores.numel() == len(outputs), (
            beams,
            self.running_scores,
            len(outputs),
        )
        scores = log_probs.float() + self.running_scores.to(log_probs.device)[:, None]
        top_scores, top_index = torch.topk(
            scores.reshape(-1), k=min(self.num_candidates, beams * vocab)
        )
        top_scores, top_index = top_scores.cpu(), top_index.cpu()
        parents, tokens = (top_index // vocab).tolist(), (top_index % vocab).tolist()
        length = self.num_generated + 1
        eos = set(self.eos_token_ids)
        ends = torch.tensor(
            [t in eos or length >= self.max_new_tokens for t in tokens], dtype=torch.bool
        )

        running = top_scores + ends.float() * _NEG
        keep = torch.topk(running, k=self.width).indices
        next_beams = [NextBeam(parents[i], tokens[i]) for i in keep.tolist()]
        new_running_scores = running[keep]

        self._add_finished(top_scores, ends, parents, tokens, outputs, length)
        self.num_generated = length
        self.running_scores = new_running_scores
        self._check_done(ends)
        return [] if self.done else next_beams

    def _add_finished(
        self,
        top_scores: torch.Tensor,
        ends: torch.Tensor,
        parents: list[int],
        tokens: list[int],
        outputs: list[list[int]],
        length: int,
    ) -> None:
        just_finished = ends.clone()
        just_finished[self.width :] = False  # only the first `width` candidates may finish
        candidate = top_scores / (length**self.length_penalty)
        if self.early_stopping is True and all(h is not None for h in self.finished):
            candidate = candidate + _NEG
        if not self.improvement_possible:
            candidate = candidate + _NEG
        candidate = candidate + (~just_finished).float() * _NEG
        merged = torch.cat((self.finished_scores, candidate))
        order = torch.topk(merged, k=self.width).indices.tolist()
        width, kept_scores, kept = self.width, [], []
        for i in order:
            if i < width:
                kept.append(self.finished[i])
            elif just_finished[i - width]:
                c = i - width
                kept.append(
                    Hypothesis(
                        outputs[parents[c]] + [tokens[c]], float(candidate[c]), float(top_scores[c])
                    )
                )
            else:
                kept.append(None)
            kept_scores.append(merged[i])
        self.finished_scores = torch.stack(kept_scores)
        self.finished = kept

    def _check_done(self, ends: torch.Tensor) -> None:
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_new_tokens
        else:
            best_length = self.num_generated
        best_possible = self.running_scores[:1] / (best_length**self.length_penalty)
        # transformers: a kept slot compares with the worst kept score (-1e9 while any slot is empty)
        kept = torch.tensor([h is not None for h in self.finished])
        worst = torch.where(kept, self.finished_scores.min(), torch.tensor(_NEG))
        self.improvement_possible = self.improvement_possible and bool(
            (best_possible > worst).any()
        )
        full_and_early = all(h is not None for h in self.finished) and self.early_stopping is True
        self.done = not self.improvement_possible or full_and_early or bool(ends.all())

    def best(self, n: int) -> list[Hypothesis]:
        """The ``n`` best finished hypotheses, best first."""
        return [h for h in self.finished[:n] if h is not None]


@dataclass(slots=True, eq=False)
class BeamGroup:
    """A beam-search request's beams: ``beams[:num_live]`` run, best first; the log-probs of each are collected
    until every live beam has them (a preempted beam computes its own again), then the search takes a step."""

    search: BeamSearch
    beams: list[Sequence]
    num_live: int = 1  # the prompt's sequence, until the first step
    # seq_id -> next-token log-probs
    collected: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def live(self) -> list[Sequence]:
        return self.beams[: self.num_live]

    def collect(self, seq: Sequence, log_probs: torch.Tensor) -> bool:
        """Keep one live beam's log-probs; True once every live beam has given them."""
        self.collected[seq.seq_id] = log_probs
        return len(self.collected) == self.num_live

    def advance(self) -> tuple[list[Sequence], list[list[int]]]:
        """The search's step over the collected log-probs: for each next beam, the beam it continues and its
        token ids (prompt included); empty once the search is done."""
        live = self.live
        log_probs = torch.stack([self.collected[seq.seq_id] for seq in live])
        self.collected.clear()
        next_beams = self.search.step(
            log_probs, [seq.token_ids[seq.num_prompt_tokens :] for seq in live]
        )
        sources = [live[b.parent] for b in next_beams]
        return sources, [src.token_ids + [b.token_id] for src, b in zip(sources, next_beams)]

    def results(self, n: int, aborted: bool) -> list[tuple[list[int], float | None, str]]:
        """The ``n`` best hypotheses (output ids, sum of logprobs, finish reason); for an abort the best found so
        far, else the live beams; never fewer than ``n`` (a stream waits for n final outputs)."""
        found = [(h.token_ids, h.sum_logprobs) for h in self.search.best(n)]
        found += [(seq.token_ids[seq.num_prompt_tokens :], None) for seq in self.live]
        found += [([], None)] * n
        eos = set(self.search.eos_token_ids)
        return [
            (
                list(ids),
                logprob,
                "abort" if aborted else "stop" if ids and ids[-1] in eos else "length",
            )
            for ids, logprob in found[:n]
        ]


def new_beam_group(
    beams: list[Sequence], params: SamplingParams, room: int, eos: tuple[int, ...]
) -> BeamGroup:
    """``room``: tokens left in the context after the prompt (the length limit when max_tokens is larger)."""
    max_new = room if params.max_tokens is None else min(params.max_tokens, room)
    return BeamGroup(
        BeamSearch(params.beam_width, max_new, eos, params.length_penalty, params.early_stopping),
        beams,
    )
