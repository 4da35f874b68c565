"""Sequence (one stream of tokens with its KV blocks) and SequenceGroup (one request's sequences)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any


from engine.sampling_params import SamplingParams

# Stands in ``token_ids`` for a token sampled by the step still running on the device (the engine reads
# sampled ids one step late, see llm_engine.py); replaced by the real id when that step's output is read.
PENDING_TOKEN = -1


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_FAILED = enum.auto()  # this request's own fault (its sampling, grammar, detokenizing)
    SWAPPED = enum.auto()  # preempted with its KV blocks copied to the host pool

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_FAILED: "error",
}


@dataclass(slots=True, eq=False)
class Sequence:
    """Token ids (prompt + output) and where their KV lives.

    ``num_computed_tokens`` tokens have KV in ``block_table``; token i sits in block
    ``block_table[i // block_size]`` at offset ``i % block_size``.
    """

    seq_id: int
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    # who sent it (the front's word: an API key's hash, a client address): steps are shared fairly
    tenant: str = ""
    priority: int = 0  # among its tenant's requests: lower runs first (vLLM's priority)
    # a session's turn: its blocks outrank one-off ones when evicting and go down to the lower KV tiers when it ends
    retain: bool = False
    last_step: int = -1  # the scheduler's step that last computed it (a tenant's rows take turns)
    arrival_time: float = field(default_factory=time.monotonic)
    # when first admitted to the running batch (queue time ends)
    first_scheduled_time: float | None = None
    num_prompt_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission; -1 until admitted
    block_table: list[int] = field(default_factory=list)
    # chained hashes of its full token blocks
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0  # head blocks already entered in the prefix-cache hash map
    stop_reason: int | str | None = None  # the stop token id or stop string that finished it
    num_preemptions: int = 0
    num_pending_tokens: int = 0  # trailing PENDING_TOKEN entries of token_ids
    # its pending token is its last (length limit): nothing more to compute
    awaiting_last_token: bool = False
    # a beam whose next-token logits wait for its request's other beams
    awaiting_beam_step: bool = False
    grammar: Any | None = None  # structured output: the llguidance matcher its tokens must satisfy
    index: int = 0  # its choice among the request's samples (OpenAI ``choices[i].index``)
    # parallel sampling: the request's other samples, waiting for this one's prompt; forked from it (sharing
    # every block) in the step that computes the prompt's last token, and sampled from the same logits
    unforked: list[Sequence] = field(default_factory=list)
    # while SWAPPED: its blocks in the host pool, in order
    host_blocks: list[int] = field(default_factory=list)
    # its blocks of the sliding-window layers' own pool (engine/core/window_blocks.py), positional as block_table;
    # released blocks are 0; the first window_registered entries were entered in that pool's hash map
    window_table: list[int] = field(default_factory=list)
    window_registered: int = 0
    # speculative decoding: its n-gram index and acceptance (engine/speculative/draft_length.py), made on its
    # first decode where it may speculate; its drafts, during a step, are the last tokens of token_ids
    speculation: Any | None = None
    # sampling is a plain argmax once token_ids holds this many tokens (its min_tokens reached): a greedy request
    # without penalties, logprobs or logit bias; -1: never. Set from params, which no one changes once a
    # sequence exists (the sampler's per-row check in every step, engine/sample/sampler.py)
    plain_greedy_from: int = field(init=False, default=-1)

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)
        params = self.params
        if (
            params.greedy
            and not params.uses_penalties
            and params.logprobs is None
            and not params.logit_bias
        ):
            self.plain_greedy_from = self.num_prompt_tokens + params.min_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    # per token per step: identity tests (an enum hash is a Python call);
    def is_finished(self) -> bool:
        # WAITING, RUNNING and SWAPPED are the only unfinished states
        status = self.status
        return (
            status is not SequenceStatus.RUNNING
            and status is not SequenceStatus.WAITING
            and status is not SequenceStatus.SWAPPED
        )

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids are known on the host (pending ones excluded)."""
        return len(self.token_ids) - self.num_pending_tokens

    @property
    def known_output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens : self.num_known_tokens]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def append_pending(self) -> int:
        """A token was sampled on the device: hold its place; returns its index for ``resolve``."""
        self.token_ids.append(PENDING_TOKEN)
        self.num_pending_tokens += 1
        return len(self.token_ids) - 1

    def resolve(self, index: int, token_id: int) -> None:
        self.token_ids[index] = token_id
        self.num_pending_tokens -= 1

    def drop_pending(self) -> None:
        """Finished while tokens were still in flight: they are not part of its output."""
        if self.num_pending_tokens:
            del self.token_ids[-self.num_pending_tokens :]
            self.num_pending_tokens = 0


@dataclass(slots=True, eq=False)
class SequenceGroup:
    """The sequences of one request: ``n`` (or ``best_of``) samples share the prompt's blocks by fork."""

    request_id: str
    seqs: list[Sequence]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)
