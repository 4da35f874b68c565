"""The grammar library's form of a model's tokenizer (an ``llguidance.LLTokenizer``), built from the model's
tokenizer.json without loading the Hugging Face tokenizer.

llguidance's usual constructor (``llguidance.hf.from_tokenizer``) takes a loaded transformers tokenizer and hands
its JSON form to ``LLTokenizer``, which parses it again into a tokenizer of its own: the process then holds both.
For Gemma 3's 262k-token vocabulary that is ~420 MiB for the transformers tokenizer (and transformers and torch
imported, ~300 MiB more) beside llguidance's ~310 MiB, in the engine core and in each grammar worker. Here
``LLTokenizer`` is given the file itself (its path: read in Rust, no Python string of it; Gemma 3's 33 MB file as a
str is 128 MiB, its characters four bytes each), or, where tokenizer_config.json lists tokens the file lacks, its
text with those added (as transformers adds them as it loads): the same JSON it would have been given, so masks and
the text llguidance tokenizes are the same, and the process holds llguidance's tokenizer alone.
tests/engine/test_grammar_tokenizer.py holds both forms equal token for token.

No torch and no transformers here: the grammar workers import this, numpy and llguidance only.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class TokenizerFile:
    """A model's tokenizer.json: llguidance reads ``path``, or parses ``text`` (the file with tokens added) where
    that is not None."""

    path: Path
    text: str | None = None


def read_tokenizer(model_dir: Path | str | None) -> TokenizerFile | None:
    """``model_dir``'s tokenizer.json; None without one (a tokenizer.model alone: the loaded tokenizer is the way)."""
    if model_dir is None or not (path := Path(model_dir) / "tokenizer.json").is_file():
        return None
    config = path.with_name("tokenizer_config.json")
    listed = (
        json.loads(config.read_text(encoding="utf-8")).get("added_tokens_decoder")
        if config.is_file()
        else None
    )
    if not listed:
        return TokenizerFile(path)
    text = path.read_text(encoding="utf-8")
    known = {a["id"] for a in _added_tokens(text)}
    missing = [
        {"id": int(i), "content": a["content"], "special": bool(a.get("special"))}
        for i, a in listed.items()
        if int(i) not in known
    ]
    if missing:
        spec = json.loads(text)
        spec["added_tokens"] = [*spec.get("added_tokens", []), *_added(missing)]
        return TokenizerFile(path, json.dumps(spec, ensure_ascii=False))
    return TokenizerFile(path)


_ADDED_KEY = re.compile(r'"added_tokens"\s*:\s*')
_HEAD_CHARS = (
    4096  # where the tokenizers library writes the key: after version, truncation and padding
)


def _added_tokens(text: str) -> list[dict[str, Any]]:
    """tokenizer.json's ``added_tokens``: that array alone where the tokenizers library writes it (the top level's
    fourth key, in the first few kB: a 262k-token file is not parsed whole for it), else from the whole file."""
    key = _ADDED_KEY.search(text, 0, _HEAD_CHARS)
    head = text[: key.start()] if key else ""
    if key and "[" not in head and head.count("{") - head.count("}") == 1:
        with contextlib.suppress(ValueError):
            value, _ = json.JSONDecoder().raw_decode(text, key.end())
            if isinstance(value, list):
                return value
    return json.loads(text).get("added_tokens", [])


def _added(tokens: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Added-token entries as tokenizer.json writes them."""
    return [
        {
            "id": t["id"],
            "content": t["content"],
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": not t["special"],
            "special": t["special"],
        }
        for t in tokens
    ]


def grammar_tokenizer(
    source: TokenizerFile | Any, vocab_size: int, eos_token_ids: list[int]
) -> Any:
    """The ``LLTokenizer`` with ``vocab_size`` ids (the model's: ids past the tokenizer's are placeholders no
    grammar allows) and these end ids, from a TokenizerFile or a loaded Hugging Face fast tokenizer. ValueError
    without llguidance."""
    try:
        import llguidance
    except ImportError as exc:
        raise ValueError("response_format: structured output needs the llguidance package") from exc
    eos = eos_token_ids or None
    if isinstance(source, TokenizerFile):
        # (a str not starting with "{" is a path for llguidance; an absolute one, so never a hub name)
        spec = source.text if source.text is not None else str(source.path.resolve())
        return llguidance.LLTokenizer(spec, n_vocab=vocab_size, eos_token=eos)
    import llguidance.hf

    return llguidance.hf.from_tokenizer(source, n_vocab=vocab_size, eos_token=eos)
