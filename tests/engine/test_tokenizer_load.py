"""How a model's tokenizer is loaded (engine/worker/tokenizer_files.py, engine/weights/gguf_model_dir.py): a GGUF
file's described directory lists its added tokens in tokenizer_config.json, so transformers loads it without
parsing the whole tokenizer.json in Python, into the same tokenizer; the grammar library's reading finds those
tokens without a whole parse either; and a loaded tokenizer has its truncation, padding and special-token split
fixed, so that the server's prompt thread and its detokenizer share it without either one mutating it."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.output.grammar_tokenizer import _added_tokens
from engine.weights.gguf_model_dir import gguf_model_dir
from engine.worker.tokenizer_files import load_tokenizer
from tests.tiny_qwen3 import cached_tiny_qwen3_gguf

TEXTS = [
    "Hello world",
    "<|im_start|>user\nhi<|im_end|>\n<think>x</think>",
    "naïve café 東京 <tool_call>{}</tool_call>",
]


@pytest.fixture(scope="module")
def described() -> Path:
    return gguf_model_dir(cached_tiny_qwen3_gguf(), Path(EngineConfig().cache_dir))


def without_listing(described: Path, root: Path) -> Path:
    """A copy of ``described`` whose tokenizer_config.json lacks ``added_tokens_decoder`` (as the directories
    described before it was listed)."""
    copy = root / "unlisted"
    shutil.copytree(described, copy)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    del config["added_tokens_decoder"]
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    return copy


def test_the_description_lists_every_added_token_of_its_tokenizer_json(described: Path):
    listed = json.loads((described / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    in_file = json.loads((described / "tokenizer.json").read_text())["added_tokens"]
    assert len(in_file) > 10, "Qwen3's added tokens"
    assert {int(i): t for i, t in listed.items()} == {
        t["id"]: {k: v for k, v in t.items() if k != "id"} for t in in_file
    }


def test_the_listed_directory_loads_without_parsing_tokenizer_json_into_the_same_tokenizer(
    described: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    reference = load_tokenizer(without_listing(described, tmp_path))
    read: list[str] = []
    real_load = json.load

    def recording_load(handle, *args, **kwargs):
        read.append(Path(getattr(handle, "name", "")).name)
        return real_load(handle, *args, **kwargs)

    monkeypatch.setattr(json, "load", recording_load)
    loaded = load_tokenizer(described)
    monkeypatch.undo()
    assert "tokenizer_config.json" in read, "the recording saw transformers' reads"
    assert "tokenizer.json" not in read
    assert loaded.added_tokens_decoder == reference.added_tokens_decoder
    assert loaded.all_special_ids == reference.all_special_ids
    for text in TEXTS:
        ids = loaded.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text, add_special_tokens=False)
        assert loaded.decode(ids) == reference.decode(ids) == text


def test_the_added_tokens_are_read_alone_or_from_the_whole_file(described: Path):
    text = (described / "tokenizer.json").read_text()
    whole = json.loads(text)
    assert _added_tokens(text) == whole["added_tokens"]
    # keys in another order (a hand-written file): the whole file is parsed, with the same answer
    reordered = {k: v for k, v in whole.items() if k != "added_tokens"}
    reordered["added_tokens"] = whole["added_tokens"]
    assert _added_tokens(json.dumps(reordered)) == whole["added_tokens"]
    # a decoy in a value before the key: not taken for it
    decoy = {"version": "1.0", "note": '"added_tokens": [1]', **reordered}
    assert _added_tokens(json.dumps(decoy)) == whole["added_tokens"]


def with_truncation_and_padding(described: Path, root: Path) -> Path:
    from tokenizers import Tokenizer

    copy = root / "truncating"
    shutil.copytree(described, copy)
    backend = Tokenizer.from_file(str(copy / "tokenizer.json"))
    backend.enable_truncation(8)
    backend.enable_padding(length=12)
    backend.save(str(copy / "tokenizer.json"))
    return copy


def test_no_encode_or_decode_mutates_a_loaded_tokenizer_so_two_threads_share_it(
    described: Path, tmp_path: Path
):
    tokenizer = load_tokenizer(with_truncation_and_padding(described, tmp_path))
    backend = tokenizer.backend_tokenizer
    assert backend.truncation is None and backend.padding is None, "fixed at load"
    split = tokenizer.split_special_tokens
    long_text = " ".join(TEXTS * 40)
    expected = tokenizer.encode(long_text, add_special_tokens=False)
    assert len(expected) > 100, "not truncated to the file's 8"
    failures: list[BaseException] = []
    stop = time.monotonic() + 1.5

    def encode_loop() -> None:
        try:
            while time.monotonic() < stop:
                assert tokenizer.encode(long_text, add_special_tokens=False) == expected
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failures.append(exc)

    thread = threading.Thread(target=encode_loop)
    thread.start()
    decoded = 0
    while thread.is_alive():
        assert tokenizer.decode(expected[:64], skip_special_tokens=False)
        decoded += 1
    thread.join()
    assert not failures, failures[0]
    assert decoded > 10
    assert backend.truncation is None and backend.padding is None
    assert backend.encode_special_tokens == split


def test_an_early_load_is_given_once_and_for_its_own_directory(described: Path, tmp_path: Path):
    from engine.worker import tokenizer_files

    tokenizer_files.load_tokenizer_early(described)
    assert tokenizer_files.take_early_tokenizer(tmp_path) is None, "another directory's"
    assert tokenizer_files.take_early_tokenizer(described) is None, "given up by the first take"
    tokenizer_files.load_tokenizer_early(described)
    loading = tokenizer_files.take_early_tokenizer(described)
    assert loading is not None and tokenizer_files.take_early_tokenizer(described) is None
    loaded = loading.result(timeout=60)
    assert loaded.encode(TEXTS[1]) == load_tokenizer(described).encode(TEXTS[1])


async def test_the_engine_takes_the_tokenizer_serve_started_loading():
    from engine.async_engine import AsyncEngine
    from engine.worker import tokenizer_files
    from engine.worker.model_sources import ensure_default_model
    from tests.conftest import SMALL_KV_GIB

    path = ensure_default_model(Path(EngineConfig().cache_dir))
    tokenizer_files.load_tokenizer_early(path)
    loading = tokenizer_files._early[1]
    engine = AsyncEngine(kv_cache_memory_gib=SMALL_KV_GIB)
    await engine.start()
    try:
        assert engine.tokenizer is loading.result()
    finally:
        await engine.stop()
