"""Our model code against transformers' for every supported family (tiny random models saved as HF
directories), and the named dummy architectures' shapes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.llm import LLM
from engine.worker.dummy_model import DUMMY_ARCHITECTURES, dummy_hf_config, dummy_weights
from engine.models.registry import model_class
from engine.sampling_params import SamplingParams
from tests.conftest import hf_greedy
from tests.greedy_agreement import assert_transformers_greedy

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)
FAMILIES = {
    "llama": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], tie_word_embeddings=False
    ),
    "llama-bias-tied": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
    ),
    "llama3-rope-scaling": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "mistral": dict(
        model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None
    ),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=32),
    # every layer a sliding window shorter than two of the prompts
    "mistral-window": dict(
        model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=12
    ),
    "phi3": dict(
        model_type="phi3",
        architectures=["Phi3ForCausalLM"],
        sliding_window=None,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "phi3-longrope": dict(
        model_type="phi3",
        architectures=["Phi3ForCausalLM"],
        sliding_window=None,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        max_position_embeddings=2048,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [2.0 + 0.3 * i for i in range(8)],
            "original_max_position_embeddings": 512,
        },
    ),
    "qwen3-moe": dict(
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        norm_topk_prob=True,
    ),
    # Gemma 3: local layers with a window of 8 and every third layer global
    "gemma3": dict(
        model_type="gemma3_text",
        architectures=["Gemma3ForCausalLM"],
        num_hidden_layers=3,
        head_dim=32,
        sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=24,
        tie_word_embeddings=True,
    ),
}
PROMPTS = [[5, 17, 200, 3, 9], list(range(30, 90)), [7] * 23]


def tiny_hf_model(family: str, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = {**TINY, **FAMILIES[family], **overrides}
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # a wider spread than the default init: clear argmax margins
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_equals_transformers_for_each_family(family: str, tmp_path: Path):
    hf = tiny_hf_model(family)
    hf.save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), num_kv_blocks=64, max_num_batched_tokens=32)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    expected = [hf_greedy(hf, p, 12) for p in PROMPTS]
    assert_transformers_greedy(hf, PROMPTS, [o.token_ids for o in outputs], expected)


# run with PAGEDCHAT_KERNELS=reference (read when kernels is imported: a process of its own): the layers as the GPU
# runs them; prints the greedy tokens and how many stores were handed q/k norm weights
GPU_LAYER_PATH_RUN = """
import json, sys
import kernels
from engine.llm import LLM
from engine.sampling_params import SamplingParams
normed = []
store = kernels.ops.rotary_store_kv
kernels.ops.rotary_store_kv = lambda *args: normed.append(len(args) > 11) or store(*args)
model, prompts, new_tokens = json.loads(sys.stdin.read())
llm = LLM(model=model, num_kv_blocks=64, max_num_batched_tokens=32)
greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
outputs = llm.generate(prompts, greedy)
print(json.dumps([[o.token_ids for o in outputs], sum(normed), len(normed)]))
"""


def test_qwen3_on_the_gpu_layer_path_norms_q_and_k_in_the_store_launch(tmp_path: Path):
    """Qwen3's q/k norm handed to the KV store with the rotation (one launch a layer on the GPU, where the
    lean CPU path norms first): still transformers' tokens, and every store was given the norm weights."""
    import json
    import os
    import subprocess
    import sys

    hf = tiny_hf_model("qwen3")
    hf.save_pretrained(tmp_path)
    result = subprocess.run(
        [sys.executable, "-c", GPU_LAYER_PATH_RUN],
        input=json.dumps([str(tmp_path), PROMPTS, 8]),
        capture_output=True,
        text=True,
        env={**os.environ, "PAGEDCHAT_KERNELS": "reference"},
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    tokens, normed_stores, stores = json.loads(result.stdout.strip().splitlines()[-1])
    expected = [hf_greedy(hf, p, 8) for p in PROMPTS]
    assert_transformers_greedy(hf, PROMPTS, tokens, expected)
    assert stores > 0 and normed_stores == stores


@pytest.mark.parametrize("family", ["qwen3", "llama-bias-tied"])
def test_dummy_weights_are_seeded_and_give_both_implementations_the_same_model(family: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = {**TINY, **FAMILIES[family]}
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    first = dict(dummy_weights(config, seed=3))
    again = dict(dummy_weights(config, seed=3))
    other = dict(dummy_weights(config, seed=4))
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not any(torch.equal(first[k], other[k]) for k in first)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    result = hf.load_state_dict(first, strict=False)
    tied_head = ["lm_head.weight"] if config.tie_word_embeddings else []
    assert result.missing_keys == tied_head and not result.unexpected_keys
    ours = model_class(config)(config)
    ours.load_weights(first.items())
    assert torch.equal(ours.model.embed_tokens.weight, hf.model.embed_tokens.weight)
    assert torch.equal(
        hf.get_output_embeddings().weight,
        first.get("lm_head.weight", first["model.embed_tokens.weight"]),
    )


@pytest.mark.parametrize("name", sorted(DUMMY_ARCHITECTURES))
def test_named_architectures_match_our_parameter_shapes(name: str):
    """Every HF tensor of the named architecture has a place of the right shape in our model (on the meta
    device: nothing is allocated)."""
    from transformers import AutoModelForCausalLM

    config = dummy_hf_config(name)
    with torch.device("meta"):
        ours = model_class(config)(config)
        hf_tensors = AutoModelForCausalLM.from_config(config).state_dict()
    # raises on unknown names, wrong shapes or missing tensors
    ours.load_weights(hf_tensors.items())
    spec = DUMMY_ARCHITECTURES[name]
    assert (
        ours.args.num_layers == spec["num_hidden_layers"] and ours.args.head_dim == spec["head_dim"]
    )


def test_unknown_architecture_is_a_clear_error():
    with pytest.raises(ValueError, match="model_config"):
        dummy_hf_config("gpt-5")
