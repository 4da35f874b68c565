"""Swap preemption and the host tier of the prefix cache on CUDA (pinned host pools, batched copies over the
host link), float32 dummy llama-3.2-1b: greedy tokens equal to a roomy pool that never preempts or evicts."""

from __future__ import annotations

import random

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.block_invariants import run_checked

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)"
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
BASE = dict(
    load_format="dummy",
    model_config="llama-3.2-1b",
    dtype="float32",
    device="cuda",
    max_model_len=512,
)


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10000) for _ in range(n)] for n in lengths]


def generate_checked(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    return run_checked(llm.engine, batch, GREEDY)


@pytest.fixture(scope="module")
def roomy() -> LLM:
    torch.backends.cuda.matmul.allow_tf32 = False
    return LLM(num_kv_blocks=512, **BASE)


def test_swap_and_recompute_equal_a_roomy_pool_on_cuda(roomy):
    batch = prompts(1, [40, 90, 130, 75, 60, 110])
    expected = generate_checked(roomy, batch)
    swapping = LLM(num_kv_blocks=24, preemption_mode="swap", swap_space_gib=0.5, **BASE)
    assert generate_checked(swapping, batch) == expected
    assert swapping.engine.scheduler.num_swap_outs > 0, "the pool was meant to force swapping"
    recomputing = LLM(num_kv_blocks=24, preemption_mode="recompute", **BASE)
    assert generate_checked(recomputing, batch) == expected
    assert recomputing.engine.scheduler.num_preemptions > 0


def test_host_tier_restores_an_evicted_prefix_on_cuda(roomy):
    head, fillers = prompts(2, [200]), prompts(3, [150, 150, 150])
    follow_up = prompts(4, [20])
    llm = LLM(num_kv_blocks=30, host_cache_gib=0.5, **BASE)
    first = generate_checked(llm, head)[0]
    # the pool holds 480 tokens: the head's blocks are evicted to the host
    generate_checked(llm, fillers)
    second_prompt = head[0] + first + follow_up[0]
    (second,) = generate_checked(llm, [second_prompt])
    stats = llm.engine.stats()
    assert stats.host_cache_stores > 0 and stats.prefix_host_hits >= 192
    expected_first = generate_checked(roomy, head)[0]
    (expected_second,) = generate_checked(roomy, [second_prompt])
    assert (first, second) == (expected_first, expected_second)
