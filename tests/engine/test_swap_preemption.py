"""Swap preemption: under a pool too small for the load, sequences swapped to the host pool and back give the
same greedy tokens as recompute and as a roomy pool; device and host blocks are accounted for at every step."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.sequence import SequenceStatus
from tests.block_invariants import check_pool, run_checked as run_pool_checked
from tests.conftest import SMALL_KV_GIB

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colours of the rainbow:"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# each request ends with 2-3 blocks: not all three fit
TIGHT = dict(num_kv_blocks=5, max_model_len=64)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def expected(prompt_ids) -> list[list[int]]:
    roomy = LLM(kv_cache_memory_gib=SMALL_KV_GIB)
    return [o.token_ids for o in roomy.generate(prompt_ids, GREEDY)]


def check_host_pool(engine: LLMEngine) -> None:
    manager, scheduler = engine.core.block_manager, engine.core.scheduler
    # slot -> sequences holding it (a request's sequences share their shared blocks)
    held: dict[int, int] = {}
    for seq in scheduler.swapped:
        assert len(set(seq.host_blocks)) == len(seq.host_blocks), (
            "a host block twice in one sequence"
        )
        for slot in seq.host_blocks:
            held[slot] = held.get(slot, 0) + 1
    assert held == manager.host.refs, (
        "host reference counts differ from the swapped sequences' slots"
    )
    for slot in held:  # only sequences of one request share a slot
        assert len({s.request_id for s in scheduler.swapped if slot in s.host_blocks}) == 1
    assert not set(held) & set(manager.host.free), "a host block both free and held"
    assert (
        len(held) + manager.host.num_free + len(manager.host.freed_this_step)
        == manager.host.num_blocks
    )
    assert all(
        seq.status is SequenceStatus.SWAPPED and not seq.block_table for seq in scheduler.swapped
    )


def run_checked(
    engine: LLMEngine, prompt_ids: list[list[int]], params: SamplingParams
) -> list[list[int]]:
    return run_pool_checked(engine, prompt_ids, params, check_host_pool)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_swap_and_recompute_give_the_roomy_pools_tokens(
    prompt_ids, expected, async_scheduling: bool
):
    swapping = LLM(
        preemption_mode="swap", swap_space_gib=0.05, async_scheduling=async_scheduling, **TIGHT
    ).engine
    assert run_checked(swapping, prompt_ids, GREEDY) == expected
    assert swapping.scheduler.num_swap_outs > 0, "the pool was meant to force swapping"
    recomputing = LLM(
        preemption_mode="recompute", async_scheduling=async_scheduling, **TIGHT
    ).engine
    assert run_checked(recomputing, prompt_ids, GREEDY) == expected
    assert recomputing.scheduler.num_preemptions > 0 and recomputing.scheduler.num_swap_outs == 0
    for engine in (swapping, recomputing):
        assert engine.stats().num_free_blocks == engine.stats().num_blocks
    assert (
        swapping.block_manager.host.num_free + len(swapping.block_manager.host.freed_this_step)
        == swapping.block_manager.host.num_blocks
    )


def test_a_host_pool_too_small_falls_back_to_recompute(prompt_ids, expected):
    # fewer host blocks than a sequence
    tiny = LLM(preemption_mode="swap", swap_space_gib=1e-5, **TIGHT).engine
    assert run_checked(tiny, prompt_ids, GREEDY) == expected
    assert tiny.scheduler.num_preemptions > 0 and tiny.scheduler.num_swap_outs == 0


def test_aborting_a_swapped_sequence_frees_its_host_blocks(prompt_ids):
    engine = LLM(preemption_mode="swap", swap_space_gib=0.05, **TIGHT).engine
    for i, ids in enumerate(prompt_ids):
        engine.add_request(f"r{i}", ids, GREEDY)
    while not engine.core.scheduler.swapped:
        engine.step()
    victim = engine.core.scheduler.swapped[0]
    (final,) = engine.abort_request(victim.request_id)
    assert final.finish_reason == "abort" and not victim.host_blocks
    check_host_pool(engine)
    while engine.has_unfinished_requests():
        engine.step()
    check_pool(engine.core.block_manager, [])
    assert (
        engine.core.block_manager.host.num_free
        + len(engine.core.block_manager.host.freed_this_step)
        == engine.core.block_manager.host.num_blocks
    )


def test_a_parallel_request_alone_recomputes_a_sample_rather_than_swap_itself_out(prompt_ids):
    """Swapping out a request that holds every running sequence would bring it back to the same shortage:
    one sample is recomputed instead, and the tokens still equal a roomy pool's."""
    params = SamplingParams(n=3, temperature=0, max_tokens=24, ignore_eos=True)
    roomy = LLM(kv_cache_memory_gib=SMALL_KV_GIB)
    expected = [o.token_ids for o in roomy.generate(prompt_ids[2], params)]
    engine = LLM(preemption_mode="auto", swap_space_gib=0.05, **TIGHT).engine
    engine.add_request("n3", prompt_ids[2], params)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((o.index, o.token_ids) for o in engine.step() if o.finished)
    assert [finals[i] for i in range(3)] == expected
    assert engine.core.scheduler.num_preemptions > 0 and engine.core.scheduler.num_swap_outs == 0


