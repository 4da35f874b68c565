"""benchmarks/kernel/batch_gemm.py and the read ceiling (benchmarks/harness/read_ceiling.py): the kernels the benchmarks time compute what they
claim, so a timing is of a correct kernel. On a machine without CUDA they run in Triton's interpreter, float16 (the
interpreter's bfloat16 through tensor descriptors gives garbage; the benchmark checks bf16 on the device before it
times anything)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

from benchmarks.kernel.batch_gemm import triton_gemm  # noqa: E402
from benchmarks.harness.read_ceiling import ReadStream  # noqa: E402

DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")
DTYPE = torch.float16


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "silu_mul"])
@pytest.mark.parametrize(
    "persistent, split_k",
    [(False, 1), (True, 1), (False, 2), (False, 4)],
    ids=["tiles", "persistent", "split2", "split4"],
)
def test_triton_gemm_matches_torch(fused: bool, persistent: bool, split_k: int) -> None:
    gen = torch.Generator().manual_seed(3)
    m, n, k = 128, 256, 512
    x = torch.randn(m, k, generator=gen).to(DTYPE).to(DEVICE)
    weight = (torch.randn(n, k, generator=gen) * 0.05).to(DTYPE).to(DEVICE)
    out_n = n // 2 if fused else n
    out = torch.full((m, out_n), float("nan"), dtype=DTYPE, device=DEVICE)
    scratch = (
        torch.empty(split_k * m * n, dtype=torch.float32, device=DEVICE),
        torch.zeros(64, dtype=torch.int32, device=DEVICE),
    )
    # 64 x 64 tiles: 2 x (2 or 4) tiles, so the tile order, the persistent loop (3 programs) and every split count
    triton_gemm(x, weight, out, (64, 64, 64, 4, 3, 8), fused, persistent, 3, split_k, scratch)
    ref = F.linear(x.float(), weight.float())
    if fused:
        ref = F.silu(ref[:, :out_n]) * ref[:, out_n:]
    assert not out.isnan().any()
    assert relative_error(out, ref) < 2e-3
    assert int(scratch[1].abs().sum()) == 0  # the last program of each tile re-armed its counter


def test_read_kernel_sums_every_element_once() -> None:
    gen = torch.Generator().manual_seed(4)
    n, chunk = 3 * 4096 + 100, 8192  # the last program's chunk is partly past the end (masked)
    src = torch.randn(n, generator=gen).to(torch.bfloat16).to(DEVICE)
    programs = -(-n // chunk)
    read = ReadStream(src, chunk)
    read.sums.fill_(float("nan"))
    read()
    out = read.sums
    expected = torch.stack(
        [src[i * chunk : (i + 1) * chunk].float().sum() for i in range(programs)]
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-3)
