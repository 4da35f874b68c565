"""GGUF files of every family we run (tiny random models written as llama.cpp writes them: tests/gguf_writer.py),
served from the file: with ``--cpu-weights float32`` the engine's greedy tokens equal transformers' on the same
de-quantized weights (the file's names, row orders, norm offsets and expert stacks read right); with ``file`` (the
default for GGUF models) every projection stays in its block format and the tokens follow the float32 run. And a
broken file is one clear line."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.layers.gguf_linear import GGUFLinear
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.weights.gguf_file import GGUFFile
from tests.conftest import hf_greedy
from tests.engine.test_models import tiny_hf_model
from tests.gguf_writer import write_gguf
from tests.hf_export import hf_directory

NEW_TOKENS = 10
FAMILIES = ["llama", "qwen3", "gemma3", "phi3", "qwen3-moe"]


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(0, 320) for _ in range(n)] for n in (6, 25, 70)]


@pytest.fixture(scope="module", params=FAMILIES)
def gguf_file(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(request.param) / f"tiny-{request.param}-q8_0.gguf"
    return write_gguf(tiny_hf_model(request.param), path)


def test_float32_from_the_file_equals_transformers_on_its_weights(gguf_file: Path):
    from transformers import AutoModelForCausalLM

    llm = LLM(model=str(gguf_file), cpu_weights="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts(), params)
    exported = hf_directory(gguf_file, Path(EngineConfig().cache_dir))
    hf = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    assert [o.token_ids for o in outputs] == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts()]


def test_the_file_mode_keeps_every_projection_in_its_blocks(gguf_file: Path):
    llm = LLM(model=str(gguf_file), num_kv_blocks=64)
    model = llm.engine.model
    assert llm.engine.config.cpu_weights == "file"
    layers = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    assert layers and all(set(m.part_formats) == {"q8_0"} for m in layers)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ours = [o.token_ids for o in llm.generate(prompts(), params)]
    floats = LLM(model=str(gguf_file), cpu_weights="float32", num_kv_blocks=64)
    expected = [o.token_ids for o in floats.generate(prompts(), params)]
    # 8-bit weights and activations: the greedy prefixes agree (a late near-tie may part them)
    agree = [
        next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), NEW_TOKENS)
        for x, y in zip(ours, expected)
    ]
    assert min(agree) >= 3 and sum(agree) >= 2 * NEW_TOKENS, agree


def test_a_truncated_file_is_one_clear_line(tmp_path: Path):
    source = write_gguf(tiny_hf_model("llama"), tmp_path / "whole.gguf")
    data = source.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(
        ValueError, match=r"^model: .*cut\.gguf is truncated: tensor '.*' needs bytes up to"
    ):
        GGUFFile(cut)
    with pytest.raises(ValueError, match="model:.*cut.gguf is truncated"):
        LLM(model=str(cut), num_kv_blocks=16)
    header = tmp_path / "header.gguf"
    header.write_bytes(data[:300])
    with pytest.raises(ValueError, match=r"^model: .*header\.gguf is not a valid GGUF file"):
        GGUFFile(header)


def test_blocks_are_read_from_the_map_itself_and_the_vocabulary_whole(gguf_file: Path):
    """The CPU reads a tensor's bytes in place (no copy of the file at load), and the metadata's string arrays
    (the vocabulary) come back whole, in order."""
    from engine.weights.gguf_blocks import raw_bytes

    gguf = GGUFFile(gguf_file)
    tensor = next(t for t in gguf.tensors.values() if t.data.nbytes > 1024)
    view = raw_bytes(tensor)
    assert view.data_ptr() == tensor.data.ctypes.data and view.numel() == tensor.data.nbytes
    tokens = gguf.metadata["tokenizer.ggml.tokens"]
    assert tokens[256:259] == ["ab", "<ctl0>", "<ctl1>"] and all(isinstance(t, str) for t in tokens)
    gguf.close()


def test_a_file_that_is_not_gguf_or_of_an_unknown_architecture_is_refused(tmp_path: Path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04" + bytes(200))
    with pytest.raises(ValueError, match="does not start with 'GGUF'"):
        LLM(model=str(fake), num_kv_blocks=16)
    source = write_gguf(tiny_hf_model("llama"), tmp_path / "llama.gguf")
    data = bytearray(source.read_bytes())
    at = data.index(b"llama")  # general.architecture's value
    data[at : at + 5] = b"bloom"
    other = tmp_path / "bloom.gguf"
    other.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="'bloom' GGUF; pagedchat runs llama"):
        LLM(model=str(other), num_kv_blocks=16)
    shutil.rmtree(tmp_path, ignore_errors=True)
