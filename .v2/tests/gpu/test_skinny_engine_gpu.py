"""The skinny matmul inside the engine on an H100/H200 (kernels/skinny_choice.py): a bf16 decode step of a few rows
takes it for the projections and the output layer where it measured faster than cuBLAS, inside the CUDA graphs,
and the engine's greedy run agrees with the cuBLAS-only run (another reduction order, so logprobs within bf16's
reach and partings only at near-ties: tests/greedy_agreement.py). float32 keeps cuBLAS (token-exact tests)."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)"
    ),
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0),
        reason="the skinny kernel's measured table is for compute capability 9.0 (H100, H200)",
    ),
]

pytest.importorskip("triton", reason="triton is not installed")

from engine.llm import LLM  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from kernels import ops as kernel_ops  # noqa: E402
from kernels import skinny_choice  # noqa: E402
from tests.block_invariants import run_checked_outputs  # noqa: E402
from tests.greedy_agreement import assert_agree  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
OPTIONS = {
    "load_format": "dummy",
    "model_config": "llama-3.2-1b",
    "dtype": "bfloat16",
    "device": "cuda",
    "max_model_len": 512,
    "num_kv_blocks": 256,
}


def run(prompts: list[list[int]], monkeypatch, skinny: bool) -> tuple[list, dict[str, int]]:
    """The engine's outputs (graphs on) with the skinny path on or off, and the skinny calls it made."""
    calls = {"skinny_gemm": 0, "skinny_gemm_silu_and_mul": 0}
    for name in calls:
        kernel = getattr(kernel_ops, name)

        def counted(*args, _kernel=kernel, _name=name):
            calls[_name] += 1
            return _kernel(*args)

        monkeypatch.setattr(kernel_ops, name, counted)
    if not skinny:
        monkeypatch.setattr(skinny_choice, "FASTER_THAN_CUBLAS", frozenset())
        monkeypatch.setattr(skinny_choice, "FASTER_WITH_PDL", frozenset())
    llm = LLM(**OPTIONS)
    try:
        assert llm.engine.runner.decode_graphs.graphs is not None
        outputs = run_checked_outputs(llm.engine, prompts, GREEDY)
    finally:
        llm.shutdown()
        monkeypatch.undo()
    return outputs, calls


def test_bf16_decode_takes_the_skinny_kernel_and_agrees_with_cublas(monkeypatch):
    rng = random.Random(5)
    prompts = [[rng.randrange(10000) for _ in range(n)] for n in (20, 75, 140, 33)]
    reference, none = run(prompts, monkeypatch, skinny=False)
    assert none == {"skinny_gemm": 0, "skinny_gemm_silu_and_mul": 0}
    got, calls = run(prompts, monkeypatch, skinny=True)
    # captured into every graph size (and eager warm-ups): down and lm_head per pass, gate/up fused
    assert calls["skinny_gemm"] > 0 and calls["skinny_gemm_silu_and_mul"] > 0, calls
    assert_agree(got, reference, drift=0.1, near_tie=0.1)


def test_float32_and_prefill_rows_keep_cublas():
    x = torch.randn(8, 2048, device="cuda")
    w = torch.randn(128256, 2048, device="cuda")
    assert not skinny_choice.prefer_skinny(skinny_choice.GEMM, x, w)
    assert skinny_choice.prefer_skinny(skinny_choice.GEMM, x.bfloat16(), w.bfloat16())
    rows = torch.randn(skinny_choice.MAX_ROWS + 1, 2048, device="cuda", dtype=torch.bfloat16)
    assert not skinny_choice.prefer_skinny(skinny_choice.GEMM, rows, w.bfloat16())
