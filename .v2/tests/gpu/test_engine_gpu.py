"""The engine end to end on CUDA: dummy weights of llama-3.2-1b in float32, greedy output equal to
transformers' (same weights) for a batch of mixed-length prompts, with prefix hits and chunked prefill."""

from __future__ import annotations

import random

import pytest
import torch

from engine.llm import LLM
from engine.worker.dummy_model import dummy_hf_config, dummy_weights
from engine.sampling_params import SamplingParams
from tests.conftest import hf_greedy

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)"
)

NEW_TOKENS = 16


def test_engine_on_cuda_equals_transformers_with_prefix_hits_and_chunks():
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    rng = random.Random(0)
    shared = [rng.randrange(10000) for _ in range(80)]
    prompts = [[rng.randrange(10000) for _ in range(n)] for n in (3, 17, 64, 129, 300)]
    prompts += [shared + [rng.randrange(10000) for _ in range(n)] for n in (5, 40)]
    llm = LLM(
        load_format="dummy",
        model_config="llama-3.2-1b",
        dtype="float32",
        device="cuda",
        num_kv_blocks=256,
        max_num_batched_tokens=96,
        max_model_len=1024,
    )
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    first = llm.generate(prompts[:-1], params)
    (last,) = llm.generate([prompts[-1]], params)  # shares 80 tokens with the previous prompt
    assert last.num_cached_tokens == 80 // 16 * 16

    config = dummy_hf_config("llama-3.2-1b")
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to("cuda").eval()
    hf.load_state_dict(dict(dummy_weights(config, seed=0, device="cuda")), strict=False)
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert [o.token_ids for o in first + [last]] == expected
