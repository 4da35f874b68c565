"""An FP8 KV cache on CUDA (float8 e4m3: compute capability 8.9+): the Triton kernels at real sizes with bfloat16
queries against the torch reference in float64 on caches de-quantized by hand, ``store_kv``'s bytes equal to torch's
own conversion, the engine (CUDA graphs, swap, the host tier, prefix hits) agreeing with a roomy FP8 engine's
tokens, and twice the blocks of bfloat16 for the same memory."""

from __future__ import annotations

import gc
import random

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)"
    ),
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
        reason="e4m3 needs compute capability 8.9+ (Ada, Hopper)",
    ),
]

pytest.importorskip("triton", reason="triton is not installed")

from engine.llm import LLM  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from kernels import reference  # noqa: E402
from kernels.cache_ops import store_kv  # noqa: E402
from kernels.contiguous_attention import (  # noqa: E402
    contiguous_decode_attention,
    contiguous_prefill_attention,
)
from kernels.paged_attention import paged_attention  # noqa: E402
from kernels.prefill_attention import prefill_attention  # noqa: E402
from tests.block_invariants import run_checked_outputs  # noqa: E402
from tests.greedy_agreement import assert_agree  # noqa: E402

FP8 = torch.float8_e4m3fn
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
K_SCALE, V_SCALE = 0.37, 2.5


