"""A long prompt prefilled in many chunks on CUDA: the chunks sample nothing, so the host never waits for the
device and runs several steps ahead of it. Each step's inputs must still reach the device intact (a staging
buffer refilled before its copy ran once fed a chunk another chunk's positions and tables: a device-side assert
in a gather, 9 runs in 10 for a 32k-token prompt in 8,192-token chunks). The tokens equal those of the same
engine waiting for the device after every step."""

from __future__ import annotations

import random

import pytest
import torch

from engine.runtime.engine_core import EngineCore
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)"
)

PROMPT_TOKENS = 24_000


def greedy(core: EngineCore, prompt: list[int], wait_each_step: bool) -> list[int]:
    request_id = f"long-{wait_each_step}"
    core.add_request(
        request_id, prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    )
    tokens: list[int] = []
    while core.has_unfinished_requests():
        for delta in core.step():
            tokens += delta.token_ids
        if wait_each_step:
            torch.cuda.synchronize()
    core.block_manager.reset_prefix_cache()
    return tokens


def test_a_long_prompt_in_chunks_runs_ahead_of_the_device_without_corrupting_its_inputs():
    core = EngineCore(
        load_format="dummy",
        model_config="llama-3.2-1b",
        device="cuda",
        max_model_len=PROMPT_TOKENS + 64,
        max_num_batched_tokens=2048,
        kv_disk_size=0,
    )
    rng = random.Random(7)
    prompt = [rng.randrange(10000) for _ in range(PROMPT_TOKENS)]
    ahead = [greedy(core, prompt, wait_each_step=False) for _ in range(3)]
    waited = greedy(core, prompt, wait_each_step=True)
    assert len(waited) == 4 and all(tokens == waited for tokens in ahead)
