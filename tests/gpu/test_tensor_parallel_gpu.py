"""Tensor parallelism on two CUDA GPUs (NCCL): dummy weights in float32, the two-rank engine gives the single-rank
engine's greedy tokens for mixed-length prompts with chunked prefill and a prefix hit, CUDA graphs on (the
process's first two-rank engine adds its prefill steps' partial sums through symmetric memory); and its
decode-only steps of several sequences replay the captured graphs (the all-reduces inside them)."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from engine.distributed import parallel_state
from engine.llm import LLM
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (runs on a 2-GPU device machine)"
)

NEW_TOKENS = 16
SHARED_LEN = 80  # the prefix the last two prompts share: 5 full blocks of 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
# steps of up to 160 tokens: llama-3.2-1b's all-reduces of 128 .. 160 rows of 2048 float32 (1 .. 1.25 MiB) take the
# symmetric-memory path of the process's first tensor-parallel engine (engine/distributed/parallel_state.py), the rest NCCL
OPTIONS = {
    "load_format": "dummy",
    "dtype": "float32",
    "device": "cuda",
    "num_kv_blocks": 256,
    "max_num_batched_tokens": 160,
    "max_model_len": 1024,
}


def mixed_prompts(seed: int = 0) -> list[list[int]]:
    """Five lengths (300 comes in chunks of 160), then two that share an 80-token prefix."""
    rng = random.Random(seed)
    shared = [rng.randrange(10000) for _ in range(SHARED_LEN)]
    prompts = [[rng.randrange(10000) for _ in range(n)] for n in (3, 17, 64, 129, 300)]
    return prompts + [shared + [rng.randrange(10000) for _ in range(n)] for n in (5, 40)]


def generate(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """Token ids of every prompt (the last one after the others: a prefix hit) and the last one's cached tokens."""
    first = llm.generate(prompts[:-1], GREEDY)
    (last,) = llm.generate([prompts[-1]], GREEDY)
    return [o.token_ids for o in first + [last]], last.num_cached_tokens


@pytest.mark.parametrize("model_config", ["llama-3.2-1b", "qwen3-0.6b"])
def test_two_ranks_give_the_single_rank_greedy_tokens_float32_with_graphs_chunks_and_a_prefix_hit(
    model_config,
):
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = mixed_prompts()
    llm = LLM(model_config=model_config, **OPTIONS)
    assert llm.engine.runner.decode_graphs.graphs is not None
    single, single_cached = generate(llm, prompts)
    del llm
    gc.collect()
    torch.cuda.empty_cache()

    first_group = not parallel_state.peer_all_reduce_spent()
    llm = LLM(model_config=model_config, tensor_parallel_size=2, **OPTIONS)
    try:
        assert llm.engine.runner.decode_graphs.graphs is not None
        assert parallel_state.peer_all_reduce_active() == first_group
        sharded, sharded_cached = generate(llm, prompts)
    finally:
        llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    assert single_cached == sharded_cached == SHARED_LEN // 16 * 16
    assert [len(t) for t in sharded] == [NEW_TOKENS] * len(prompts)
    assert sharded == single


def test_a_decode_only_batch_larger_than_one_replays_cuda_graphs_with_two_ranks():
    rng = random.Random(1)
    # one prefill step, then 4 decode
    prompts = [[rng.randrange(10000) for _ in range(n)] for n in (5, 9, 12, 20)]
    llm = LLM(model_config="llama-3.2-1b", tensor_parallel_size=2, **OPTIONS)
    try:
        graphs = llm.engine.runner.decode_graphs.graphs
        assert graphs is not None
        replayed: list[int] = []
        replay = graphs.replay
        # (the sizes rank 0 replays)
        graphs.replay = lambda size: (replayed.append(size), replay(size))[1]
        outputs = llm.generate(prompts, GREEDY)
    finally:
        llm.shutdown()
    assert [len(o.token_ids) for o in outputs] == [NEW_TOKENS] * len(prompts)
    assert graphs.num_replays > 0
    # decode-only steps of all four sequences (padded to a captured size)
    assert max(replayed) >= len(prompts)