def fp8_paged(lengths: list[int], block_size: int, seed: int):
    """(k, v, tables, lens, unused): random e4m3 caches of a few units, blocks randomly permuted."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    needed = [-(-n // block_size) for n in lengths]
    num_blocks = sum(needed) + 5
    shape = (num_blocks, block_size, KV_HEADS, HEAD_DIM)
    k = (torch.randn(shape, generator=gen, device="cuda") * 4).to(FP8)
    v = (torch.randn(shape, generator=gen, device="cuda") * 4).to(FP8)
    order = torch.randperm(num_blocks, generator=gen, device="cuda").tolist()
    tables = torch.zeros(len(lengths), max(needed), dtype=torch.int32)
    used = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for b, (n, count) in enumerate(zip(lengths, needed)):
        tables[b, :count] = torch.tensor([order.pop() for _ in range(count)])
        for p in range(n):
            used[tables[b, p // block_size] * block_size + p % block_size] = True
    return (
        k,
        v,
        tables.cuda(),
        torch.tensor(lengths, dtype=torch.int32, device="cuda"),
        ~used.cuda(),
    )


def poisoned(cache: torch.Tensor, unused: torch.Tensor) -> torch.Tensor:
    out = cache.view(torch.uint8).clone()
    out.view(-1, *cache.shape[2:])[unused] = 0x7F  # e4m3 NaN
    return out.view(FP8)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def test_store_kv_writes_the_bytes_of_torchs_own_conversion():
    gen = torch.Generator(device="cuda").manual_seed(0)
    key = (
        torch.randn(300, KV_HEADS, HEAD_DIM, generator=gen, device="cuda")
        * torch.logspace(-4, 3, 300, device="cuda")[:, None, None]
    ).bfloat16()
    value = torch.randn(300, KV_HEADS, HEAD_DIM, generator=gen, device="cuda").bfloat16() * 30
    slots = torch.randperm(40 * 16, generator=gen, device="cuda")[:300]
    slots[::9] = -1
    caches = [torch.zeros(40, 16, KV_HEADS, HEAD_DIM, dtype=FP8, device="cuda") for _ in range(4)]
    reference.store_kv(key, value, caches[0], caches[1], slots, K_SCALE, V_SCALE)
    store_kv(key, value, caches[2], caches[3], slots, K_SCALE, V_SCALE)
    assert torch.equal(caches[2].view(torch.uint8), caches[0].view(torch.uint8))
    assert torch.equal(caches[3].view(torch.uint8), caches[1].view(torch.uint8))


@pytest.mark.parametrize("split", [False, True], ids=["one-pass", "split-k"])
@pytest.mark.parametrize("block_size", [16, 128])
def test_decode_reads_fp8_with_bfloat16_queries(block_size, split):
    k, v, tables, lens, unused = fp8_paged([1, 100, 3000, 777], block_size, block_size)
    query = torch.randn(4, HEADS, HEAD_DIM, device="cuda")
    expected = torch.empty(query.shape, dtype=torch.float64, device="cuda")
    reference.paged_attention(
        expected,
        query.double(),
        k.double() * K_SCALE,
        v.double() * V_SCALE,
        tables,
        lens,
        HEAD_DIM**-0.5,
    )
    out = torch.full(query.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    paged_attention(
        out,
        query.bfloat16(),
        poisoned(k, unused),
        poisoned(v, unused),
        tables,
        lens,
        HEAD_DIM**-0.5,
        K_SCALE,
        V_SCALE,
        split=split,
    )
    assert relative_error(out, expected) < 1e-2


def test_prefill_with_cached_prefixes_reads_fp8_with_bfloat16_queries():
    cases = [(0, 1000), (512, 100), (64, 1), (0, 37)]
    k, v, tables, lens, unused = fp8_paged([c + n for c, n in cases], 16, 1)
    cu = torch.tensor([0] + [n for _, n in cases], device="cuda").cumsum(0).to(torch.int32)
    query = torch.randn(int(cu[-1]), HEADS, HEAD_DIM, device="cuda")
    expected = torch.empty(query.shape, dtype=torch.float64, device="cuda")
    reference.prefill_attention(
        expected,
        query.double(),
        k.double() * K_SCALE,
        v.double() * V_SCALE,
        tables,
        cu,
        lens,
        HEAD_DIM**-0.5,
    )
    out = torch.full(query.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    prefill_attention(
        out,
        query.bfloat16(),
        poisoned(k, unused),
        poisoned(v, unused),
        tables,
        cu,
        lens,
        HEAD_DIM**-0.5,
        K_SCALE,
        V_SCALE,
    )
    assert relative_error(out, expected) < 1e-2


def test_contiguous_decode_and_prefill_read_fp8_with_bfloat16_queries():
    gen = torch.Generator(device="cuda").manual_seed(2)
    k, v = (
        (torch.randn(6, 2048, KV_HEADS, HEAD_DIM, generator=gen, device="cuda") * 4).to(FP8)
        for _ in range(2)
    )
    slots, lens = (
        torch.tensor([4, 1], dtype=torch.int32, device="cuda"),
        torch.tensor([2000, 300], device="cuda"),
    )
    lens = lens.to(torch.int32)
    clean = (k.double() * K_SCALE, v.double() * V_SCALE)
    query = torch.randn(2, HEADS, HEAD_DIM, device="cuda")
    expected = torch.empty(query.shape, dtype=torch.float64, device="cuda")
    reference.contiguous_decode_attention(
        expected, query.double(), *clean, slots, lens, HEAD_DIM**-0.5, 2000
    )
    out = torch.full(query.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    contiguous_decode_attention(
        out, query.bfloat16(), k, v, slots, lens, HEAD_DIM**-0.5, 2000, K_SCALE, V_SCALE
    )
    assert relative_error(out, expected) < 1e-2
    # 50 new after 1950 cached; a whole prompt
    cu = torch.tensor([0, 50, 350], dtype=torch.int32, device="cuda")
    query = torch.randn(350, HEADS, HEAD_DIM, device="cuda")
    expected = torch.empty(query.shape, dtype=torch.float64, device="cuda")
    reference.contiguous_prefill_attention(
        expected, query.double(), *clean, slots, cu, lens, HEAD_DIM**-0.5
    )
    out = torch.full(query.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    contiguous_prefill_attention(
        out, query.bfloat16(), k, v, slots, cu, lens, HEAD_DIM**-0.5, K_SCALE, V_SCALE
    )
    assert relative_error(out, expected) < 1e-2


GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=5)
# Float32 weights, yet an FP8 cache is not batch-invariant: a float32 matmul over a batch of another size moves a
# K or V value by an ulp or so, which a float cache carries on unchanged (the float32 run of this test equals the
# roomy engine token for token, H100, 2026-11-27), while e4m3 rounding now and then turns it into a 2^-4 step of
# a stored value. The logits move by far less than their spread, but dummy weights leave near-ties between the
# top two tokens, and a greedy sequence parts where one tips (one of the tight engine's sequences after 7 tokens,
# with or without split-K). So a swapped, preempted or prefix-hit FP8 sequence is held to the roomy engine's
# logprobs until it parts, and may part only at a near-tie of the roomy engine's two best tokens, for the second;
# a wrong block would move logits by their spread. Swaps and copies move FP8 bytes exactly
# (tests/kernels/test_kv_fp8_kernels.py); the pool's accounting is checked after every step.
NEAR_TIE = 0.05  # nats between the roomy engine's two best tokens
LOGPROB_DRIFT = 0.05  # nats, the sampled tokens' logprobs before the sequences part
BASE = dict(
    load_format="dummy",
    model_config="llama-3.2-1b",
    dtype="float32",
    device="cuda",
    max_model_len=512,
    kv_cache_dtype="fp8",
)


def generate_checked(llm: LLM, batch: list[list[int]]) -> list:
    return run_checked_outputs(llm.engine, batch, GREEDY)


def test_fp8_engine_with_graphs_swap_and_prefix_hits_gives_its_own_tokens():
    torch.backends.cuda.matmul.allow_tf32 = False
    rng = random.Random(3)
    batch = [[rng.randrange(10000) for _ in range(n)] for n in (40, 90, 130, 75, 60, 110)]
    follow_up = batch[1] + [rng.randrange(10000) for _ in range(20)]
    roomy = LLM(num_kv_blocks=512, enforce_eager=True, enable_prefix_caching=False, **BASE)
    assert roomy.engine.runner.k_caches.dtype == FP8
    expected = generate_checked(roomy, batch + [follow_up])
    roomy.shutdown()
    del roomy
    tight = LLM(
        num_kv_blocks=24, preemption_mode="swap", swap_space_gib=0.5, host_cache_gib=0.25, **BASE
    )
    try:
        got = generate_checked(tight, batch)
        assert tight.engine.scheduler.num_swap_outs > 0, "the pool was meant to force swapping"
        got += generate_checked(tight, [follow_up])
        assert tight.engine.stats().prefix_hits > 0
        assert sum(tight.engine.runner.decode_graphs.padded_steps.values()) > 0, (
            "decode steps were meant to replay CUDA graphs"
        )
    # (the engine's GPU memory goes with it, also when an assertion failed: the next test sizes a
    # pool)
    finally:
        tight.shutdown()
        del tight
    assert_agree(got, expected, LOGPROB_DRIFT, NEAR_TIE)


def test_fp8_pool_holds_twice_the_bfloat16_blocks_for_the_same_memory():
    blocks = {}
    gc.collect()
    torch.cuda.empty_cache()
    for dtype in ("auto", "fp8"):
        llm = LLM(
            load_format="dummy",
            model_config="llama-3.2-1b",
            device="cuda",
            gpu_memory_utilization=0.5,
            max_model_len=2048,
            kv_cache_dtype=dtype,
            enforce_eager=True,
        )
        blocks[dtype] = (llm.engine.stats().num_blocks, llm.engine.runner.bytes_per_block)
        assert len(llm.generate([[1, 2, 3, 4, 5]], GREEDY)[0].token_ids) == 48
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert blocks["auto"][1] == 2 * blocks["fp8"][1]
    assert 1.95 <= blocks["fp8"][0] / blocks["auto"][0] <= 2.05, blocks
