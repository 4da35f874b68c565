"""The fused layer kernels (RMSNorm + residual, in-place rotary, SiLU-and-mul) compiled on CUDA at real sizes:
T=256, hidden 2048, Llama-like 32/8 heads of 64 and Qwen3-like 16/8 heads of 128 with q/k norm.

float32 is checked against the reference in float64 (relative error < 1e-6); bfloat16 against the reference
run in bfloat16 on the same GPU, which rounds in the same order, so only rare last-bit flips (a reduction or
exp computed differently) are allowed: relative error < 1e-3. Fresh outputs start as NaN.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)"
    ),
    pytest.mark.usefixtures("poisoned_empty"),  # tests/conftest.py
]

triton = pytest.importorskip("triton", reason="triton is not installed")

from kernels import reference  # noqa: E402
from kernels.activation import silu_and_mul  # noqa: E402
from kernels.rms_norm import rms_norm  # noqa: E402
from kernels.rotary import rotary_embedding  # noqa: E402

DTYPES = [torch.bfloat16, torch.float32]
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 1e-3}
TOKENS, HIDDEN, INTERMEDIATE, EPS, MAX_POSITION = 256, 2048, 5632, 1e-6, 4096
HEAD_LAYOUTS = [(32, 8, 64), (16, 8, 128)]  # (heads, kv_heads, head_dim): Llama-like, Qwen3-like


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(
        *shape, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda"
    ).to(dtype)


def oracle(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.double() if dtype == torch.float32 else tensor.clone()


def assert_matches(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any(), "an element was left unwritten"
    error = float((out.double() - expected.double()).norm() / expected.double().norm())
    assert error < TOLERANCE[dtype], error


def assert_rotated(
    out: torch.Tensor,
    torch_out: torch.Tensor,
    positions: torch.Tensor,
    x: torch.Tensor,
    other: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    dtype: torch.dtype,
) -> None:
    """Rotary in bf16: rounding the products and the sum in a kernel cannot follow torch's CUDA op order bit for
    bit (measured: ~1 ulp on a third of the elements), so the kernel must be as close to the float64 truth as
    torch's own bf16 path (``torch_out``), within 10%. In float32: the float64 reference within 1e-6."""
    if dtype == torch.float32:
        assert_matches(out, torch_out, dtype)
        return
    truth, other_truth = x.double(), other.double()
    reference.rotary_embedding(
        positions, truth, other_truth, cos_cache.double(), sin_cache.double()
    )
    assert_as_accurate_as_torch(out, torch_out, truth)


def assert_as_accurate_as_torch(
    out: torch.Tensor, torch_out: torch.Tensor, truth: torch.Tensor
) -> None:
    """bf16 chains whose rounding order differs from torch's: the kernel's distance to the float64 truth is at
    most 1.1x that of torch's own bf16 result."""
    assert not out.isnan().any(), "an element was left unwritten"
    error = float((out.double() - truth).norm() / truth.norm())
    torch_error = float((torch_out.double() - truth).norm() / truth.norm())
    assert error <= 1.1 * torch_error + 1e-6, (error, torch_error)


