"""The persistent decode kernel (kernels/persistent_decode.py) on a GPU, at llama-3.2-1b's shapes in bfloat16:
one launch of all 16 layers, one program per SM meeting at grid-wide barriers, against the engine's layer path
(benchmarks/persistent_decode.py's, the engine's own kernels launch by launch) and against the torch reference.
It must repeat itself bit for bit (greedy output never depends on timing) and run inside a CUDA graph.
tests/kernels/test_persistent_decode.py (float32 and float16 at small shapes) runs here too, with every SM."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)"
)

pytest.importorskip("triton", reason="triton is not installed")

from benchmarks.persistent_decode import (  # noqa: E402
    EPS,
    HEAD_DIM,
    HIDDEN,
    graph_ms,
    layer_path,
    make_batch,
    make_stack,
    persistent_path,
    rotary,
)
from kernels import reference  # noqa: E402
from kernels.persistent_decode import PersistentConfig  # noqa: E402

DEVICE = torch.device("cuda")


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("rows", [1, 5, 16])
def test_the_kernel_agrees_with_the_layer_path_and_repeats_itself(rows: int) -> None:
    stack, final_norm = make_stack(DEVICE, rows * 40 + 1)
    cos, sin = rotary(DEVICE, 4096)
    meta = make_batch(rows, 600, 4096, DEVICE)
    h = torch.randn(rows, HIDDEN, device=DEVICE).to(torch.bfloat16)
    want = layer_path(h, stack, final_norm, meta, cos, sin).clone()
    config = PersistentConfig()
    got = persistent_path(h, stack, final_norm, meta, cos, sin, config).clone()
    # the same math as the launches, sums of squares in another order: bf16's last bits
    assert relative_error(got, want) < 2e-2
    assert torch.equal(persistent_path(h, stack, final_norm, meta, cos, sin, config), got)
    # the torch reference (SDPA attention, cuBLAS matmuls) from the same stream
    stream = h.clone()
    ref_stack, _ = make_stack(DEVICE, rows * 40 + 1)
    reference.persistent_decode(stream, ref_stack, *meta.values(), cos, sin, HEAD_DIM**-0.5)
    assert relative_error(got, reference.rms_norm(stream, final_norm, EPS)) < 3e-2


def test_the_kernel_replays_from_a_cuda_graph() -> None:
    stack, final_norm = make_stack(DEVICE, 4 * 40 + 1)
    cos, sin = rotary(DEVICE, 4096)
    meta = make_batch(4, 300, 4096, DEVICE)
    h = torch.randn(4, HIDDEN, device=DEVICE).to(torch.bfloat16)
    config = PersistentConfig()
    eager = persistent_path(h, stack, final_norm, meta, cos, sin, config).clone()
    _, replayed = graph_ms(lambda: persistent_path(h, stack, final_norm, meta, cos, sin, config), 3)
    assert torch.equal(replayed, eager)
