"""Tensor parallelism on the CPU (gloo, N processes on this machine): the sharded model gives the single-rank
engine's greedy tokens for plain, chunked, prefix-hit and preempted requests, each rank loads only its shard,
a model whose heads do not divide is refused, and a rank that dies ends every request instead of hanging."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from engine.distributed import parallel_state
from engine.async_engine import AsyncEngine, EngineDeadError
from engine.config import EngineConfig
from engine.llm import LLM
from engine.models.llama import LlamaForCausalLM
from engine.sampling_params import SamplingParams
from tests.engine.test_engine_process import child_processes
from tests.engine.test_models import tiny_hf_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SHARED = list(range(40, 80))  # 40 tokens: two full blocks of 16 shared by two prompts
PROMPTS = [[5, 17, 200, 3, 9], list(range(30, 90)), [7] * 23, SHARED + [1, 2, 3], SHARED + [9, 8]]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random models saved as HF directories: a Llama with its own output layer (4 heads, 2 kv heads), a
    Llama with biases and tied embeddings, and a Qwen3 (q/k norms, head_dim 32)."""
    dirs = {}
    for family in ("llama", "llama-bias-tied", "qwen3"):
        path = tmp_path_factory.mktemp(family)
        tiny_hf_model(family).save_pretrained(path)
        dirs[family] = path
    return dirs


def generate(
    path: Path,
    size: int,
    prompts: list[list[int]],
    params: SamplingParams = GREEDY,
    **options: object,
) -> tuple[list[list[int]], list[int]]:
    """Token ids and cached-prompt counts of ``prompts`` (the last two after the others: a prefix hit)."""
    llm = LLM(model=str(path), tensor_parallel_size=size, **options)
    try:
        first = llm.generate(prompts[:-1], params)
        last = llm.generate(prompts[-1:], params)
        return [o.token_ids for o in first + last], [o.num_cached_tokens for o in first + last]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("family", ["llama", "llama-bias-tied", "qwen3"])
