"""Prefill at the machine's speed (issue 49): the CPU's step-time target cuts a prompt's chunks only while a
stream decodes beside it, never below the efficient chunk (a chunk whose own work reaches the step's fixed cost),
in a step of one tenant and in a shared one; a few slow first steps do not linger in the measured prices; the
engine counts the prompt tokens it computes, step by step. Without a model except the last test."""

from __future__ import annotations

import math

from engine.core.step_cost import StepCostModel
from tests.block_invariants import check_pool
from tests.engine.test_fair_scheduling import BLOCK, decoding, make_scheduler, request, step

# a busy 2-vCPU machine (issue 49): a one-block step takes seconds, mostly fixed cost
SLOW_FIXED, SLOW_PER_TOKEN = 2.5, 0.05
TARGET = 0.25


def slow_scheduler(budget: int = 256):
    scheduler = make_scheduler(budget=budget, num_blocks=1024)
    scheduler.step_time_target_s = TARGET
    return scheduler


def feed(model: StepCostModel, fixed: float, per_token: float, prefill_fixed: float = 0.0) -> None:
    """Steps of a machine whose step of x tokens takes fixed + per_token * x (+ prefill_fixed with prefill)."""
    for _ in range(3):
        for tokens in (1, 8):
            model.observe(tokens, fixed + per_token * tokens)
        if prefill_fixed:
            model.observe(20, fixed + prefill_fixed + per_token * 20, prefill=True)


def efficient_chunk(fixed: float, per_token: float, prefill_fixed: float = 0.0) -> int:
    """By hand: the fewest whole blocks whose tokens' own work reaches the step's fixed cost."""
    return math.ceil((fixed + prefill_fixed) / per_token / BLOCK) * BLOCK


def test_a_lone_prompt_prefills_in_full_steps_however_slow_the_steps():
    scheduler = slow_scheduler(budget=256)
    feed(scheduler.step_cost, SLOW_FIXED, SLOW_PER_TOKEN)
    assert scheduler.step_cost.prices().tokens_within(TARGET, prefill=True) == 0
    prompt = request("a", length=600)
    scheduler.add(prompt)
    chunks = []
    while prompt.num_uncomputed_tokens > 1 or not prompt.num_computed_tokens:
        chunks.append(step(scheduler)[prompt])
    assert chunks == [256, 256, 88], (
        "nothing runs beside it: the step's whole token budget each time"
    )


def test_beside_a_stream_a_slow_machines_prompt_chunks_stay_efficient():
    scheduler = slow_scheduler(budget=256)
    (stream,) = decoding(scheduler, "a", 1)
    feed(scheduler.step_cost, SLOW_FIXED, SLOW_PER_TOKEN)
    prompt = request("a", length=300)
    scheduler.add(prompt)
    chunk = efficient_chunk(SLOW_FIXED, SLOW_PER_TOKEN)  # 2.5 s / 50 ms = 50 tokens: 13 blocks of 4
    for _ in range(3):
        scheduled = step(scheduler)
        assert stream in scheduled, "the stream's token comes every step"
        assert scheduled[prompt] == chunk, (
            "not one block: a step of it would be nearly all fixed cost"
        )
    check_pool(scheduler.block_manager, list(scheduler.running) + list(scheduler.waiting))


def test_a_shared_steps_prefill_beside_another_tenants_stream_comes_in_efficient_chunks():
    scheduler = slow_scheduler(budget=256)
    scheduler.shared_step.time_factor = 1.5
    (stream,) = decoding(scheduler, "light", 1)
    prefill_fixed = 1.0
    feed(scheduler.step_cost, SLOW_FIXED, SLOW_PER_TOKEN, prefill_fixed)
    prompt = request("heavy", length=400)
    scheduler.add(prompt)
    chunk = efficient_chunk(SLOW_FIXED, SLOW_PER_TOKEN, prefill_fixed)  # 3.5 s / 50 ms: 72 tokens
    chunks = []
    for _ in range(200):
        scheduled = step(scheduler)
        assert stream in scheduled, "the light tenant's stream steps every time"
        if prompt in scheduled:
            chunks.append(scheduled[prompt])
        if prompt.num_computed_tokens >= prompt.num_prompt_tokens:
            break
    assert sum(chunks) == prompt.num_prompt_tokens
    assert min(chunks[:-1], default=chunk) >= chunk, f"chunks {chunks}"


def test_a_few_slow_first_steps_do_not_linger_in_the_prices():
    model = StepCostModel()
    fixed, per_token = 0.010, 0.002
    model.observe(1, 3.0)  # a process's first steps: weights paged in, buffers grown
    model.observe(8, 4.0)
    for _ in range(5):
        for tokens in (1, 8):
            model.observe(tokens, fixed + per_token * tokens)
    prices = model.prices()
    assert math.isclose(prices.fixed, fixed, rel_tol=1e-6)
    assert math.isclose(prices.per_token, per_token, rel_tol=1e-6)


def test_a_slow_first_prefill_step_does_not_linger_in_the_prefill_price():
    model = StepCostModel()
    fixed, per_token, prefill_fixed = 0.010, 0.002, 0.025
    feed(model, fixed, per_token)
    model.observe(64, 30.0, prefill=True)
    for _ in range(4):
        model.observe(64, fixed + prefill_fixed + per_token * 64, prefill=True)
    assert math.isclose(model.prices().prefill_fixed, prefill_fixed, rel_tol=1e-6)


def test_the_engine_counts_the_prompt_tokens_it_computes_chunk_by_chunk():
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from tests.conftest import SMALL_KV_GIB

    engine = LLMEngine(kv_cache_memory_gib=SMALL_KV_GIB, max_num_batched_tokens=16)
    engine.add_request("a", list(range(100, 140)), SamplingParams(temperature=0, max_tokens=2))
    computed = []
    while engine.has_unfinished_requests():
        engine.step()
        computed.append(engine.stats().prefill_tokens)
    # 40 prompt tokens in chunks of 16, 16, 8; then a decode step (its token is generated, not prompt)
    assert computed[:4] == [16, 32, 40, 40]
    assert engine.stats().prompt_tokens == 40
