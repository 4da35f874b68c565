"""CoreInfo: what the front needs to know of a started engine core (resolved at model load), and the request
checks both sides run with it: the front refuses a bad request at submission (a 400 before any IPC), the core
again at admission (its own guard)."""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from typing import Any

import msgspec

from engine.config import EngineConfig
from engine.sampling_params import MAX_PRIORITY, SamplingParams


class CoreInfo(msgspec.Struct, frozen=True):
    model_id: str
    # the HF directory the tokenizer comes from (None: dummy weights of a named architecture)
    model_path: str | None
    vocab_size: int
    max_model_len: int  # after capping to the KV pool
    max_num_seqs: int
    eos_token_ids: tuple[int, ...]
    block_size: int
    num_blocks: int
    # the block hash chain's algorithm, root and seed: the front hashes final outputs' blocks
    prefix_hash: str
    prefix_cache_seed: str
    device: str  # cpu | cuda
    # the speculative decoding that runs (EngineConfig.speculative; None: off, or not for this model)
    speculative: str | None = None

    @classmethod
    def of(
        cls, config: EngineConfig, vocab_size: int, num_blocks: int, speculating: bool = False
    ) -> CoreInfo:
        return cls(
            config.model_id,
            config.model_path,
            vocab_size,
            config.max_model_len,
            config.max_num_seqs,
            tuple(config.eos_token_ids),
            config.block_size,
            num_blocks,
            config.prefix_hash,
            config.prefix_cache_seed,
            config.torch_device.type,
            config.speculative if speculating else None,
        )

    def apply_to(self, config: EngineConfig) -> None:
        """Fill a front-side config's derived fields with the core's resolved values."""
        config.model_id, config.model_path = self.model_id, self.model_path
        config.max_model_len, config.eos_token_ids = self.max_model_len, self.eos_token_ids


def check_request(
    info: CoreInfo, prompt_token_ids: SequenceOf[int], params: SamplingParams, grammars: Any | None
) -> None:
    """ValueError naming the field when the request can never run. ``grammars``: a GrammarCompiler that checks
    a structured-output spec (None: not checked here)."""
    if not isinstance(params, SamplingParams):
        raise ValueError("sampling_params: must be a SamplingParams")
    if not prompt_token_ids:
        raise ValueError("prompt: must contain at least one token")
    vocab = info.vocab_size
    # (the types once each, then the bounds: C loops, not a Python test per token of a long prompt)
    if (
        not all(issubclass(kind, int) for kind in set(map(type, prompt_token_ids)))
        or min(prompt_token_ids) < 0
        or max(prompt_token_ids) >= vocab
    ):
        raise ValueError(f"prompt: token ids must be integers in [0, {vocab})")
    if len(prompt_token_ids) >= info.max_model_len:
        raise ValueError(
            f"prompt: {len(prompt_token_ids)} tokens leave no room to generate within "
            f"max_model_len={info.max_model_len}"
        )
    if params.speculative_context and max(params.speculative_context) >= vocab:
        raise ValueError(f"speculative_context: token ids must be in [0, {vocab})")
    if params.top_k > vocab:
        raise ValueError(f"top_k: must be at most the vocabulary size ({vocab}), or -1 / 0 for off")
    if params.logit_bias and max(params.logit_bias) >= vocab:
        raise ValueError(f"logit_bias: token ids must be in [0, {vocab})")
    if params.structured_output is not None and grammars is not None:
        grammars.validate(params.structured_output)
    if params.num_sequences > info.max_num_seqs:
        field_name = (
            "beam_width" if params.use_beam_search else "best_of" if params.best_of else "n"
        )
        raise ValueError(
            f"{field_name}: {params.num_sequences} sequences exceed max_num_seqs={info.max_num_seqs}"
        )


def check_priority(priority: int) -> None:
    if (
        not isinstance(priority, int)
        or isinstance(priority, bool)
        or not -MAX_PRIORITY <= priority <= MAX_PRIORITY
    ):
        raise ValueError(
            f"priority: must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}] (lower runs first)"
        )
