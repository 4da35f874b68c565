"""Kernel warm-up at start-up (CUDA): one step of each shape class the scheduler can produce, run on scratch
sequences before the engine takes requests, so that Triton compiles every kernel variant then (or loads it from
its on-disk cache, ``TRITON_CACHE_DIR``), not inside the first requests' steps: a compile is ~0.5-1 s of a step.

Triton compiles one variant per constexpr value and per class of each integer argument (1, a multiple of 16,
other) that kernels/specialization.py does not mark as per-step. What picks them in a step: its token count (the
skinny matmul's row buckets up to 32 rows, the prefill kernel's TMA path for long chunks), its decode rows (split-K
while rows x KV heads leave SMs idle, the persistent kernel up to 16 rows, CUDA graphs up to
``max_graph_batch_size``, eager beyond), decode rows beside a prefill chunk (a mixed step runs eagerly), a context
short or long (split-K needs a context of several partitions), and the sampling path (the greedy argmax kernel;
temperature, top-k/p, min-p, penalties, logprobs, seeds and beams through torch, whose kernels load on first use),
and the copy-on-write kernel (a sample forked inside a block, beams).
The counts walk every power of two and the count one past it up to each limit (``count_ladder``), which puts a
count in every class and on both sides of every threshold that is a power of two. The KV cache has the configured
dtype, so an FP8 cache warms its own variants.

No side effect on the KV accounting: this runs before the block manager exists, when every block is free and
unhashed. The scratch sequences write K/V into blocks that a sequence only reads at positions it computed itself
(so a real request overwrites them first), and release their input rows after each step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from tqdm.auto import tqdm

from engine.core.scheduled_batch import ScheduledBatch
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

GREEDY = SamplingParams(temperature=0.0)
# one row of each sampling path (engine/sample/sampler.py), sampled together and then each alone
SAMPLING_VARIANTS = (
    GREEDY,
    SamplingParams(temperature=0.0, logprobs=5),
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=0.7, top_k=40, top_p=0.9),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=0.9, presence_penalty=0.5, frequency_penalty=0.3),
    SamplingParams(temperature=1.0, repetition_penalty=1.2, min_tokens=4),
    SamplingParams(temperature=1.0, seed=7, logit_bias={1: 5.0}),
    SamplingParams(temperature=0.6, top_p=0.95, logprobs=2, seed=11),
    SamplingParams(use_beam_search=True, beam_width=2, temperature=0.0),
)


def count_ladder(limit: int) -> list[int]:
    """1, each power of two and the count one past it, and ``limit`` itself, all <= ``limit``."""
    counts, power = {1, limit}, 2
    while power <= limit:
        counts |= {power, power + 1}
        power *= 2
    return sorted(n for n in counts if 1 <= n <= limit)


class ScratchSequences:
    """Sequences that exist for one warm-up step: ids in the vocabulary, a block table over the first blocks of
    the pool (shared by every scratch sequence), released from the step inputs after the step."""

    def __init__(self, runner: ModelRunner, num_blocks: int, window_blocks: int) -> None:
        self.runner, self.num_blocks, self.window_blocks = runner, num_blocks, window_blocks
        self.vocab = runner.model.args.vocab_size
        self.block_size = runner.block_size
        self.steps = 0
        self._ids: dict[
            int, list[int]
        ] = {}  # token ids by length, shared: nothing appends to them here

    def new(
        self, length: int, computed: int, params: SamplingParams = GREEDY, outputs: int = 0
    ) -> Sequence:
        """A sequence of ``length`` tokens (the last ``outputs`` of them generated) whose first ``computed``
        have KV."""
        seq = Sequence(
            seq_id=-2,
            request_id="warm-up",
            token_ids=self._ids.setdefault(
                length, [(7 * i + 3) % self.vocab for i in range(length)]
            ),
            params=params,
            num_prompt_tokens=length - outputs,
        )
        seq.num_computed_tokens = computed
        blocks = -(-length // self.block_size)
        seq.block_table = [i % self.num_blocks for i in range(blocks)]
        if self.window_blocks:
            seq.window_table = [i % self.window_blocks for i in range(blocks)]
        return seq

    def run(self, seqs: list[Sequence], counts: list[int], copy: bool = False) -> None:
        """One step over ``seqs`` (``counts`` tokens each, decode rows first), waited for; rows released.
        ``copy``: with a copy-on-write of block 0 into block 1 (and in the window group's pool) first."""
        for i, seq in enumerate(seqs):
            seq.seq_id = -2 - i  # (unique within the step: rows are keyed by it)
        batch = ScheduledBatch(seqs=seqs, num_new_tokens=counts)
        if copy:
            batch.block_copies = [(0, 1)]
            batch.window_copies = [(0, 1)] if self.window_blocks >= 2 else []
        logger.debug(
            "warm-up step: %d sequences, tokens %s, contexts %s",
            len(seqs),
            counts,
            [seq.num_computed_tokens for seq in seqs[:4]],
        )
        self.runner.execute(batch, None).wait()
        for seq in seqs:
            self.runner.forget(seq)
        self.steps += 1


def warm_up_steps(runner: ModelRunner, scratch: ScratchSequences) -> Iterator[None]:
    """Run the warm-up's steps, yielding after each group of them (a progress bar's tick)."""
    config = runner.config
    budget = min(config.max_num_batched_tokens, config.max_model_len - 1)
    long_context = min(config.max_model_len - 1, 2048)
    short_context = min(config.max_model_len - 1, 2 * runner.block_size + 1)
    for n in count_ladder(
        budget
    ):  # prefill chunks alone: from a fresh start, and after a cached prefix
        scratch.run([scratch.new(n, 0)], [n])
        yield
        if n > 1 and n + short_context <= config.max_model_len:
            scratch.run([scratch.new(short_context + n, short_context)], [n])
            yield
    max_rows = min(config.max_num_seqs, budget)
    if (
        runner.kv.contiguous
    ):  # (each sequence maps pages of its own, and a released one keeps them a while)
        max_rows = min(max_rows, scratch.num_blocks // (2 * -(-long_context // runner.block_size)))
    for rows in count_ladder(max(1, max_rows)):  # decode rows, alone and beside a prefill chunk
        for context in (short_context, long_context):
            scratch.run([scratch.new(context + 1, context) for _ in range(rows)], [1] * rows)
            chunk = min(budget - rows, context)
            if rows < config.max_num_seqs and chunk >= 2:
                decodes = [scratch.new(context + 1, context) for _ in range(rows)]
                scratch.run([*decodes, scratch.new(chunk, 0)], [1] * rows + [chunk])
            yield
    if not runner.kv.contiguous:  # copy-on-write (a sample forked inside a block; beams)
        scratch.run([scratch.new(min(2, budget), 0)], [min(2, budget)], copy=True)
        yield
    yield from warm_up_sampling(scratch, budget, config.max_num_seqs)
    if runner.draft is not None:
        yield from warm_up_draft(runner, scratch, budget, short_context)


def warm_up_sampling(scratch: ScratchSequences, budget: int, max_seqs: int) -> Iterator[None]:
    """Every sampling path: each variant alone (the sampler picks its path per step), and all in one step where
    the step's limits allow."""
    variants = SAMPLING_VARIANTS
    length = max(1, min(13, budget // len(variants)))
    groups = [(v,) for v in variants]
    if len(variants) <= max_seqs and length * len(variants) <= budget:
        groups.insert(0, variants)
    for group in groups:
        seqs = [scratch.new(length, 0, params, length // 3) for params in group]
        scratch.run(seqs, [length] * len(seqs))
        yield


def warm_up_draft(
    runner: ModelRunner, scratch: ScratchSequences, budget: int, prefix: int
) -> Iterator[None]:
    """A draft model's (speculative decoding) own kernels: its catch-up prefills over the count ladder, from a
    fresh start and after a prefix, one sequence and two (its propose passes were compiled at their graphs'
    capture)."""
    draft, limit = runner.draft, runner.config.max_model_len
    for n in count_ladder(budget):
        for start in (0, prefix) if n > 1 else (0,):
            if start + n + 3 > limit:
                continue
            # (the catch-up covers positions start .. start + n - 1: the last token at start + n + 1)
            seqs = [scratch.new(start + n + 3, start + n + 1) for _ in range(1 if n < 2 else 2)]
            draft.propose(seqs, [1] * len(seqs), [start] * len(seqs))
            scratch.steps += 1
            yield


def warm_up(runner: ModelRunner, num_blocks: int, window_blocks: int = 0) -> float:
    """On CUDA with ``config.warm_up``: run the warm-up steps over the allocated KV cache (after the graphs are
    captured); the seconds it took (0.0 when it did not run)."""
    config = runner.config
    if not config.warm_up or config.torch_device.type != "cuda":
        return 0.0
    start = time.perf_counter()
    scratch = ScratchSequences(runner, num_blocks, window_blocks)
    for _ in tqdm(warm_up_steps(runner, scratch), desc="warm-up", leave=False):
        pass
    runner.settle()
    seconds = time.perf_counter() - start
    logger.info(
        "warm-up: %d steps over the kernels' shape classes in %.1f s (Triton's compiles, or its cache, now "
        "rather than in the first requests' steps; --no-warm-up skips it)",
        scratch.steps,
        seconds,
    )
    return seconds
