"""Swap preemption: under a pool too small for the load, sequences swapped to the host pool and back give the
same greedy tokens as recompute and as a roomy pool; device and host blocks are accounted for at every step."""
from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLM, LLMEngine
from engine.sampling_params import SamplingParams
from engine.sequence import SequenceStatus
from tests.block_invariants import check_pool
from tests.conftest import SMALL_KV_GIB

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colours of the rainbow:"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
TIGHT = dict(num_kv_blocks=5, max_model_len=64)  # each request ends with 2-3 blocks: not all three fit


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def expected(prompt_ids) -> list[list[int]]:
    roomy = LLM(kv_cache_memory_gib=SMALL_KV_GIB)
    return [o.token_ids for o in roomy.generate(prompt_ids, GREEDY)]


def check_host_pool(engine: LLMEngine) -> None:
    manager, scheduler = engine.block_manager, engine.scheduler
    held = [b for seq in scheduler.swapped for b in seq.host_blocks]
    assert len(set(held)) == len(held), "a host block held twice"
    assert not set(held) & set(manager.host.free), "a host block both free and held"
    assert len(held) + manager.host.num_free + len(manager.host.freed_this_step) == manager.host.num_blocks
    assert all(seq.status is SequenceStatus.SWAPPED and not seq.block_table for seq in scheduler.swapped)


def run_checked(engine: LLMEngine, prompt_ids: list[list[int]], params: SamplingParams) -> list[list[int]]:
    for i, ids in enumerate(prompt_ids):
        engine.add_request(f"r{i}", ids, params)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.token_ids
        scheduler = engine.scheduler
        check_pool(engine.block_manager, list(scheduler.running) + list(scheduler.waiting) + list(scheduler.swapped))
        check_host_pool(engine)
    return [finals[f"r{i}"] for i in range(len(prompt_ids))]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_swap_and_recompute_give_the_roomy_pools_tokens(prompt_ids, expected, async_scheduling: bool):
    swapping = LLM(preemption_mode="swap", swap_space_gib=0.05, async_scheduling=async_scheduling, **TIGHT).engine
    assert run_checked(swapping, prompt_ids, GREEDY) == expected
    assert swapping.scheduler.num_swap_outs > 0, "the pool was meant to force swapping"
    recomputing = LLM(preemption_mode="recompute", async_scheduling=async_scheduling, **TIGHT).engine
    assert run_checked(recomputing, prompt_ids, GREEDY) == expected
    assert recomputing.scheduler.num_preemptions > 0 and recomputing.scheduler.num_swap_outs == 0
    for engine in (swapping, recomputing):
        assert engine.stats().num_free_blocks == engine.stats().num_blocks
    assert swapping.block_manager.host.num_free + len(swapping.block_manager.host.freed_this_step) == \
        swapping.block_manager.host.num_blocks


def test_a_host_pool_too_small_falls_back_to_recompute(prompt_ids, expected):
    tiny = LLM(preemption_mode="swap", swap_space_gib=1e-5, **TIGHT).engine  # fewer host blocks than a sequence
    assert run_checked(tiny, prompt_ids, GREEDY) == expected
    assert tiny.scheduler.num_preemptions > 0 and tiny.scheduler.num_swap_outs == 0


def test_aborting_a_swapped_sequence_frees_its_host_blocks(prompt_ids):
    engine = LLM(preemption_mode="swap", swap_space_gib=0.05, **TIGHT).engine
    for i, ids in enumerate(prompt_ids):
        engine.add_request(f"r{i}", ids, GREEDY)
    while not engine.scheduler.swapped:
        engine.step()
    victim = engine.scheduler.swapped[0]
    (final,) = engine.abort_request(victim.request_id)
    assert final.finish_reason == "abort" and not victim.host_blocks
    check_host_pool(engine)
    while engine.has_unfinished_requests():
        engine.step()
    check_pool(engine.block_manager, [])
    assert engine.block_manager.host.num_free + len(engine.block_manager.host.freed_this_step) == \
        engine.block_manager.host.num_blocks


def test_auto_swaps_the_samples_of_a_parallel_request(prompt_ids):
    params = SamplingParams(n=3, temperature=0, max_tokens=24, ignore_eos=True)
    roomy = LLM(kv_cache_memory_gib=SMALL_KV_GIB)
    expected = [o.token_ids for o in roomy.generate(prompt_ids[2], params)]
    engine = LLM(preemption_mode="auto", swap_space_gib=0.05, **TIGHT).engine
    engine.add_request("n3", prompt_ids[2], params)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((o.index, o.token_ids) for o in engine.step() if o.finished)
    assert [finals[i] for i in range(3)] == expected
    assert engine.scheduler.num_swap_outs > 0


def test_bad_preemption_settings_name_the_field():
    with pytest.raises(ValueError, match="preemption_mode"):
        EngineConfig(preemption_mode="drop")
    with pytest.raises(ValueError, match="swap_space_gib"):
        EngineConfig(swap_space_gib=-1)
