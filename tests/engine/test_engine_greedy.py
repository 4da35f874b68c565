"""The engine's greedy output equals transformers' token for token (CPU, float32), however the work is
batched: all prompts together, chunked prefill under a tiny token budget, and preemption under a pool
too small for all of them — with sampled ids read at once or one step late (async scheduling). A run may part
from transformers only at a float32 near-tie of transformers' own logits (tests/greedy_agreement.py: which of two
tokens that close wins depends on the CPU's kernels)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.conftest import SMALL_KV_GIB, hf_greedy
from tests.greedy_agreement import assert_transformers_greedy

NEW_TOKENS = 24

TEXTS = [
    "Hi",
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""',
    "List three colours of the rainbow:",
    "Water boils at a temperature of " * 3,
    "In 1969, the first humans landed on the Moon. The mission was called",
    "A long story: " + "the quick brown fox jumps over the lazy dog, " * 14,
    "Question: what is 12 times 12? Answer:",
]


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    ids = [tokenizer.encode(t) for t in TEXTS]
    ids.append(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "Name a planet."}],
            tokenize=False,
            add_generation_prompt=True,
        )
    )
    ids[-1] = tokenizer.encode(ids[-1], add_special_tokens=False)
    assert len({len(p) for p in ids}) >= 7, "prompt lengths should be mixed"
    return ids


@pytest.fixture(scope="module")
def expected(hf_model, prompts) -> list[list[int]]:
    return [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


ASYNC = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


@ASYNC
def test_batched_greedy_equals_transformers(hf_model, prompts, expected, async_scheduling):
    llm = LLM(
        cpu_weights="float32", kv_cache_memory_gib=SMALL_KV_GIB, async_scheduling=async_scheduling
    )
    outputs = llm.generate(prompts, GREEDY)
    assert_transformers_greedy(hf_model, prompts, [o.token_ids for o in outputs], expected)
    assert all(o.finish_reason == "length" for o in outputs)


@ASYNC
def test_chunked_prefill_equals_transformers(hf_model, prompts, expected, async_scheduling):
    llm = LLM(
        cpu_weights="float32",
        kv_cache_memory_gib=SMALL_KV_GIB,
        max_num_batched_tokens=7,
        enable_prefix_caching=False,
        async_scheduling=async_scheduling,
    )
    outputs = llm.generate(prompts, GREEDY)
    assert_transformers_greedy(hf_model, prompts, [o.token_ids for o in outputs], expected)
    longest = max(len(p) for p in prompts)
    assert llm.engine.stats().steps >= longest // 7, "prefills must have been split into chunks"


@ASYNC
def test_preemption_keeps_output_identical(hf_model, prompts, expected, async_scheduling):
    longest = max(len(p) for p in prompts) + NEW_TOKENS
    num_blocks = -(-longest // 16) + 2  # room for the longest request alone, far from all of them
    llm = LLM(
        cpu_weights="float32",
        num_kv_blocks=num_blocks,
        max_num_batched_tokens=64,
        async_scheduling=async_scheduling,
    )
    outputs = llm.generate(prompts, GREEDY)
    assert llm.engine.stats().preemptions > 0
    assert_transformers_greedy(hf_model, prompts, [o.token_ids for o in outputs], expected)
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_blocks


def test_decode_batches_padded_to_graph_sizes_equal_transformers(hf_model, prompts, expected):
    """The CUDA-graph input layout, run eagerly on the CPU: decode batches padded to the next graph size
    (rows that write nowhere), block tables in the graphs' static table, pending tokens fed on the device."""
    llm = LLM(
        cpu_weights="float32",
        kv_cache_memory_gib=SMALL_KV_GIB,
        max_graph_batch_size=16,
        max_num_batched_tokens=64,
        async_scheduling=True,
    )
    outputs = llm.generate(prompts, GREEDY)
    assert_transformers_greedy(hf_model, prompts, [o.token_ids for o in outputs], expected)
    # 9 decoding sequences ran as a batch of 16
    assert llm.engine.runner.decode_graphs.padded_steps[16] > 0
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_blocks


# run with PAGEDCHAT_KERNELS=reference (read when kernels is imported, hence a process of its own): prints the
# greedy tokens and how often the attention layers handed their rotation to the KV store
REFERENCE_KERNELS_RUN = """
import json, sys
import kernels
from engine.llm import LLM
from engine.sampling_params import SamplingParams
calls = []
store = kernels.ops.rotary_store_kv
kernels.ops.rotary_store_kv = lambda *args: calls.append(1) or store(*args)
llm = LLM(cpu_weights="float32", kv_cache_memory_gib=KV_GIB, max_num_batched_tokens=64)
greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
outputs = llm.generate(json.loads(sys.stdin.read()), greedy)
print(json.dumps([[o.token_ids for o in outputs], len(calls)]))
"""


def test_the_gpu_layer_path_with_reference_kernels_equals_transformers(hf_model, prompts, expected):
    """The layers as the GPU runs them, the torch references standing in for the kernels: the attention layer
    hands its rotation to the KV backend, which rotates q and k in the launch that stores K and V
    (``kernels.ops.rotary_store_kv``), where the lean CPU path rotates first. Still transformers' tokens."""
    script = REFERENCE_KERNELS_RUN.replace("KV_GIB", str(SMALL_KV_GIB)).replace(
        "NEW_TOKENS", str(NEW_TOKENS)
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        input=json.dumps(prompts),
        capture_output=True,
        text=True,
        env={**os.environ, "PAGEDCHAT_KERNELS": "reference"},
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    tokens, rotated_stores = json.loads(result.stdout.strip().splitlines()[-1])
    assert_transformers_greedy(hf_model, prompts, tokens, expected)
    assert rotated_stores > 0, "the layers should have handed their rotation to the KV store"


def test_text_is_the_decoded_tokens(prompts, tokenizer):
    llm = LLM(cpu_weights="float32", kv_cache_memory_gib=SMALL_KV_GIB)
    (output,) = llm.generate([prompts[1]], GREEDY)
    assert output.text == tokenizer.decode(output.token_ids, skip_special_tokens=True)
