"""The sliding-window layers' own KV blocks (engine/core/window_blocks.py) on a tiny Gemma 3 (two local layers
with a window of 32 tokens, one global layer, blocks of 16): a sequence holds at most a window and a block of them
while it decodes, the prefix cache still hits for them on a session's next turn, and the tokens equal
transformers' (float32) throughout; the pools' invariants hold after every step."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.block_invariants import check_pool, run_checked
from tests.conftest import hf_greedy

WINDOW, BLOCK = 32, 16
GEMMA = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=320,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    sliding_window=WINDOW,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    query_pre_attn_scalar=24,
    tie_word_embeddings=True,
)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gemma3_text", **GEMMA)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # a wider spread than the default init: clear argmax margins
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    path = tmp_path_factory.mktemp("gemma3")
    model.save_pretrained(path)
    return model, path


def engine_for(path: Path, **options) -> LLMEngine:
    options = {
        "num_kv_blocks": 256,
        "max_num_batched_tokens": 64,
        "cpu_weights": "float32",
    } | options
    return LLMEngine(model=str(path), **options)


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 320) for _ in range(length)]


def test_the_model_gets_a_window_group_sized_apart(gemma):
    engine = engine_for(gemma[1])
    window = engine.core.block_manager.window
    assert window is not None and window.window == WINDOW
    kv = engine.core.runner.kv
    # the two local layers' caches are their own; the global layer's the block manager's pool
    assert kv.window_k_caches.shape[0] == 2 and kv.k_caches.shape[0] == 1


def test_decoding_holds_at_most_a_window_and_a_block(gemma):
    engine = engine_for(gemma[1])
    window = engine.core.block_manager.window
    held: list[int] = []

    def record(eng: LLMEngine) -> None:
        for seq in eng.core.scheduler.running:
            if seq.num_output_tokens >= 2:  # its last step was a decode step
                held.append(window.held(seq))

    prompts = [prompt(200, 1), prompt(90, 2)]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    tokens = run_checked(engine, prompts, params, record)
    assert held and max(held) <= -(-WINDOW // BLOCK) + 1
    assert tokens == [hf_greedy(gemma[0], p, 60) for p in prompts]


def test_a_sessions_next_turn_hits_the_cache_for_every_layer(gemma):
    """Turn 2's prompt extends turn 1's prompt and reply: its cached tokens are at least 90% of it (the global
    layer's blocks and the window layers' last window both hit), and its reply is transformers' for the whole
    prompt (the window layers read the right cached keys)."""
    engine = engine_for(gemma[1])
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    first = prompt(1900, 3)
    (reply,) = run_checked(engine, [first], params)
    second = first + reply + prompt(60, 4)
    engine.add_request("turn-2", second, params)
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
        scheduler = engine.core.scheduler
        check_pool(engine.core.block_manager, list(scheduler.running) + list(scheduler.waiting))
    (out,) = finals
    assert out.num_cached_tokens >= 0.9 * len(second), (out.num_cached_tokens, len(second))
    assert out.token_ids == hf_greedy(gemma[0], second, 40)


def test_forks_share_window_blocks_and_preemption_recomputes_them(gemma):
    """n = 3 greedy samples share their prompt's blocks in both pools (copy-on-write on the first write); with
    too few blocks sequences are preempted and recomputed; every output equals the request alone."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, n=3)
    prompts = [prompt(100, 5), prompt(70, 6), prompt(120, 7)]
    roomy = engine_for(gemma[1])
    alone = [
        run_checked(roomy, [p], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
        for p in prompts
    ]
    tight = engine_for(gemma[1], num_kv_blocks=24)
    outs = []
    for p in prompts:
        tight.add_request(f"r{len(outs)}", p, params)
        outs.append(p)
    finals: dict[str, list[list[int]]] = {}
    while tight.has_unfinished_requests():
        for out in tight.step():
            if out.finished:
                finals.setdefault(out.request_id, []).append(out.token_ids)
        scheduler = tight.core.scheduler
        check_pool(tight.core.block_manager, list(scheduler.running) + list(scheduler.waiting))
    assert tight.core.scheduler.num_preemptions > 0, (
        "24 blocks cannot hold the three requests at once"
    )
    for i, expected in enumerate(alone):
        assert finals[f"r{i}"] == [expected] * 3


def test_padded_decode_steps_give_transformers_tokens(gemma):
    """Decode batches padded to a graph ladder size (as CUDA graphs run them; here eagerly on the CPU): 3 rows
    padded to 4, the padding row reading one position through its window table, which must name a block of the
    window pool (the graphs once gave it the packed step's window slots: an out-of-bounds read on the GPU)."""
    engine = engine_for(gemma[1], max_graph_batch_size=8)
    assert engine.core.runner.decode_graphs.sizes == [1, 2, 4, 8]
    prompts = [prompt(70, 5), prompt(40, 6), prompt(20, 7)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    padded = engine.core.runner.decode_graphs.padded_steps
    before = padded[4]
    tokens = run_checked(engine, prompts, params)
    assert padded[4] > before  # decode steps of the 3 rows ran padded to 4
    assert tokens == [hf_greedy(gemma[0], p, 24) for p in prompts]
