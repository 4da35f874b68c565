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

from benchmarks.kernel.persistent_decode import (  # noqa: E402
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
    assert torch.equal(persistent_path(h, stack, final_norm, meta, cos, sin, config), got)
    # the torch reference (SDPA attention, cuBLAS matmuls) from the same stream: the kernel (its norms'
    # 1/rms applied to the projections' sums, one rounding moved) is no further from it than the launches
    stream = h.clone()
    ref_stack, _ = make_stack(DEVICE, rows * 40 + 1)
    reference.persistent_decode(stream, ref_stack, *meta.values(), cos, sin, HEAD_DIM**-0.5)
    exact = reference.rms_norm(stream, final_norm, EPS)
    yardstick = relative_error(want, exact)  # bf16 over 16 layers: ~2e-2
    assert yardstick < 3e-2
    assert relative_error(got, exact) < 1.25 * yardstick
    assert relative_error(got, want) < 1.5 * yardstick


def test_the_kernel_replays_from_a_cuda_graph() -> None:
    stack, final_norm = make_stack(DEVICE, 4 * 40 + 1)
    cos, sin = rotary(DEVICE, 4096)
    meta = make_batch(4, 300, 4096, DEVICE)
    h = torch.randn(4, HIDDEN, device=DEVICE).to(torch.bfloat16)
    config = PersistentConfig()
    eager = persistent_path(h, stack, final_norm, meta, cos, sin, config).clone()
    _, replayed = graph_ms(lambda: persistent_path(h, stack, final_norm, meta, cos, sin, config), 3)
    assert torch.equal(replayed, eager)


def test_the_engine_takes_the_persistent_pass_and_agrees_with_the_layer_path(monkeypatch):
    """One sequence at a time (the persistent pass's rows): the engine with the pass bound against the engine
    with it switched off, same dummy weights, greedy, CUDA graphs on."""
    import random

    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    from tests.block_invariants import run_checked_outputs
    from tests.greedy_agreement import assert_agree

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(
            "the persistent pass is bound on compute capability 9.0 only (where it was measured)"
        )
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
    options = dict(load_format="dummy", model_config="llama-3.2-1b", dtype="bfloat16", device="cuda",
                   max_model_len=512, num_kv_blocks=256, max_num_seqs=1)  # fmt: skip
    rng = random.Random(3)
    prompts = [[rng.randrange(10000) for _ in range(n)] for n in (20, 75, 140)]
    outputs = {}
    for switch in ("off", "auto"):
        monkeypatch.setenv("PAGEDCHAT_PERSISTENT_DECODE", switch)
        calls = []
        from kernels import ops as kernel_ops

        kernel = kernel_ops.persistent_decode
        monkeypatch.setattr(
            kernel_ops, "persistent_decode", lambda *a: calls.append(1) or kernel(*a)
        )
        llm = LLM(**options)
        try:
            bound = llm.engine.runner.model.model.persistent is not None
            outputs[switch] = run_checked_outputs(llm.engine, prompts, greedy)
        finally:
            llm.shutdown()
            monkeypatch.setattr(kernel_ops, "persistent_decode", kernel)
        assert bound == (switch == "auto")
        assert bool(calls) == (switch == "auto")
    assert_agree(outputs["auto"], outputs["off"], drift=0.1, near_tie=0.1)