def test_bad_preemption_settings_name_the_field():
    with pytest.raises(ValueError, match="preemption_mode"):
        EngineConfig(preemption_mode="drop")
    with pytest.raises(ValueError, match="swap_space_gib"):
        EngineConfig(swap_space_gib=-1)


def test_a_parallel_request_is_swapped_as_a_group_sharing_its_host_copies(prompt_ids):
    """The samples of an n > 1 request leave together (all or nothing) with one host copy of each block they
    share, and come back sharing one device block again; their tokens equal a roomy pool's."""
    params = [SamplingParams(n=3, temperature=0, max_tokens=24, ignore_eos=True), GREEDY, GREEDY]
    a, b, c = prompt_ids
    requests = [c + b + a + c + b, b, c]  # the n=3 prompt fills one block: its samples share it
    roomy = LLM(kv_cache_memory_gib=SMALL_KV_GIB).engine
    engine = LLM(
        preemption_mode="auto", swap_space_gib=0.05, num_kv_blocks=8, max_model_len=96
    ).engine
    results, shared_on_host = [], False
    for llm_engine in (roomy, engine):
        for i, (ids, p) in enumerate(zip(requests, params)):
            llm_engine.add_request(f"r{i}", ids, p)
        finals = {}
        while llm_engine.has_unfinished_requests():
            for out in llm_engine.step():
                if out.finished:
                    finals[(out.request_id, out.index)] = out.token_ids
            scheduler = llm_engine.scheduler
            check_pool(
                llm_engine.block_manager,
                list(scheduler.running) + list(scheduler.waiting) + list(scheduler.swapped),
            )
            if llm_engine is engine:
                check_host_pool(engine)
                group = [s for s in scheduler.swapped if s.request_id == "r0"]
                if group:
                    assert not [s for s in scheduler.running if s.request_id == "r0"], (
                        "a request's samples are swapped out all together, not one by one"
                    )
                    slots = [slot for s in group for slot in s.host_blocks]
                    shared_on_host |= len(set(slots)) < len(slots)
        results.append(finals)
    assert results[1] == results[0]
    assert shared_on_host, (
        "the n=3 request was meant to be swapped out with its shared prompt blocks"
    )
    check_host_pool(engine)


def test_a_swapped_in_group_larger_than_the_step_budget_takes_several_steps():
    """Two best_of = 112 requests in a small pool: a group swapped back in meets a budget smaller than itself (the
    CPU's step-time target cuts it to a block beside the decodes); the sequences past the budget wait for the next
    step instead of joining this one with no tokens (which the native decode step refused, ending the engine)."""
    engine = LLMEngine(kv_cache_memory_gib=0.1, max_model_len=128, step_time_target_s=0.25)
    params = SamplingParams(
        best_of=112, n=1, max_tokens=4, ignore_eos=True, temperature=1.0, seed=1
    )
    engine.add_request("a", [161, 5000], params)
    engine.add_request("b", [162, 6000, 7], params)
    finished, swapped_in = [], 0
    while engine.has_unfinished_requests():
        finished += [out for out in engine.step() if out.finished]
        batch = engine.last_batch
        assert 0 not in batch.num_new_tokens
        swapped_in += bool(batch.swap_in)
    assert len(finished) == 2 * 112 and swapped_in, "the pool was small enough to swap"
