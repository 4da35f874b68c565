"""The disk tier of the prefix cache on CUDA (issue 52): a session's turn written to disk, the device's cache
forgotten, the next turn served from the disk tier; float32 dummy llama-3.2-1b, greedy tokens equal to an engine
without the tier that computes everything."""

from __future__ import annotations

import random

import pytest
import torch

from engine.llm import LLM
from engine.runtime.engine_core import EngineCore
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)"
)

BLOCK = 16
NEW_TOKENS = 16
BASE = {
    "load_format": "dummy",
    "model_config": "llama-3.2-1b",
    "dtype": "float32",
    "device": "cuda",
    "max_model_len": 1024,
    "num_kv_blocks": 128,
}


def ids(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10000) for _ in range(length)]


def greedy_turn(core: EngineCore, prompt: list[int], retain: bool) -> list[int]:
    request_id = f"turn-{len(prompt)}-{retain}-{random.random()}"
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    core.add_request(request_id, prompt, params, retain=retain)
    tokens: list[int] = []
    while core.has_unfinished_requests():
        tokens += [t for d in core.step() if d.request_id == request_id for t in d.token_ids]
    return tokens


@pytest.fixture(scope="module")
def recomputing() -> EngineCore:
    torch.backends.cuda.matmul.allow_tf32 = False
    return LLM(kv_disk_size=0, **BASE).engine.core


def test_next_turn_after_reset_reads_the_turn_back_from_disk_on_cuda(tmp_path, recomputing):
    core = LLM(kv_disk_path=str(tmp_path), kv_disk_size=2**30, **BASE).engine.core
    head = ids(1, 300)
    first = greedy_turn(core, head, retain=True)
    assert core.flush_kv_tiers(timeout_s=60.0)
    core.block_manager.reset_prefix_cache()
    follow_up = head + first + ids(2, 24)
    before = core.stats().prefix_disk_hits
    second = greedy_turn(core, follow_up, retain=False)
    # every full block of the first turn (its last token was sampled, never computed: it has no KV)
    with_kv = len(head) + len(first) - 1
    assert core.stats().prefix_disk_hits - before == with_kv // BLOCK * BLOCK
    recomputing.block_manager.reset_prefix_cache()
    expected_first = greedy_turn(recomputing, head, retain=False)
    recomputing.block_manager.reset_prefix_cache()
    assert (first, second) == (expected_first, greedy_turn(recomputing, follow_up, False))


def test_a_tier_of_size_zero_serves_nothing_on_cuda(recomputing):
    recomputing.block_manager.reset_prefix_cache()
    head = ids(3, 200)
    greedy_turn(recomputing, head, retain=True)
    recomputing.block_manager.reset_prefix_cache()
    before = recomputing.stats()
    greedy_turn(recomputing, head + ids(4, 20), retain=False)
    after = recomputing.stats()
    assert after.prefix_disk_hits == before.prefix_disk_hits
    assert after.prefix_hits == before.prefix_hits  # nothing left on the device either
