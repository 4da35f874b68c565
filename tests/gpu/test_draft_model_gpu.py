"""Speculative decoding with a draft model on the GPU (dummy weights, CUDA graphs: the draft's propose passes
replayed from graphs of their own, drafted steps from the verify graphs): greedy output equals plain decoding's,
through preemption; the model drafting for itself (the same seeded weights) has its drafts accepted, so the draft's
KV, caught up before its proposals, follows the target's; the block books balance."""

from __future__ import annotations

import random

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.speculative import speculator as speculator_module
from tests.block_invariants import check_pool
from tests.two_layer_llama import two_layer_llama_dir

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)"
)

NEW_TOKENS = 48


@pytest.fixture(autouse=True)
def always_draft(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every decode row drafts as many as fit, whatever the learned step prices advise."""
    monkeypatch.setattr(speculator_module, "choose_draft_length", lambda state, limit, *_: limit)


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(1000, 20000) for _ in range(n)] for n in (7, 40, 90, 13, 150, 33)]


@pytest.mark.parametrize("num_kv_blocks", [400, 24], ids=["roomy", "preempting"])
def test_a_self_drafting_model_keeps_plain_greedy_output_float32(num_kv_blocks):
    torch.backends.cuda.matmul.allow_tf32 = False
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    common = dict(
        load_format="dummy",
        model_config="llama-3.2-1b",
        dtype="float32",
        device="cuda",
        num_kv_blocks=num_kv_blocks,
        max_num_batched_tokens=256,
        max_model_len=512,
        gpu_memory_utilization=0.5,
    )
    plain = [o.token_ids for o in LLM(**common).generate(prompts(), params)]
    llm = LLM(**common, speculative_model="llama-3.2-1b", num_speculative_tokens=4)
    spec = [o.token_ids for o in llm.generate(prompts(), params)]
    stats = llm.engine.stats()
    runner = llm.engine.core.runner
    replays = sum(graphs.num_replays for graphs in runner.draft.graphs or ())
    print(
        f"drafted {stats.spec_draft_tokens} accepted {stats.spec_accepted_tokens} verifications "
        f"{stats.spec_verifications} propose replays {replays} preemptions {stats.preemptions}"
    )
    assert replays > 0, "the propose passes should replay their graphs"
    assert stats.spec_draft_tokens > 0
    assert stats.spec_accepted_tokens >= 0.8 * stats.spec_draft_tokens, (
        "the model drafting for itself should have its drafts accepted"
    )
    if num_kv_blocks == 24:
        assert stats.preemptions > 0
    for i, (a, b) in enumerate(zip(plain, spec)):
        assert a == b, f"prompt {i}: speculative output parts from plain decoding"
    check_pool(llm.engine.core.block_manager, [])


def test_a_small_random_draft_keeps_plain_greedy_output(tmp_path):
    """A two-layer draft of the same vocabulary (dummy weights for a config directory): its drafts mostly wrong,
    the output plain decoding's (float32), through the graphs."""
    draft = two_layer_llama_dir(tmp_path, max_position_embeddings=4096)
    torch.backends.cuda.matmul.allow_tf32 = False
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    common = dict(
        load_format="dummy",
        model_config="llama-3.2-1b",
        dtype="float32",
        device="cuda",
        num_kv_blocks=200,
        max_model_len=512,
        gpu_memory_utilization=0.5,
    )
    plain = [o.token_ids for o in LLM(**common).generate(prompts(), params)]
    llm = LLM(**common, speculative_model=str(draft))
    spec = [o.token_ids for o in llm.generate(prompts(), params)]
    stats = llm.engine.stats()
    print(f"drafted {stats.spec_draft_tokens} accepted {stats.spec_accepted_tokens}")
    assert stats.spec_draft_tokens > 0
    assert spec == plain
    assert stats.num_free_blocks == stats.num_blocks
