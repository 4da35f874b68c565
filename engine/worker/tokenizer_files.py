"""A model directory's tokenizer, loaded: the Hugging Face tokenizer (the front's and the offline engine's: text,
chat templates, stop strings) and what structured output's grammars need of it. No torch and no model code here:
the front and the grammar workers import this, not the loader."""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from engine.free_heap import release_free_heap
from engine.output.grammar_tokenizer import read_tokenizer


_TRANSFORMERS_IMPORT = threading.Lock()


def load_tokenizer(path: Path | str | None) -> Any | None:
    """The directory's tokenizer (None without a directory or a tokenizer in it), safe to share between threads
    (``fix_settings``). With a tokenizer.json the fast class loads it directly: AutoTokenizer would first import
    transformers' whole tokenizer registry (seconds) to pick the same class."""
    if path is None:
        return None
    path = Path(path)
    if (path / "tokenizer.json").is_file():
        # (one import at a time: transformers' lazy module fails a name that two threads import at once)
        with _TRANSFORMERS_IMPORT:
            from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    elif (path / "tokenizer.model").is_file() or (path / "tokenizer_config.json").is_file():
        with _TRANSFORMERS_IMPORT:
            from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
    else:
        return None
    fix_settings(tokenizer)
    release_free_heap()  # (the JSON's parse leaves several times the tokenizer's size free)
    return tokenizer


_early: tuple[Path, Future] | None = None


def load_tokenizer_early(path: Path) -> None:
    """Start ``load_tokenizer(path)`` on a thread now (``pagedchat serve`` does, before it imports torch: the load
    holds the GIL for a second, and the front's own start waits for it anyway); ``take_early_tokenizer`` gives it."""
    global _early
    if _early is None:
        executor = ThreadPoolExecutor(1, thread_name_prefix="pagedchat-tokenizer")
        _early = (Path(path), executor.submit(load_tokenizer, path))
        executor.shutdown(wait=False)


def take_early_tokenizer(path: Path) -> Future | None:
    """The Future of the load ``load_tokenizer_early`` started, once, if it was for ``path`` (None otherwise)."""
    global _early
    early, _early = _early, None
    return early[1] if early is not None and early[0] == Path(path) else None


def fix_settings(tokenizer: Any) -> None:
    """Set once what an encode would otherwise set on the Rust tokenizer (no truncation, no padding, the class's
    split of special tokens), so that no encode or decode ever mutates it: a mutation takes the Rust object
    exclusively and fails ("Already borrowed") while another thread encodes or decodes with it. The server's
    prompt thread and its detokenizer share one tokenizer this way (a copy costs seconds and ~100 MiB for a
    262k-token vocabulary); nothing in the server encodes with truncation or padding (chat_template_kwargs
    refuses them)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None:
        return
    if backend.truncation is not None:
        backend.no_truncation()
    if backend.padding is not None:
        backend.no_padding()
    split = bool(getattr(tokenizer, "split_special_tokens", False))
    if backend.encode_special_tokens != split:
        backend.encode_special_tokens = split


def grammar_source(path: Path | str | None) -> Any | None:
    """What structured output's grammars need of the directory's tokenizer: its tokenizer.json's text where it has
    one (llguidance parses it: no Hugging Face tokenizer in memory, engine/output/grammar_tokenizer.py), else the
    loaded tokenizer; None without one."""
    return read_tokenizer(path) or load_tokenizer(path)


def grammar_source_loading(path: Path | str) -> Future:
    """``grammar_source(path)`` on a thread of its own: its result when done."""
    executor = ThreadPoolExecutor(1, thread_name_prefix="pagedchat-tokenizer")
    future = executor.submit(grammar_source, path)
    executor.shutdown(wait=False)
    return future


def eos_token_ids(eos: Any, path: Path | str | None) -> tuple[int, ...]:
    """The model's end ids: ``eos`` (its config's), or generation_config.json's where the directory has one (chat
    models list their end-of-turn there)."""
    if path is not None and (Path(path) / "generation_config.json").is_file():
        eos = json.loads((Path(path) / "generation_config.json").read_text()).get(
            "eos_token_id", eos
        )
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
