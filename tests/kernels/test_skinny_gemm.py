"""kernels/skinny_gemm.py (the decode matmul for M <= 32 rows, and its fused gate/up + SiLU-and-mul) against
kernels/reference.py.

On a machine without CUDA the kernel runs in Triton's CPU interpreter (``TRITON_INTERPRET=1``, set before triton
is imported), at small odd sizes: N = 48 and K = 80 are not multiples of the 32-wide tiles, and a split of K into
3 leaves the last split shorter. float32 is checked against the reference in float64 (relative error < 1e-6);
bfloat16 against the reference run in bfloat16 (one rounding of an fp32 sum, like the kernel's), to 1e-3: only
rare last-bit flips from a different summation order. Inputs are random (never zeros) and every buffer the kernel
allocates starts as NaN (``poisoned_empty``), so an output or a split-K partial left unwritten fails.

Two interpreter stand-ins for the GPU: float32 -> bfloat16 rounds to nearest even (the interpreter truncates),
and ``tl.dot`` on bfloat16 tiles multiplies their values (the interpreter multiplies their bit patterns as
integers).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

import triton.language as tl  # noqa: E402

from kernels import reference  # noqa: E402
from tests.interpreter_rounding import round_bfloat16_like_gpu  # noqa: E402
from kernels.activation import silu_and_mul  # noqa: E402
from kernels.skinny_gemm import (  # noqa: E402
    GEMM,
    SILU_AND_MUL,
    TABLE,
    SkinnyConfig,
    choose_config,
    heuristic_config,
    skinny_gemm,
    skinny_gemm_silu_and_mul,
)

DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")
# relative error ‖out − expected‖ / ‖expected‖
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 1e-3}
N, K = 48, 80
CONFIGS = {  # K = 80: five tiles of 16 (unmasked loads), or 2.5 tiles of 32 (the last one masked)
    "one-pass": SkinnyConfig(block_n=32, block_k=32),
    "split-k": SkinnyConfig(block_n=16, block_k=16, split_k=3),  # splits of 2, 2 and 1 tiles
    # the second split: the masked tile
    "split-k-ragged": SkinnyConfig(block_n=32, block_k=32, split_k=2),
}
pytestmark = pytest.mark.usefixtures("poisoned_empty")  # tests/conftest.py


@pytest.fixture(autouse=True)
def interpreter_like_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the interpreter: GPU rounding of float32 -> bfloat16, and bfloat16 dots on the values."""
    if DEVICE.type == "cuda":
        return
    from triton.runtime import interpreter

    round_bfloat16_like_gpu(monkeypatch)
    convert = interpreter._convert_float
    create_dot = interpreter.InterpreterBuilder.create_dot

    def bfloat16_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype == tl.bfloat16:
            a = interpreter.TensorHandle(
                convert(a.data, tl.bfloat16, tl.float32, None).view(np.float32), tl.float32
            )
            b = interpreter.TensorHandle(
                convert(b.data, tl.bfloat16, tl.float32, None).view(np.float32), tl.float32
            )
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", bfloat16_dot)


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def oracle(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.double() if dtype == torch.float32 else tensor.clone()


def assert_matches(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    out = out.cpu()
    assert not out.isnan().any(), "an element was left unwritten"
    error = float((out.double() - expected.double()).norm() / expected.double().norm())
    assert error < TOLERANCE[dtype], error


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 3, 16])
def test_skinny_gemm_matches_reference(m: int, dtype: torch.dtype, config: SkinnyConfig):
    x, weight = randn(m, K, dtype=dtype, seed=m), randn(N, K, dtype=dtype, seed=100 + m)
    expected = reference.skinny_gemm(oracle(x, dtype), oracle(weight, dtype))
    out = skinny_gemm(x.to(DEVICE), weight.to(DEVICE), config=config)
    assert out.shape == (m, N) and out.dtype == dtype
    assert_matches(out, expected, dtype)


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 3, 16])
def test_fused_gate_up_silu_and_mul_matches_reference(
    m: int, dtype: torch.dtype, config: SkinnyConfig
):
    x, weight = randn(m, K, dtype=dtype, seed=m), randn(2 * N, K, dtype=dtype, seed=200 + m) / 3
    expected = reference.skinny_gemm_silu_and_mul(oracle(x, dtype), oracle(weight, dtype))
    out = skinny_gemm_silu_and_mul(x.to(DEVICE), weight.to(DEVICE), config=config)
    assert out.shape == (m, N) and out.dtype == dtype
    assert_matches(out, expected, dtype)


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_fusing_silu_and_mul_changes_no_bit_of_the_unfused_pair(config: SkinnyConfig):
    """Same tiles, same sum order: the fused kernel rounds exactly as skinny_gemm then silu_and_mul do."""
    x = randn(5, K, dtype=torch.bfloat16, seed=1).to(DEVICE)
    weight = randn(2 * N, K, dtype=torch.bfloat16, seed=2).to(DEVICE)
    fused = skinny_gemm_silu_and_mul(x, weight, config=config)
    assert torch.equal(fused, silu_and_mul(skinny_gemm(x, weight, config=config)))


