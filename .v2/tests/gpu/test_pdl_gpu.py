"""Programmatic dependent launch (kernels/pdl.py) on a Hopper GPU: the decode step's Triton kernels start before
the kernel ahead of them has finished and wait for it only where they read its output. PDL changes timing, never
arithmetic, so the engine's outputs (CUDA graphs on, bf16) with PDL must equal those without it bit for bit,
logprobs included. A missing wait would show here as a race: stale activations, a KV store read before it
landed, a split-K counter reused early."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)"
    ),
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9,
        reason="programmatic dependent launch needs compute capability 9.0 or later",
    ),
]

pytest.importorskip("triton", reason="triton is not installed")

from engine.llm import LLM  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from kernels import device_features, skinny_choice  # noqa: E402
from tests.block_invariants import run_checked_outputs  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=3)
OPTIONS = {
    "load_format": "dummy",
    "model_config": "llama-3.2-1b",
    "dtype": "bfloat16",
    "device": "cuda",
    "max_model_len": 1024,
    "num_kv_blocks": 512,
}


def run(prompts: list[list[int]], monkeypatch, pdl: bool) -> list:
    """Outputs with PDL on or off; the same kernels either way (the shapes taken only with PDL kept)."""
    if not pdl:
        monkeypatch.setattr(device_features, "_SWITCH", "off")
        monkeypatch.setattr(
            skinny_choice,
            "FASTER_THAN_CUBLAS",
            skinny_choice.FASTER_THAN_CUBLAS | skinny_choice.FASTER_WITH_PDL,
        )
    assert device_features.use_pdl(torch.device("cuda")) == pdl
    llm = LLM(**OPTIONS)
    try:
        assert llm.engine.runner.decode_graphs.graphs is not None
        return run_checked_outputs(llm.engine, prompts, GREEDY)
    finally:
        llm.shutdown()
        monkeypatch.undo()


def test_pdl_changes_no_bit_of_the_outputs(monkeypatch):
    rng = random.Random(11)
    # 1, 3 and 9 decode rows at times (graph sizes 1, 4, 16), contexts across split-K's partition counts
    lengths = (700, 20, 140, 33, 410, 75, 260, 12, 900)
    prompts = [[rng.randrange(10000) for _ in range(n)] for n in lengths]
    without = run(prompts, monkeypatch, pdl=False)
    with_pdl = run(prompts, monkeypatch, pdl=True)
    for a, b in zip(with_pdl, without, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs
    solo_without = run(prompts[:1], monkeypatch, pdl=False)
    solo = run(prompts[:1], monkeypatch, pdl=True)
    assert solo[0].token_ids == solo_without[0].token_ids
    assert solo[0].logprobs == solo_without[0].logprobs
