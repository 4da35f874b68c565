"""Parallel sampling (n > 1, best_of): the prompt is computed once and its blocks shared by fork; each sample
copies only the partly filled last block on its first write; seeded samples are reproducible one by one."""

from __future__ import annotations

import pytest

from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.block_invariants import check_pool
from tests.conftest import SMALL_KV_GIB

PROMPT = "Three facts about octopuses, in one short sentence each:"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_memory_gib=SMALL_KV_GIB)


def live_seqs(engine: LLMEngine) -> list:
    return list(engine.core.scheduler.running) + list(engine.core.scheduler.waiting)


def drive(engine: LLMEngine) -> tuple[list, int, int]:
    """Step to the end, checking the block pool after every step; (outputs, prompt tokens computed, peak
    blocks in use)."""
    outputs, computed, peak = [], 0, 0
    while engine.has_unfinished_requests():
        outputs += engine.step()
        batch = engine.last_batch
        computed += sum(n for n in batch.num_new_tokens if n > 1)
        check_pool(engine.core.block_manager, live_seqs(engine))
        stats = engine.stats()
        # blocks some sequence references
        peak = max(peak, stats.num_blocks - stats.num_free_blocks)
    return outputs, computed, peak


def finals(outputs: list) -> dict[int, list[int]]:
    return {o.index: o.token_ids for o in outputs if o.finished}


def test_greedy_samples_equal_the_single_answer_and_share_the_prompt(llm: LLM):
    prompt = llm.tokenizer.encode(PROMPT * 6)  # several full blocks to share
    (single,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    engine = llm.engine
    engine.add_request(
        "greedy-n4",
        prompt,
        SamplingParams(n=4, temperature=0, max_tokens=24, ignore_eos=True),
        cache_salt="parallel-greedy",
    )  # (no hit on the single request's blocks)
    outputs, computed, peak = drive(engine)
    assert finals(outputs) == {i: single.token_ids for i in range(4)}
    assert computed <= len(prompt), "the prompt is computed once, not per sample"
    block = engine.config.block_size
    prompt_blocks, output_blocks = -(-len(prompt) // block), -(-24 // block)
    assert peak <= prompt_blocks + 4 * (output_blocks + 1)
    assert peak < 4 * (prompt_blocks + output_blocks), "less than four independent requests"
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks and engine.core.num_open_samples == 0


def test_streamed_samples_carry_their_index_and_each_ends_once(llm: LLM):
    engine = llm.engine
    engine.add_request(
        "stream-n3",
        llm.tokenizer.encode(PROMPT),
        SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True),
    )
    outputs, _, _ = drive(engine)
    assert sorted({o.index for o in outputs}) == [0, 1, 2]
    for index in range(3):
        mine = [o for o in outputs if o.index == index]
        assert [o.finished for o in mine] == [False] * (len(mine) - 1) + [True]
        assert sum(len(o.token_ids_delta) for o in mine) == len(mine[-1].token_ids) == 10


def test_seeded_sample_i_is_reproducible_and_equals_a_single_request_with_its_seed(llm: LLM):
    params = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    first = llm.generate(PROMPT, params)
    again = llm.generate(PROMPT, params)
    assert [o.index for o in first] == [0, 1, 2]
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert len({tuple(o.token_ids) for o in first}) == 3, "the samples differ from each other"
    for i, out in enumerate(first):
        (alone,) = llm.generate(
            PROMPT,
            SamplingParams(
                temperature=1.0,
                seed=SamplingParams(seed=1234).sample_seed(i),
                max_tokens=16,
                ignore_eos=True,
            ),
        )
        assert alone.token_ids == out.token_ids


def test_best_of_keeps_the_samples_of_highest_cumulative_logprob(llm: LLM):
    seed = 99
    every = llm.generate(
        PROMPT,
        SamplingParams(n=4, temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True, logprobs=0),
    )
    ranked = sorted(every, key=lambda o: -o.cumulative_logprob)
    best = llm.generate(
        PROMPT,
        SamplingParams(n=2, best_of=4, temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True),
    )
    assert [o.index for o in best] == [0, 1]
    assert [o.token_ids for o in best] == [o.token_ids for o in ranked[:2]]
    assert best[0].logprobs is None, "logprobs computed for ranking are not handed out unless asked"


def test_abort_before_the_fork_ends_every_sample_and_frees_everything(llm: LLM):
    engine = llm.engine
    engine.add_request(
        "abort-n3",
        llm.tokenizer.encode(PROMPT * 4),
        SamplingParams(n=3, temperature=0, max_tokens=8),
    )
    finals_ = engine.abort_request("abort-n3")
    assert sorted(o.index for o in finals_) == [0, 1, 2]
    assert all(o.finished and o.finish_reason == "abort" for o in finals_)
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks and engine.core.scheduler.num_unforked == 0


def test_abort_after_the_fork_frees_the_shared_blocks(llm: LLM):
    engine = llm.engine
    engine.add_request(
        "abort-late",
        llm.tokenizer.encode(PROMPT),
        SamplingParams(n=3, temperature=0, max_tokens=50, ignore_eos=True),
    )
    for _ in range(4):
        engine.step()
    assert len(engine.core.scheduler.running) == 3
    assert len(engine.abort_request("abort-late")) == 3
    while engine.has_unfinished_requests():
        engine.step()
    check_pool(engine.core.block_manager, [])
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


def test_too_many_samples_for_the_batch_is_a_clear_error(llm: LLM):
    with pytest.raises(ValueError, match="n:"):
        llm.engine.add_request(
            "huge-n", [1, 2, 3], SamplingParams(n=llm.engine.config.max_num_seqs + 1)
        )


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_samples_survive_preemption_with_the_same_tokens(async_scheduling: bool):
    """A pool too small for the samples forces recompute preemption; greedy tokens must not change."""
    params = SamplingParams(n=3, temperature=0, max_tokens=40, ignore_eos=True)
    roomy = LLM(kv_cache_memory_gib=SMALL_KV_GIB, async_scheduling=async_scheduling)
    prompt = roomy.tokenizer.encode(PROMPT)
    expected = [o.token_ids for o in roomy.generate(prompt, params)]
    tight = LLM(num_kv_blocks=9, async_scheduling=async_scheduling, max_model_len=128)
    got = tight.generate(prompt, params)
    assert tight.engine.scheduler.num_preemptions > 0, "the pool was meant to be too small"
    assert [o.token_ids for o in got] == expected
    check_pool(tight.engine.block_manager, [])
