"""The start-up warm-up (engine/worker/warm_up.py) on the GPU: after an engine has started, serving a varied
workload (prompts short and long, chunked, on a cached prefix, decode rows beside prefill chunks, every sampling
path) compiles no new Triton variant, for the bf16 cache and the FP8 one, and leaves the block pool as the
specification says."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from benchmarks.harness.engine import compiled_variants
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.block_invariants import check_pool
from tests.two_layer_llama import two_layer_llama_dir

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)"
)


def varied_workload(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompt lengths across the counts a step can take (1 token to past the prefill kernel's TMA threshold, a
    shared prefix) and one request of each sampling path, of different output lengths."""
    rng = random.Random(seed)
    shared = [rng.randrange(10000) for _ in range(300)]
    lengths = (1, 2, 5, 16, 23, 31, 40, 64, 100, 257, 700, 1500, 2100, 3000)
    prompts = [[rng.randrange(10000) for _ in range(n)] for n in lengths]
    prompts += [shared + [rng.randrange(10000) for _ in range(n)] for n in (3, 50, 190)]
    variants = [
        {"temperature": 0.0},
        {"temperature": 0.0, "logprobs": 3},
        {"temperature": 0.8, "top_k": 20, "top_p": 0.9},
        {"temperature": 1.0, "min_p": 0.05, "seed": 5},
        {"temperature": 0.7, "presence_penalty": 0.4, "repetition_penalty": 1.1},
        {"temperature": 1.0, "logit_bias": {7: 3.0}, "logprobs": 1},
    ]
    params = [
        SamplingParams(max_tokens=3 + 5 * i, ignore_eos=True, **variants[i % len(variants)])
        for i in range(len(prompts))
    ]
    return prompts, params


@pytest.mark.parametrize(
    "model_config,kv_cache_dtype", [("llama-3.2-1b", "auto"), ("qwen3-0.6b", "fp8")]
)
def test_serving_after_start_compiles_no_triton_variant(model_config, kv_cache_dtype):
    llm = LLM(
        load_format="dummy",
        model_config=model_config,
        device="cuda",
        kv_cache_dtype=kv_cache_dtype,
        max_model_len=8192,
    )
    engine = llm.engine
    assert engine.core.warm_up_seconds > 0
    check_pool(engine.block_manager, [])
    at_start = compiled_variants()
    prompts, params = varied_workload(0)
    outputs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outputs] == [p.max_tokens for p in params]
    # a second wave on the cached prefixes, n > 1 and a beam
    more = llm.generate(
        prompts[-3:] + prompts[:2],
        [SamplingParams(max_tokens=9, ignore_eos=True, temperature=0.9, n=2)] * 3
        + [SamplingParams(max_tokens=5, ignore_eos=True, use_beam_search=True, beam_width=2)] * 2,
    )
    assert more[0].num_cached_tokens >= 300 - engine.config.block_size
    new = {
        name: count - at_start.get(name, 0)
        for name, count in compiled_variants().items()
        if count > at_start.get(name, 0)
    }
    assert new == {}, f"Triton variants compiled after start-up: {new}"
    check_pool(engine.block_manager, [])
    del llm, engine
    # (the engine's parts refer to each other: a collection frees its device memory now)
    gc.collect()
    torch.cuda.empty_cache()


def test_a_draft_models_kernels_are_warmed_at_start_too(tmp_path, monkeypatch):
    """Speculative decoding with a draft of other shapes (head_dim 128 beside the model's 64): its catch-up
    prefills and propose passes compile nothing after start-up either."""
    from engine.speculative import speculator as speculator_module

    draft = two_layer_llama_dir(tmp_path, hidden_size=512, head_dim=128, intermediate_size=1024)
    monkeypatch.setattr(speculator_module, "choose_draft_length", lambda state, limit, *_: limit)
    llm = LLM(
        load_format="dummy",
        model_config="llama-3.2-1b",
        device="cuda",
        max_model_len=8192,
        speculative_model=str(draft),
    )
    at_start = compiled_variants()
    prompts, params = varied_workload(1)
    outputs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outputs] == [p.max_tokens for p in params]
    assert llm.engine.stats().spec_draft_tokens > 0
    new = {
        name: count - at_start.get(name, 0)
        for name, count in compiled_variants().items()
        if count > at_start.get(name, 0)
    }
    assert new == {}, f"Triton variants compiled after start-up: {new}"
    check_pool(llm.engine.block_manager, [])
    del llm
    gc.collect()
    torch.cuda.empty_cache()
