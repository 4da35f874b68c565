"""A tiny random Qwen3 (2 layers, hidden 64) with Qwen3's real tokenizer and a real chat template, as a GGUF file
written as llama.cpp's converter writes a Qwen3 instruct model: the vocabulary and merges of llama.cpp's Qwen2
vocabulary file (Qwen3 keeps them), Qwen3's added tokens at 151646..151668 typed as the converter types them
(``<|...|>`` ones control, ``<tool_call>``/``<think>`` and the like user-defined, so they stay in decoded text),
the unused ids up to 151935 as ``[PADn]``, EOS ``<|im_end|>``, padding ``<|endoftext|>``, no BOS prepended."""

from __future__ import annotations

import fcntl
import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import EngineConfig
from tests.gguf_writer import GGUFTokenizer, write_gguf
from tests.llama_cpp_testdata import chat_template, llama_cpp_models_dir

VOCAB_SIZE = 151936
ENDOFTEXT, IM_START, IM_END = 151643, 151644, 151645
# Qwen3's added tokens after <|im_end|>, in id order from 151646
ADDED = (
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
TOKEN_IDS = {token: IM_END + 1 + i for i, token in enumerate(ADDED)}
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5  # llama.cpp's token types
FILE_VERSION = (
    "v1"  # in the cached file's name: raise it when the model or tokenizer written here changes
)


def qwen3_tokenizer(
    template_name: str = "Qwen-Qwen3-0.6B", cache_dir: Path | None = None
) -> GGUFTokenizer:
    """Qwen3's tokenizer with the chat template ``template_name`` (tests/llama_cpp_testdata.py's TEMPLATES)."""
    vocabulary = qwen2_vocabulary(cache_dir)
    tokens, types = list(vocabulary.tokens), list(vocabulary.token_types)
    for token, i in TOKEN_IDS.items():
        # (llama.cpp's converter: an added token spelled <|...|> is control even where not marked special)
        tokens[i] = token
        types[i] = CONTROL if token.startswith("<|") else USER_DEFINED
    for i in range(max(TOKEN_IDS.values()) + 1, VOCAB_SIZE):
        tokens[i], types[i] = f"[PAD{i}]", UNUSED
    return GGUFTokenizer(
        tokens,
        types,
        vocabulary.merges,
        bos_token_id=ENDOFTEXT,
        eos_token_id=IM_END,
        padding_token_id=ENDOFTEXT,
        pre="qwen2",
        add_bos_token=False,
        chat_template=chat_template(template_name, cache_dir),
    )


@dataclass(frozen=True)
class Vocabulary:
    """llama.cpp's Qwen2 vocabulary file as it spells it: byte-level tokens, their types, the merges."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]


@functools.cache
def qwen2_vocabulary(cache_dir: Path | None = None) -> Vocabulary:
    """llama.cpp's ``ggml-vocab-qwen2.gguf`` read by the gguf package (~7 s), kept beside it as JSON (~0.3 s)."""
    vocab_file = llama_cpp_models_dir(cache_dir) / "ggml-vocab-qwen2.gguf"
    kept = vocab_file.with_suffix(".json")
    if not kept.is_file():
        from gguf import GGUFReader

        fields = GGUFReader(vocab_file).fields
        read = {
            "tokens": fields["tokenizer.ggml.tokens"].contents(),
            "token_types": [int(t) for t in fields["tokenizer.ggml.token_type"].contents()],
            "merges": fields["tokenizer.ggml.merges"].contents(),
        }
        staged = kept.with_name(f"{kept.name}.{os.getpid()}.tmp")
        staged.write_text(json.dumps(read))
        staged.rename(kept)  # (atomic: racing workers write the same text)
    vocabulary = Vocabulary(**json.loads(kept.read_text()))
    assert len(vocabulary.tokens) == VOCAB_SIZE and vocabulary.tokens[IM_END] == "<|im_end|>"
    return vocabulary


def tiny_qwen3_model() -> torch.nn.Module:
    """tests/engine/test_models.py's tiny Qwen3 (2 layers, hidden 64, 4 query and 2 KV heads) with Qwen3's vocabulary,
    heads of 16, and tied embeddings as Qwen3-0.6B has."""
    from tests.engine.test_models import tiny_hf_model

    return tiny_hf_model(
        "qwen3",
        vocab_size=VOCAB_SIZE,
        head_dim=16,
        max_position_embeddings=4096,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        bos_token_id=ENDOFTEXT,
        eos_token_id=IM_END,
        pad_token_id=ENDOFTEXT,
    )


def tiny_qwen3_gguf(
    path: Path,
    template_name: str = "Qwen-Qwen3-0.6B",
    block_type: str = "Q8_0",
    cache_dir: Path | None = None,
) -> Path:
    """``tiny_qwen3_model()`` with Qwen3's tokenizer and ``template_name``'s chat template, written at ``path``
    (the tokenizer's files come from ``cache_dir``: tests/llama_cpp_testdata.py)."""
    tokenizer = qwen3_tokenizer(template_name, cache_dir)
    return write_gguf(tiny_qwen3_model(), Path(path), block_type, tokenizer)


def cached_tiny_qwen3_gguf(
    template_name: str = "Qwen-Qwen3-0.6B", cache_dir: Path | None = None
) -> Path:
    """``tiny_qwen3_gguf`` written once into the cache dir (``PAGEDCHAT_CACHE_DIR``) and shared by every test and
    pytest-xdist worker: the engine describes a GGUF file once per path, so one file keeps its later starts fast.
    Treat it as read-only."""
    root = Path(cache_dir or EngineConfig().cache_dir) / "testdata" / "tiny-qwen3"
    path = root / f"tiny-qwen3-{FILE_VERSION}-{template_name}.gguf"
    if path.is_file():
        return path
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.is_file():
            staged = path.with_name(path.name + ".tmp")
            tiny_qwen3_gguf(staged, template_name, cache_dir=cache_dir)
            staged.rename(path)  # whole or absent
    return path
