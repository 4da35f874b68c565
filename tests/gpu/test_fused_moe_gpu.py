"""kernels/fused_moe.py on CUDA at Qwen3-30B-A3B's MoE layer (H = 2048, I = 768, E = 128, K = 8) against the
torch reference in float32 on the same device.

Batches of 1, 16, 256 and 2048 tokens cover the three launch configs of the heuristic (16-, 32- and 64-row
blocks). bf16 and fp16 must match to 1e-2 (the activation and each expert's output are rounded to 16 bits),
fp32 to 1e-5. The experts no token chose hold NaN weights, so reading one fails the test; the outputs start as
NaN (``poisoned_empty``). The layer has no host synchronisation: a CUDA graph captured once replays it for new
inputs, and two runs give the same bits although the align step orders the pairs of an expert by atomics.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernels compiled)"
    ),
    pytest.mark.usefixtures("poisoned_empty"),
]

triton = pytest.importorskip("triton", reason="triton is not installed")

from kernels import reference  # noqa: E402
from kernels.fused_moe import fused_moe  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8  # Qwen3-30B-A3B
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-5}


def layer(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w_gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen, device="cuda")
    w_down = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen, device="cuda")
    return (w_gate_up * HIDDEN**-0.5).to(dtype), (w_down * INTER**-0.5).to(dtype)


def inputs(
    tokens: int, dtype: torch.dtype, seed: int, hot: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden, weights, ids); ``hot``: the first ``hot`` experts' logits raised so far that every token picks
    among them (each gets many blocks of rows, the others none)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(tokens, EXPERTS, generator=gen, device="cuda")
    logits[:, :hot] += 100.0
    weights, ids = reference.route(logits, TOP_K)
    return torch.randn(tokens, HIDDEN, generator=gen, device="cuda").to(dtype), weights, ids


def unchosen_poisoned(w_gate_up: torch.Tensor, w_down: torch.Tensor, ids: torch.Tensor):
    unused = torch.ones(EXPERTS, dtype=torch.bool, device="cuda")
    unused[ids.long().flatten()] = False
    w_gate_up, w_down = w_gate_up.clone(), w_down.clone()
    w_gate_up[unused], w_down[unused] = float("nan"), float("nan")
    return w_gate_up, w_down


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return float((out.double() - expected.double()).norm() / expected.double().norm())


CASES = [
    (torch.bfloat16, 1, 0),
    (torch.bfloat16, 16, 0),
    (torch.bfloat16, 256, 0),
    (torch.bfloat16, 2048, 0),
    (torch.bfloat16, 2048, TOP_K),  # 8 hot experts: 2048 pairs each
    (torch.float16, 16, 0),
    (torch.float32, 16, 0),
]


@pytest.mark.parametrize(
    "dtype, tokens, hot", CASES, ids=[f"{d}-{t}{'-hot' if h else ''}" for d, t, h in CASES]
)
def test_qwen3_moe_layer_matches_the_float32_reference(dtype, tokens, hot):
    w_gate_up, w_down = layer(dtype, seed=tokens)
    hidden, weights, ids = inputs(tokens, dtype, seed=tokens + 1, hot=hot)
    expected = reference.fused_moe(hidden.float(), w_gate_up, w_down, weights, ids)
    w_gate_up, w_down = unchosen_poisoned(w_gate_up, w_down, ids)
    out = fused_moe(hidden, w_gate_up, w_down, weights, ids)
    assert out.dtype == dtype and out.shape == hidden.shape
    assert relative_error(out, expected) < TOLERANCE[dtype]


def test_two_runs_give_the_same_bits():
    w_gate_up, w_down = layer(torch.bfloat16, seed=3)
    hidden, weights, ids = inputs(256, torch.bfloat16, seed=4)
    first = fused_moe(hidden, w_gate_up, w_down, weights, ids)
    assert torch.equal(first, fused_moe(hidden, w_gate_up, w_down, weights, ids))


def test_a_cuda_graph_replays_the_layer_for_new_inputs():
    w_gate_up, w_down = layer(torch.bfloat16, seed=5)
    hidden, weights, ids = inputs(16, torch.bfloat16, seed=6)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up off the capture
        fused_moe(hidden, w_gate_up, w_down, weights, ids)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(hidden, w_gate_up, w_down, weights, ids)
    new_hidden, new_weights, new_ids = inputs(16, torch.bfloat16, seed=7)
    for static, new in ((hidden, new_hidden), (weights, new_weights), (ids, new_ids)):
        static.copy_(new)
    graph.replay()
    expected = reference.fused_moe(new_hidden.float(), w_gate_up, w_down, new_weights, new_ids)
    assert relative_error(out, expected) < TOLERANCE[torch.bfloat16]
