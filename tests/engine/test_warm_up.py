"""The start-up warm-up's plan (engine/worker/warm_up.py): the token and row counts it walks put a count in every
class Triton specializes an integer on (1, a multiple of 16, other) and on both sides of every power of two up to
the limit; every step stays inside the step's limits (tokens, sequences, blocks) and releases its input rows; on
the CPU (nothing compiles there) and when switched off it does not run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.config import EngineConfig
from engine.worker.warm_up import (
    SAMPLING_VARIANTS,
    ScratchSequences,
    count_ladder,
    warm_up,
    warm_up_steps,
)


def test_count_ladder_covers_each_class_and_both_sides_of_each_power_of_two():
    limit = 8192
    counts = count_ladder(limit)
    assert counts == sorted(set(counts)) and counts[0] == 1 and counts[-1] == limit
    for exponent in range(1, 14):
        assert {2**exponent, 2**exponent + 1} <= set(counts) | {limit + 1}
    assert any(n % 16 == 0 for n in counts) and any(n > 16 and n % 16 for n in counts)
    # the skinny matmul's row buckets (1, 2, 4, 8, 16, 32) each get a count that rounds up to them
    assert {1 << (n - 1).bit_length() for n in counts if n <= 32} == {1, 2, 4, 8, 16, 32}
    assert count_ladder(1) == [1]
    assert count_ladder(5) == [1, 2, 3, 4, 5]
    assert count_ladder(100)[-1] == 100 and 101 not in count_ladder(100)


def test_warm_up_runs_only_on_cuda_and_when_on():
    for options in ({"device": "cpu"}, {"device": "cpu", "warm_up": False}):
        # (nothing of it may be touched)
        runner = SimpleNamespace(config=EngineConfig(**options).resolve())
        assert warm_up(runner, 16) == 0.0


class RecordingRunner:
    """Stands in for the model runner: records each warm-up step and the input rows held (none may leak)."""

    def __init__(self, config: EngineConfig, window: int = 0) -> None:
        self.config, self.block_size = config, config.block_size
        self.kv = SimpleNamespace(contiguous=False, window=window)
        self.model = SimpleNamespace(args=SimpleNamespace(vocab_size=1000))
        self.batches: list = []
        self.live: set[int] = set()
        self.draft = None  # (a draft model: RecordingDraft)

    def execute(self, batch, in_flight):
        ids = {seq.seq_id for seq in batch.seqs}
        assert in_flight is None and len(ids) == len(batch.seqs) and not ids & self.live
        self.live |= ids
        self.batches.append(batch)
        return SimpleNamespace(wait=lambda: ([], []))

    def forget(self, seq) -> None:
        self.live.discard(seq.seq_id)


class RecordingDraft:
    """Stands in for a draft model: records each warm-up proposal's (sequences, their known positions)."""

    def __init__(self) -> None:
        self.proposals: list = []

    def propose(self, seqs, lengths, known) -> list[list[int]]:
        self.proposals.append((seqs, known))
        return [[0] * n for n in lengths]


def test_a_draft_models_catch_ups_walk_the_count_ladder_within_the_limits():
    """Speculative decoding's draft model warms its catch-up prefills: every count of the ladder up to the step
    budget is caught up (from the start and after a prefix), within the context and the block tables."""
    budget = 64
    config = EngineConfig(device="cpu", max_num_batched_tokens=budget, max_model_len=1024).resolve()
    runner = RecordingRunner(config)
    runner.draft = draft = RecordingDraft()
    scratch = ScratchSequences(runner, 70, 0)
    for _ in warm_up_steps(runner, scratch):
        pass
    counts = set()
    for seqs, known in draft.proposals:
        for seq, start in zip(seqs, known):
            last = seq.num_computed_tokens  # (the proposal's first pass is at its last two tokens)
            assert 0 <= start < last - 1 and last + 1 < seq.num_tokens <= config.max_model_len
            assert len(seq.block_table) * config.block_size >= seq.num_tokens
            counts.add(last - 1 - start)
    assert counts >= {1, 2, 3, 16, 17, 32, 33, budget}
    assert any(start > 0 for _, known in draft.proposals for start in known), "after a prefix"
    assert any(len(seqs) == 2 for seqs, _ in draft.proposals)


@pytest.mark.parametrize("seqs,budget,window", [(4, 64, 32), (64, 512, 0)])
def test_every_step_fits_the_step_limits_and_releases_its_rows(seqs, budget, window):
    config = EngineConfig(
        device="cpu", max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=1024
    )
    num_blocks, window_blocks = 70, 8 if window else 0
    runner = RecordingRunner(config, window)
    scratch = ScratchSequences(runner, num_blocks, window_blocks)
    for _ in warm_up_steps(runner, scratch):
        pass
    assert not runner.live and scratch.steps == len(runner.batches) > 40
    for batch in runner.batches:
        assert sum(batch.num_new_tokens) <= budget and len(batch.seqs) <= seqs
        decodes = batch.num_decodes
        assert all(n > 1 for n in batch.num_new_tokens[decodes:])  # decode rows first
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            assert seq.num_computed_tokens + n <= seq.num_tokens <= config.max_model_len
            assert len(seq.block_table) * config.block_size >= seq.num_tokens
            assert len(seq.block_table) <= config.max_blocks_per_seq
            assert max(seq.block_table) < num_blocks
            assert max(seq.window_table, default=0) < max(window_blocks, 1)
    totals = {sum(b.num_new_tokens) for b in runner.batches}
    assert {1, 2, 3, 16, 17, budget} <= totals
    assert any(
        0 < b.num_decodes < len(b.seqs) for b in runner.batches
    )  # decode rows beside a chunk
    assert any(b.block_copies == [(0, 1)] for b in runner.batches)
    sampled = [seq.params for b in runner.batches for seq in b.seqs]
    assert all(variant in sampled for variant in SAMPLING_VARIANTS)