def rope_caches(head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim))
    freqs = torch.outer(torch.arange(MAX_POSITION, device="cuda").float(), inv_freq)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def fused_qkv(
    heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    qkv = randn(TOKENS, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=seed)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return (
        qkv,
        q.view(TOKENS, heads, head_dim),
        k.view(TOKENS, kv_heads, head_dim),
        v.view(TOKENS, kv_heads, head_dim),
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_matches_reference(dtype: torch.dtype):
    x, weight = randn(TOKENS, HIDDEN, dtype=dtype, seed=1), randn(HIDDEN, dtype=dtype, seed=2)
    expected = reference.rms_norm(oracle(x, dtype), oracle(weight, dtype), EPS)
    assert_matches(rms_norm(x, weight, EPS), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_with_residual_writes_the_sum_into_residual_and_matches_reference(
    dtype: torch.dtype,
):
    x, residual = (
        randn(TOKENS, HIDDEN, dtype=dtype, seed=3),
        randn(TOKENS, HIDDEN, dtype=dtype, seed=4),
    )
    weight = randn(HIDDEN, dtype=dtype, seed=5)
    expected_sum = x + residual
    expected, _ = reference.rms_norm(
        oracle(x, dtype), oracle(weight, dtype), EPS, oracle(residual, dtype)
    )
    out, new_residual = rms_norm(x, weight, EPS, residual)
    # one rounding, as torch's add
    assert new_residual is residual and torch.equal(residual, expected_sum)
    assert_matches(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "heads, kv_heads, head_dim", HEAD_LAYOUTS, ids=["llama-32x64", "qwen3-16x128"]
)
def test_rotary_rotates_strided_q_and_k_in_place_like_reference(
    heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
):
    cos_cache, sin_cache = rope_caches(head_dim, dtype)
    positions = torch.randperm(MAX_POSITION, device="cuda")[:TOKENS].to(torch.int32)
    _, q, k, v = fused_qkv(heads, kv_heads, head_dim, dtype, seed=head_dim)
    q_before, k_before, v_before = q.clone(), k.clone(), v.clone()
    expected_q, expected_k = oracle(q, dtype), oracle(k, dtype)
    reference.rotary_embedding(
        positions, expected_q, expected_k, oracle(cos_cache, dtype), oracle(sin_cache, dtype)
    )
    rotary_embedding(positions, q, k, cos_cache, sin_cache)
    assert_rotated(q, expected_q, positions, q_before, k_before, cos_cache, sin_cache, dtype)
    assert_rotated(k, expected_k, positions, k_before, q_before, cos_cache, sin_cache, dtype)
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_qwen3_qk_norm_then_rotary_on_strided_views_matches_reference(dtype: torch.dtype):
    heads, kv_heads, head_dim = HEAD_LAYOUTS[1]
    cos_cache, sin_cache = rope_caches(head_dim, dtype)
    positions = torch.arange(TOKENS, device="cuda")
    _, q, k, _ = fused_qkv(heads, kv_heads, head_dim, dtype, seed=7)
    q_weight, k_weight = randn(head_dim, dtype=dtype, seed=8), randn(head_dim, dtype=dtype, seed=9)
    expected_q = reference.rms_norm(oracle(q, dtype), oracle(q_weight, dtype), EPS)
    expected_k = reference.rms_norm(oracle(k, dtype), oracle(k_weight, dtype), EPS)
    reference.rotary_embedding(
        positions, expected_q, expected_k, oracle(cos_cache, dtype), oracle(sin_cache, dtype)
    )
    normed_q, normed_k = rms_norm(q, q_weight, EPS), rms_norm(k, k_weight, EPS)
    rotary_embedding(positions, normed_q, normed_k, cos_cache, sin_cache)
    if dtype == torch.float32:
        assert_matches(normed_q, expected_q, dtype)
        assert_matches(normed_k, expected_k, dtype)
        return
    truth_q = reference.rms_norm(q.double(), q_weight.double(), EPS)
    truth_k = reference.rms_norm(k.double(), k_weight.double(), EPS)
    reference.rotary_embedding(positions, truth_q, truth_k, cos_cache.double(), sin_cache.double())
    assert_as_accurate_as_torch(normed_q, expected_q, truth_q)
    assert_as_accurate_as_torch(normed_k, expected_k, truth_k)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_matches_reference(dtype: torch.dtype):
    gate_up = randn(TOKENS, 2 * INTERMEDIATE, dtype=dtype, seed=10) * 3
    expected = reference.silu_and_mul(oracle(gate_up, dtype))
    assert_matches(silu_and_mul(gate_up), expected, dtype)


def test_fused_kernels_replay_in_a_cuda_graph_on_new_inputs():
    """Captured once, replayed on fresh data: no host reads of device values, no launch-time decisions."""
    dtype, (heads, kv_heads, head_dim) = torch.bfloat16, HEAD_LAYOUTS[0]
    cos_cache, sin_cache = rope_caches(head_dim, dtype)
    x, residual = (
        randn(TOKENS, HIDDEN, dtype=dtype, seed=11),
        randn(TOKENS, HIDDEN, dtype=dtype, seed=12),
    )
    weight, gate_up = (
        randn(HIDDEN, dtype=dtype, seed=13),
        randn(TOKENS, 2 * INTERMEDIATE, dtype=dtype, seed=14),
    )
    qkv, q, k, _ = fused_qkv(heads, kv_heads, head_dim, dtype, seed=15)
    positions = torch.zeros(TOKENS, dtype=torch.int64, device="cuda")

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        out, _ = rms_norm(x, weight, EPS, residual)
        rotary_embedding(positions, q, k, cos_cache, sin_cache)
        return out, silu_and_mul(gate_up)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, activated = step()

    for seed in (20, 30):
        for static, fresh_seed in (
            (x, seed),
            (residual, seed + 1),
            (gate_up, seed + 2),
            (qkv, seed + 3),
        ):
            static.copy_(randn(*static.shape, dtype=dtype, seed=fresh_seed))
        positions.copy_(torch.randperm(MAX_POSITION, device="cuda")[:TOKENS])
        expected_out, expected_sum = reference.rms_norm(x.clone(), weight, EPS, residual.clone())
        q_before, k_before = q.clone(), k.clone()
        expected_q, expected_k = q.clone(), k.clone()
        reference.rotary_embedding(positions, expected_q, expected_k, cos_cache, sin_cache)
        expected_activated = reference.silu_and_mul(gate_up)
        graph.replay()
        assert torch.equal(residual, expected_sum)
        for got, expected in ((out, expected_out), (activated, expected_activated)):
            assert_matches(got, expected, dtype)
        assert_rotated(q, expected_q, positions, q_before, k_before, cos_cache, sin_cache, dtype)
        assert_rotated(k, expected_k, positions, k_before, q_before, cos_cache, sin_cache, dtype)
