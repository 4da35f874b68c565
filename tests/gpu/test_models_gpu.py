"""Issue 50's model families and GGUF loading on CUDA, float32, with the decode steps through CUDA graphs: tiny
random Gemma 3 (its sliding-window layers in a KV group of their own), Qwen3-MoE (the fused Triton expert
kernel), Phi-3 and a windowed Mistral, each greedy equal to transformers' on the same weights; and the default
GGUF files of Llama, Gemma 3 and Qwen3-MoE de-quantized on the device, equal to transformers on the same float32
weights."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.conftest import hf_greedy
from tests.engine.test_models import TINY, tiny_hf_model
from tests.gguf_writer import write_gguf
from tests.hf_export import hf_directory

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)"
)

NEW_TOKENS = 12


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, TINY["vocab_size"]) for _ in range(n)] for n in (5, 23, 60, 130)]


@pytest.mark.parametrize("family", ["gemma3", "qwen3-moe", "phi3", "mistral-window"])
def test_family_on_cuda_through_graphs_equals_transformers(family: str, tmp_path: Path):
    torch.backends.cuda.matmul.allow_tf32 = False
    hf = tiny_hf_model(family)
    hf.save_pretrained(tmp_path)
    llm = LLM(
        model=str(tmp_path),
        device="cuda",
        dtype="float32",
        num_kv_blocks=128,
        max_num_batched_tokens=64,
        max_model_len=512,
    )
    runner = llm.engine.runner
    assert runner.decode_graphs.use_graphs, "decode steps run as CUDA graphs"
    if family == "gemma3":
        assert runner.kv.window > 0 and llm.engine.core.block_manager.window is not None
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts(), params)
    hf = hf.to("cuda")
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts()]
    assert [o.token_ids for o in outputs] == expected
    assert sum(runner.decode_graphs.padded_steps.values()) > 0, "some steps replayed a graph"


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3-moe"])
def test_a_gguf_file_loads_on_cuda_and_equals_transformers(family: str, tmp_path: Path):
    """A GGUF file (Q8_0 blocks) de-quantized on the device, float32 here for equality with transformers on the
    float32 export of the same blocks."""
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    path = write_gguf(tiny_hf_model(family), tmp_path / f"tiny-{family}.gguf")
    start = time.perf_counter()
    llm = LLM(model=str(path), device="cuda", dtype="float32", num_kv_blocks=128, max_model_len=512)
    print(f"\nGGUF {family} on CUDA: engine ready in {time.perf_counter() - start:.1f} s")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts(), params)
    exported = hf_directory(path, Path(EngineConfig().cache_dir))
    hf = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).to("cuda").eval()
    assert [o.token_ids for o in outputs] == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts()]