def test_two_ranks_give_the_single_rank_greedy_tokens_with_chunks_and_prefix_hits(
    model_dirs, family: str
):
    # the 60-token prompt comes in two chunks
    options = dict(num_kv_blocks=64, max_num_batched_tokens=32)
    single, single_cached = generate(model_dirs[family], 1, PROMPTS, **options)
    sharded, sharded_cached = generate(model_dirs[family], 2, PROMPTS, **options)
    assert sharded == single
    assert sharded_cached[-1] == single_cached[-1] == 32  # the shared prefix's two full blocks


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_two_ranks_give_the_single_rank_greedy_tokens_when_requests_are_preempted(
    model_dirs, mode: str
):
    prompts = [list(range(10 + i, 50 + i)) for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    options = dict(
        num_kv_blocks=14, max_num_batched_tokens=64, preemption_mode=mode, swap_space_gib=0.01
    )
    llm = LLM(model=str(model_dirs["llama"]), tensor_parallel_size=2, **options)
    try:
        sharded = [o.token_ids for o in llm.generate(prompts, params)]
        # 6 x 80 tokens do not fit 14 blocks of 16 at once
        assert llm.engine.core.stats().preemptions > 0
    finally:
        llm.shutdown()
    alone = LLM(model=str(model_dirs["llama"]), num_kv_blocks=64)
    assert sharded == [o.token_ids for o in alone.generate(prompts, params)]


def test_four_ranks_replicate_the_two_kv_heads(model_dirs):
    single, _ = generate(model_dirs["llama"], 1, PROMPTS[:3], num_kv_blocks=64)
    sharded, _ = generate(model_dirs["llama"], 4, PROMPTS[:3], num_kv_blocks=64)
    assert sharded == single


def test_each_rank_reads_only_its_slice_of_each_tensor(model_dirs, monkeypatch: pytest.MonkeyPatch):
    """Rank 1 of 2 built in this process: its parameters are its rows (columns for o/down) of the checkpoint's
    tensors, read through lazy slices (no whole tensor is read)."""
    from transformers import AutoConfig

    from engine.worker.loader import _safetensors_weights

    path = model_dirs["llama"]
    with safe_open(path / "model.safetensors", framework="pt") as f:
        full = {name: f.get_tensor(name) for name in f.keys()}
    monkeypatch.setattr(parallel_state, "_current", parallel_state.TensorParallel(1, 2))
    model = LlamaForCausalLM(AutoConfig.from_pretrained(path))
    sources = list(_safetensors_weights(path))
    # lazy slices, read when indexed
    assert not any(isinstance(source, torch.Tensor) for _, source in sources)
    model.load_weights(sources)
    layer = model.model.layers[1]
    # 4 heads, 2 kv heads of 16: rank 1 has q heads 2-3, kv head 1
    qkv = layer.self_attn.qkv_proj.weight
    hf = "model.layers.1.self_attn."
    assert torch.equal(qkv[:32], full[hf + "q_proj.weight"][32:64])
    assert torch.equal(qkv[32:48], full[hf + "k_proj.weight"][16:32])
    assert torch.equal(qkv[48:], full[hf + "v_proj.weight"][16:32])
    assert torch.equal(layer.self_attn.o_proj.weight, full[hf + "o_proj.weight"][:, 32:])
    down = full["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(layer.mlp.down_proj.weight, down[:, 64:])
    assert torch.equal(
        layer.mlp.gate_up_proj.weight[64:], full["model.layers.1.mlp.up_proj.weight"][64:]
    )
    assert torch.equal(model.model.embed_tokens.weight, full["model.embed_tokens.weight"][160:])
    assert torch.equal(model.lm_head.weight, full["lm_head.weight"][160:])
    assert torch.equal(layer.input_layernorm.weight, full["model.layers.1.input_layernorm.weight"])


def test_a_model_whose_heads_the_ranks_do_not_divide_is_refused(model_dirs):
    with pytest.raises(
        ValueError, match="tensor_parallel_size: 3 does not divide the model's 4 attention heads"
    ):
        LLM(model=str(model_dirs["llama"]), tensor_parallel_size=3, num_kv_blocks=16)
    assert not parallel_state.current().size > 1  # the group was left: another engine may start
    assert not worker_pids(os.getpid())


def test_tensor_parallel_options_are_checked():
    with pytest.raises(ValueError, match="tensor_parallel_size: must be in"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="cpu_weights: tensor parallelism"):
        EngineConfig(tensor_parallel_size=2, cpu_weights="q4", device="cpu")
    with pytest.raises(ValueError, match="all_reduce: must be one of auto, two_shot, nccl"):
        EngineConfig(all_reduce="ring")
    with pytest.raises(ValueError, match="all_reduce: 'ring' is not one of auto, two_shot, nccl"):
        parallel_state.init_tensor_parallel(
            0, 2, torch.device("cpu"), "file:///nonexistent", all_reduce="ring"
        )


def worker_pids(parent: int) -> list[int]:
    """Tensor-parallel worker processes whose parent is ``parent``."""
    return child_processes(parent, b"engine.worker.tp_worker")


async def test_a_killed_rank_ends_every_stream_with_an_error_and_marks_the_engine_dead(model_dirs):
    engine = AsyncEngine(
        EngineConfig(model=str(model_dirs["llama"]), tensor_parallel_size=2, num_kv_blocks=64)
    )
    await engine.start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        started = [asyncio.Event() for _ in range(3)]

        async def consume(prompt: list[int], event: asyncio.Event) -> None:
            async for _ in engine.generate(prompt, params):
                event.set()

        tasks = [asyncio.create_task(consume(p, e)) for p, e in zip(PROMPTS, started)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        (worker,) = worker_pids(engine.core_pid)
        killed_at = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert time.monotonic() - killed_at < 15
        assert not engine.healthy
    finally:
        await engine.stop()


def test_shutdown_returns_even_when_leaving_the_group_hangs(
    model_dirs, monkeypatch: pytest.MonkeyPatch
):
    """An NCCL teardown that waits on a peer (seen on 2 x H100) must not hang the engine's shutdown: leaving
    the group runs on a thread given a bounded time."""
    import threading

    from engine.worker import worker_group

    llm = LLM(model=str(model_dirs["llama"]), tensor_parallel_size=2, num_kv_blocks=16)
    leave = parallel_state.destroy_tensor_parallel
    stuck = threading.Event()
    monkeypatch.setattr(parallel_state, "destroy_tensor_parallel", lambda: stuck.wait(60))
    monkeypatch.setattr(worker_group, "_LEAVE_TIMEOUT_S", 0.5)
    start = time.monotonic()
    llm.shutdown()
    assert time.monotonic() - start < 15  # (the worker's own exit: well under its 10 s wait)
    assert not worker_pids(os.getpid())
    stuck.set()
    leave()  # (what the stuck teardown would have done: the next test's engine joins a new group)
