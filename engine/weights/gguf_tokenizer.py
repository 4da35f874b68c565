"""The tokenizer a GGUF file describes (``tokenizer.ggml.*``: vocabulary, scores or merges, token types, special
ids, chat template), built as a Hugging Face fast tokenizer by transformers' GGUF tokenizer builders from the
metadata we already read (transformers' own path re-reads the whole file). A file without a chat template gets its
family's (Gemma's turns); end-of-turn tokens the vocabulary marks as control tokens stop generation too, as
llama.cpp does.
"""

from __future__ import annotations

from typing import Any

from engine.weights.gguf_file import GGUFFile

# tokenizer.ggml.* -> the key transformers' builders read
_DICT_KEYS = {
    "model": "tokenizer_type",
    "pre": "pre_tokenizer_type",
    "tokens": "tokens",
    "scores": "scores",
    "token_type": "token_type",
    "merges": "merges",
    "precompiled_charsmap": "precompiled_charsmap",
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "unknown_token_id": "unk_token_id",
    "padding_token_id": "pad_token_id",
    "add_space_prefix": "add_prefix_space",
}
_SPECIAL = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}
# tokens that end a turn in the chat formats we serve; a vocabulary's control token by one of these names is an EOS
END_OF_TURN = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|end|>", "<|eom_id|>")
_CONTROL = 3  # llama.cpp's token type of a control token

# Gemma's chat format (its GGUF files often carry no template): a system message is folded into the first user
# turn; the assistant's role is "model"; the reply starts after "<start_of_turn>model\n"
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set prefix = messages[0]['content'] + '\n\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (prefix if loop.first else '') + (message['content'] | trim)"
    " + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
_DEFAULT_TEMPLATES = {"gemma3": GEMMA_TEMPLATE}


def build_tokenizer(gguf: GGUFFile) -> Any:
    """A ``PreTrainedTokenizerFast`` with the file's vocabulary, special tokens and chat template."""
    from transformers import PreTrainedTokenizerFast

    try:  # (transformers >= 5.20; older releases keep the builders in integrations.ggml, by architecture)
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError:
        convert_gguf_tokenizer = _by_architecture

    meta = gguf.metadata
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(f"model: {gguf.path.name} has no tokenizer (no tokenizer.ggml.tokens)")
    spec = {
        name: _plain(meta[f"tokenizer.ggml.{key}"])
        for key, name in _DICT_KEYS.items()
        if f"tokenizer.ggml.{key}" in meta
    }
    backend, _ = convert_gguf_tokenizer(gguf.architecture, spec)
    config: dict[str, Any] = {
        name: tokens[meta[f"tokenizer.ggml.{key}"]]
        for name, key in _SPECIAL.items()
        if meta.get(f"tokenizer.ggml.{key}") is not None
    }
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    config["add_bos_token"] = bool(
        add_bos if add_bos is not None else spec.get("tokenizer_type") == "llama"
    )
    config["add_eos_token"] = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **config)
    tokenizer.chat_template = meta.get("tokenizer.chat_template") or _DEFAULT_TEMPLATES.get(
        gguf.architecture
    )
    return tokenizer


# older transformers: an architecture without a builder of its own takes one of the same tokenizer
_SAME_TOKENIZER = {
    "qwen3moe": "qwen3",
    "qwen3": "qwen2",
    "gemma3": "gemma2",
    "gemma2": "gemma",
    "mistral": "llama",
}


def _by_architecture(architecture: str, spec: dict[str, Any]) -> Any:
    from transformers.integrations.ggml import GGUF_TO_FAST_CONVERTERS, convert_gguf_tokenizer

    if spec.get("tokenizer_type") == "gpt2":  # byte-level BPE, whatever the architecture
        return convert_gguf_tokenizer("qwen2", spec)
    while architecture not in GGUF_TO_FAST_CONVERTERS and architecture in _SAME_TOKENIZER:
        architecture = _SAME_TOKENIZER[architecture]
    if architecture not in GGUF_TO_FAST_CONVERTERS:
        architecture = "llama"
    return convert_gguf_tokenizer(architecture, spec)


def end_of_turn_ids(gguf: GGUFFile) -> list[int]:
    """The EOS id and the vocabulary's control tokens that end a turn (``<end_of_turn>``, ``<|im_end|>``, ...)."""
    meta = gguf.metadata
    ids = (
        [int(meta["tokenizer.ggml.eos_token_id"])] if "tokenizer.ggml.eos_token_id" in meta else []
    )
    tokens, kinds = meta.get("tokenizer.ggml.tokens") or [], meta.get("tokenizer.ggml.token_type")
    index = {token: i for i, token in enumerate(tokens) if token in END_OF_TURN}
    for i in index.values():
        if (kinds is None or int(kinds[i]) == _CONTROL) and i not in ids:
            ids.append(i)
    return ids


def _plain(value: Any) -> Any:
    """numpy arrays (scores, token types) as lists: the builders iterate and compare them."""
    return value.tolist() if hasattr(value, "tolist") else value
