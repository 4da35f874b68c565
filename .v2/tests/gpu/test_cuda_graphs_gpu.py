"""CUDA graphs and async scheduling on the GPU: decode steps replayed from graphs give transformers' greedy
tokens (float32) through prefix hits, chunked prefill and preemption, and graphs on / --enforce-eager /
sync scheduling all give identical tokens in bfloat16."""

from __future__ import annotations

import random

import pytest
import torch

from engine.llm import LLM
from engine.worker.dummy_model import dummy_hf_config, dummy_weights
from engine.sampling_params import SamplingParams
from tests.block_invariants import check_pool
from tests.conftest import hf_greedy

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)"
)

NEW_TOKENS = 24


def mixed_prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(10000) for _ in range(80)]
    prompts = [
        [rng.randrange(10000) for _ in range(n)] for n in (3, 17, 64, 129, 300, 41, 7, 222, 90)
    ]
    return prompts + [shared + [rng.randrange(10000) for _ in range(n)] for n in (5, 40, 3)]


def varied_params(count: int) -> list[SamplingParams]:
    """Different lengths, so the decode batch shrinks through many graph sizes."""
    return [
        SamplingParams(temperature=0.0, max_tokens=8 + 3 * i, ignore_eos=True) for i in range(count)
    ]


def test_graphs_with_preemption_equal_transformers_float32():
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = mixed_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    # 40 blocks of 16 cannot hold all 12 requests at once: the newest are preempted and recomputed
    llm = LLM(
        load_format="dummy",
        model_config="llama-3.2-1b",
        dtype="float32",
        device="cuda",
        num_kv_blocks=40,
        max_num_batched_tokens=96,
        max_model_len=512,
    )
    assert llm.engine.runner.decode_graphs.graphs is not None
    outputs = llm.generate(prompts[:-1], params)
    (last,) = llm.generate([prompts[-1]], params)  # 80 shared tokens: 5 cached blocks
    stats = llm.engine.stats()
    assert stats.preemptions > 0
    assert last.num_cached_tokens == 80
    assert llm.engine.runner.decode_graphs.graphs.num_replays > 0
    check_pool(llm.engine.block_manager, [])

    config = dummy_hf_config("llama-3.2-1b")
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to("cuda").eval()
    hf.load_state_dict(dict(dummy_weights(config, seed=0, device="cuda")), strict=False)
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert [o.token_ids for o in outputs + [last]] == expected


@pytest.mark.parametrize("model_config", ["llama-3.2-1b", "qwen3-0.6b"])
def test_graphs_eager_and_sync_give_identical_tokens_bf16(model_config):
    prompts = mixed_prompts(1)
    params = varied_params(len(prompts))
    results = {}
    for name, options in {
        "graphs+async": {},
        "eager+async": {"enforce_eager": True},
        "graphs+sync": {"async_scheduling": False},
    }.items():
        llm = LLM(
            load_format="dummy",
            model_config=model_config,
            device="cuda",
            num_kv_blocks=512,
            max_num_batched_tokens=256,
            max_model_len=1024,
            max_num_seqs=32,
            **options,
        )
        assert (llm.engine.runner.decode_graphs.graphs is None) == ("eager" in name)
        results[name] = [o.token_ids for o in llm.generate(prompts, params)]
        assert [len(t) for t in results[name]] == [p.max_tokens for p in params]
        del llm
        torch.cuda.empty_cache()
    assert results["graphs+async"] == results["eager+async"] == results["graphs+sync"]