def test_out_is_written_in_place_through_its_row_stride():
    x, weight = randn(3, K, dtype=torch.float32, seed=3), randn(N, K, dtype=torch.float32, seed=4)
    buffer = randn(3, N + 8, dtype=torch.float32, seed=5).to(DEVICE)
    before = buffer.cpu().clone()
    out = buffer[:, :N]
    returned = skinny_gemm(x.to(DEVICE), weight.to(DEVICE), out, CONFIGS["split-k"])
    assert returned is out
    assert_matches(out, reference.skinny_gemm(x.double(), weight.double()), torch.float32)
    # the columns past N are not the output's
    assert torch.equal(buffer.cpu()[:, N:], before[:, N:])


def test_split_k_counters_are_left_zero_for_the_next_launch():
    """The in-launch merge re-arms its counters: a second call (other shape, same counters) is still right."""
    config = CONFIGS["split-k"]
    for m, n in [(2, N), (4, 2 * N)]:
        x, weight = (
            randn(m, K, dtype=torch.float32, seed=m),
            randn(n, K, dtype=torch.float32, seed=n),
        )
        out = skinny_gemm(x.to(DEVICE), weight.to(DEVICE), config=config)
        assert_matches(out, reference.skinny_gemm(x.double(), weight.double()), torch.float32)


def test_bad_arguments_are_refused_with_a_message():
    x, weight = randn(33, K, dtype=torch.float32, seed=1), randn(N, K, dtype=torch.float32, seed=2)
    with pytest.raises(ValueError, match="at most 32 rows"):
        skinny_gemm(x, weight)
    with pytest.raises(ValueError, match="share a dtype"):
        skinny_gemm(x[:2], weight.to(torch.bfloat16))
    with pytest.raises(ValueError, match="2 \\* intermediate"):
        skinny_gemm_silu_and_mul(x[:2], weight[:47])
    with pytest.raises(ValueError, match="block_k"):
        SkinnyConfig(block_k=48)
    with pytest.raises(ValueError, match="prefetch_k"):
        SkinnyConfig(prefetch_k=8)
    assert SkinnyConfig(prefetch_k=0).prefetch_k == 0  # no prefetch at all


def test_heuristic_splits_k_where_column_blocks_leave_sms_idle():
    """llama-3.2-1b on 132 SMs, 64-column blocks: K is split 132 // blocks ways (at most one wave), each split
    keeping >= 4 tiles of 128: qkv 48 blocks -> 2; o 32 blocks -> 4 (16 tiles of K: 4 each); down (K 8192) 32
    blocks -> 4; gate/up fused (8192 output columns, 128 blocks) and the output layer (2004 blocks) -> 1."""
    expected = {
        (3072, 2048, GEMM): 2,
        (2048, 2048, GEMM): 4,
        (2048, 8192, GEMM): 4,
        (16384, 2048, SILU_AND_MUL): 1,
        (128256, 2048, GEMM): 1,
    }
    for (n, k, op), split in expected.items():
        config = heuristic_config(1, n, k, op, sms=132)
        assert (config.block_n, config.block_k, config.split_k) == (64, 128, split), (n, k, op)
    # two tiles of K: too few to split
    assert heuristic_config(1, 2048, 256, GEMM, sms=132).split_k == 1


def test_measured_table_is_keyed_by_rows_rounded_up_to_a_power_of_two(
    monkeypatch: pytest.MonkeyPatch,
):
    measured = SkinnyConfig(block_n=128, block_k=256, split_k=2)
    monkeypatch.setitem(TABLE, (GEMM, 8, 3072, 2048), measured)
    assert choose_config(5, 3072, 2048, GEMM, torch.device("cpu")) is measured
    assert choose_config(9, 3072, 2048, GEMM, torch.device("cpu")) != measured


def test_references_are_the_textbook_formulas():
    x, weight = randn(3, 8, dtype=torch.float64, seed=1), randn(10, 8, dtype=torch.float64, seed=2)
    product = torch.einsum("mk,nk->mn", x, weight)
    torch.testing.assert_close(reference.skinny_gemm(x, weight), product)
    gate, up = product[:, :5], product[:, 5:]
    torch.testing.assert_close(
        reference.skinny_gemm_silu_and_mul(x, weight), gate / (1 + torch.exp(-gate)) * up
    )
    out = torch.empty(3, 5, dtype=torch.float64)
    assert reference.skinny_gemm_silu_and_mul(x, weight, out) is out


def test_the_engine_takes_the_skinny_kernel_only_on_a_measured_cuda_shape():
    """kernels/skinny_choice.py: CPU tensors never (whatever the shape); the table names plain or fused ops at
    power-of-two row counts up to MAX_ROWS only."""
    from kernels import skinny_choice

    x = torch.randn(4, 2048, dtype=torch.bfloat16)
    w = torch.randn(16384, 2048, dtype=torch.bfloat16)
    assert (skinny_choice.SILU_AND_MUL, 4, 16384, 2048) in skinny_choice.FASTER_THAN_CUBLAS
    assert not skinny_choice.prefer_skinny(skinny_choice.SILU_AND_MUL, x, w)
    for op, rows, n, k in skinny_choice.FASTER_THAN_CUBLAS:
        assert op in (skinny_choice.GEMM, skinny_choice.SILU_AND_MUL)
        assert rows == skinny_choice.row_bucket(rows) <= skinny_choice.MAX_ROWS and n > 0 and k > 0
    assert [skinny_choice.row_bucket(m) for m in (1, 2, 3, 5, 17, 32)] == [1, 2, 4, 8, 32, 32]
