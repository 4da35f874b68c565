"""Speculative decoding on the GPU: greedy output with n-gram drafts equals plain decoding's (float32, dummy
weights, CUDA graphs: drafted steps replay the verify graphs), through preemption, and the block books balance."""

from __future__ import annotations

import random

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.block_invariants import check_pool

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)"
)


def repetitive_prompts() -> list[list[int]]:
    rng = random.Random(3)
    phrase = [rng.randrange(1000, 20000) for _ in range(12)]
    return [
        phrase * 4 + [rng.randrange(1000, 20000) for _ in range(n)] + phrase[:6]
        for n in (3, 30, 70, 11, 150, 5)
    ]


@pytest.mark.parametrize("num_kv_blocks", [400, 24], ids=["roomy", "preempting"])
def test_ngram_greedy_equals_plain_float32(num_kv_blocks):
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = repetitive_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    common = dict(
        load_format="dummy",
        model_config="llama-3.2-1b",
        dtype="float32",
        device="cuda",
        num_kv_blocks=num_kv_blocks,
        max_num_batched_tokens=256,
        max_model_len=512,
        gpu_memory_utilization=0.5,
    )
    plain = [o.token_ids for o in LLM(**common).generate(prompts, params)]
    llm = LLM(**common, speculative="ngram", num_speculative_tokens=4)
    # half the prompts get plain decoding's output as speculative_context: their drafts are mostly right
    with_context = [
        SamplingParams(
            temperature=0.0,
            max_tokens=48,
            ignore_eos=True,
            speculative_context=list(out) if i % 2 else [],
        )
        for i, out in enumerate(plain)
    ]
    spec = [o.token_ids for o in llm.generate(prompts, with_context)]
    stats = llm.engine.stats()
    graphs = llm.engine.core.runner.decode_graphs
    print(
        f"drafted {stats.spec_draft_tokens} accepted {stats.spec_accepted_tokens} "
        f"verifications {stats.spec_verifications} verify replays "
        f"{graphs.verify_graphs.num_replays if graphs.verify_graphs else 0}"
    )
    assert stats.spec_accepted_tokens > 3 * 48 // 2, (
        "the drafts from the context should mostly be kept"
    )
    assert graphs.verify_graphs is not None and graphs.verify_graphs.num_replays > 0
    if num_kv_blocks == 24:
        assert stats.preemptions > 0
    for i, (a, b) in enumerate(zip(plain, spec)):
        assert a == b, f"prompt {i}: speculative output parts from plain decoding"
    check_pool(llm.engine.core.block_manager, [])
