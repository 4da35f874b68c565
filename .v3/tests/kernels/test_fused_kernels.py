"""The fused layer kernels (kernels/rms_norm.py, rotary.py, activation.py) against their torch references.

On a machine without CUDA they run in Triton's CPU interpreter (``TRITON_INTERPRET=1``, set before triton is
imported), at small odd sizes; tests/gpu/test_fused_kernels_gpu.py runs them compiled at real sizes. Inputs
are random (never zeros); every buffer a kernel allocates starts as NaN (``torch.empty`` is poisoned), so an
element left unwritten fails. float32 is checked against the reference in float64 (relative error < 1e-6);
bfloat16 against the reference in bfloat16, which rounds in the same order, to 1e-3 (only rare last-bit flips
from a reduction or exp computed differently). Triton's interpreter rounds float32 to bfloat16 by truncation
where a GPU rounds to nearest even (like torch); ``gpu_bfloat16_rounding`` makes it round like the GPU, or
every bfloat16 result would be off by ~0.7% and rounding-order mistakes would hide below that.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

from kernels import reference  # noqa: E402
from tests.interpreter_rounding import round_bfloat16_like_gpu  # noqa: E402
from kernels.activation import silu_and_mul  # noqa: E402
from kernels.rms_norm import rms_norm  # noqa: E402
from kernels.rotary import rotary_embedding  # noqa: E402

DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")
DTYPES = [torch.float32, torch.bfloat16]
TOKENS = [1, 7, 33]
pytestmark = pytest.mark.usefixtures("poisoned_empty")  # tests/conftest.py

EPS = 1e-6
# relative error ‖out − expected‖ / ‖expected‖
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 1e-3}


@pytest.fixture(autouse=True)
def gpu_bfloat16_rounding(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the interpreter: float32 -> bfloat16 rounds to nearest even (through torch), as on a GPU."""
    if DEVICE.type == "cuda":
        return
    round_bfloat16_like_gpu(monkeypatch)


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def assert_matches(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """float32: ``expected`` is the float64 oracle; bfloat16: the reference run in bfloat16 itself."""
    out = out.cpu()
    assert not out.isnan().any(), "an element was left unwritten"
    error = float((out.double() - expected.double()).norm() / expected.double().norm())
    assert error < TOLERANCE[dtype], error


def oracle(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.double() if dtype == torch.float32 else tensor.clone()


def fused_qkv(
    tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(qkv, q, k, v)``: q/k/v are the strided views the attention layer makes of one qkv matmul output."""
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=seed).to(DEVICE)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return (
        qkv,
        q.view(tokens, heads, head_dim),
        k.view(tokens, kv_heads, head_dim),
        v.view(tokens, kv_heads, head_dim),
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [96, 576])
@pytest.mark.parametrize("tokens", TOKENS)
def test_rms_norm_matches_reference(tokens: int, hidden: int, dtype: torch.dtype):
    x, weight = (
        randn(tokens, hidden, dtype=dtype, seed=tokens),
        randn(hidden, dtype=dtype, seed=hidden),
    )
    expected = reference.rms_norm(oracle(x, dtype), oracle(weight, dtype), EPS)
    out = rms_norm(x.to(DEVICE), weight.to(DEVICE), EPS)
    assert out.shape == x.shape and out.dtype == dtype
    assert_matches(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", TOKENS)
def test_rms_norm_with_residual_writes_the_sum_into_residual_and_matches_reference(
    tokens: int, dtype: torch.dtype
):
    hidden = 576
    x, residual = (
        randn(tokens, hidden, dtype=dtype, seed=1),
        randn(tokens, hidden, dtype=dtype, seed=2),
    )
    weight = randn(hidden, dtype=dtype, seed=3)
    expected_sum = x + residual  # the rounded sum in the model dtype, as torch computes it
    expected, _ = reference.rms_norm(
        oracle(x, dtype), oracle(weight, dtype), EPS, oracle(residual, dtype)
    )
    device_x, device_residual = x.to(DEVICE), residual.to(DEVICE)
    out, new_residual = rms_norm(device_x, weight.to(DEVICE), EPS, device_residual)
    assert new_residual is device_residual
    assert torch.equal(device_residual.cpu(), expected_sum)  # one rounding, as torch's add
    assert torch.equal(device_x.cpu(), x)  # x is only read
    assert_matches(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("tokens", TOKENS)
def test_rms_norm_per_head_on_strided_qkv_views_matches_reference(
    tokens: int, head_dim: int, dtype: torch.dtype
):
    """Qwen3's q/k norm: ``[T, heads, head_dim]`` views of the fused qkv output, normalized per head."""
    qkv, q, k, _ = fused_qkv(tokens, 4, 2, head_dim, dtype, seed=head_dim + tokens)
    before = qkv.cpu().clone()
    weight = randn(head_dim, dtype=dtype, seed=head_dim)
    for view in (q, k):
        expected = reference.rms_norm(oracle(view.cpu(), dtype), oracle(weight, dtype), EPS)
        out = rms_norm(view, weight.to(DEVICE), EPS)
        assert out.shape == view.shape
        assert_matches(out, expected, dtype)
    assert torch.equal(qkv.cpu(), before)  # out of place: the qkv output is untouched


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("positions_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("tokens", TOKENS)
def test_rotary_rotates_strided_q_and_k_in_place_like_reference(
    tokens: int, head_dim: int, positions_dtype: torch.dtype, dtype: torch.dtype
):
    max_position = 300
    angles = (
        torch.rand(max_position, head_dim // 2, generator=torch.Generator().manual_seed(0)) * 50
    )
    # first half == second half, as the layer's
    cos_cache = torch.cat((angles, angles), dim=-1).cos().to(dtype)
    sin_cache = torch.cat((angles, angles), dim=-1).sin().to(dtype)
    positions = torch.randperm(max_position, generator=torch.Generator().manual_seed(tokens))[
        :tokens
    ]
    positions = positions.to(positions_dtype)
    qkv, q, k, v = fused_qkv(tokens, 6, 2, head_dim, dtype, seed=tokens + head_dim)
    expected_q, expected_k = oracle(q.cpu(), dtype), oracle(k.cpu(), dtype)
    reference.rotary_embedding(
        positions, expected_q, expected_k, oracle(cos_cache, dtype), oracle(sin_cache, dtype)
    )
    v_before = v.cpu().clone()
    rotary_embedding(positions.to(DEVICE), q, k, cos_cache.to(DEVICE), sin_cache.to(DEVICE))
    assert_matches(q, expected_q, dtype)
    assert_matches(k, expected_k, dtype)
    # v shares the rows: the kernel writes only inside q and k
    assert torch.equal(v.cpu(), v_before)


def test_rotary_reference_rotates_in_place_like_the_rotate_half_formula():
    """The reference's in-place contract against the textbook formula, written out per half."""
    q, k = randn(5, 3, 8, dtype=torch.float64, seed=1), randn(5, 1, 8, dtype=torch.float64, seed=2)
    angles = torch.rand(10, 4, dtype=torch.float64)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    positions = torch.tensor([9, 0, 3, 3, 7])
    c, s = angles[positions].cos()[:, None], angles[positions].sin()[:, None]
    expected = [
        torch.cat((x[..., :4] * c - x[..., 4:] * s, x[..., 4:] * c + x[..., :4] * s), -1)
        for x in (q, k)
    ]
    reference.rotary_embedding(positions, q, k, cos, sin)
    torch.testing.assert_close(q, expected[0])
    torch.testing.assert_close(k, expected[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("intermediate", [96, 1100])
@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_and_mul_matches_reference(tokens: int, intermediate: int, dtype: torch.dtype):
    # silu's curved part and both tails
    gate_up = randn(tokens, 2 * intermediate, dtype=dtype, seed=tokens) * 3
    expected = reference.silu_and_mul(oracle(gate_up, dtype))
    out = silu_and_mul(gate_up.to(DEVICE))
    assert out.shape == (tokens, intermediate) and out.dtype == dtype
    assert_matches(out, expected, dtype)
