"""The grammar library's tokenizer built from the model's tokenizer.json (engine/output/grammar_tokenizer.py) is
llguidance's own reading of the loaded Hugging Face tokenizer: every id's bytes and specialness, the text it
tokenizes and the masks of a schema step by step are equal, on a byte-level BPE (the default model), Qwen3's
tokenizer as a GGUF file describes it, and a SentencePiece-style byte-fallback BPE whose tokenizer_config.json lists
an added token tokenizer.json lacks (transformers adds it as it loads; so must the file's reading)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.output.grammar_compiler import GrammarCompiler
from engine.output.grammar_tokenizer import TokenizerFile, grammar_tokenizer, read_tokenizer
from engine.sampling_params import StructuredOutput
from engine.worker.tokenizer_files import load_tokenizer
from engine.worker.model_sources import resolve_model
from tests.tiny_qwen3 import cached_tiny_qwen3_gguf

TEXTS = ["Hello world", ' {"name": "Ada", "tags": ["x y"]}', "naïve café 東京 <b>bold</b>\n\tend"]
SCHEMA = StructuredOutput(
    "json_schema",
    json.dumps(
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
            "required": ["name", "n"],
        }
    ),
)


def byte_fallback_dir(root: Path) -> Path:
    """A SentencePiece-style BPE (metaspace, byte fallback, '▁' decoded as a space) trained here, with a special
    added token, an added token that looks special (``<b>``), and one only tokenizer_config.json lists."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    alphabet = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<s>", "</s>", *alphabet], show_progress=False
    )
    corpus = ["the quick brown fox jumps over the lazy dog", 'a "name": 12, "n": 3 {} []'] * 50
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.add_tokens(["<b>", "plain added"])
    root.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(root / "tokenizer.json"))
    late = tokenizer.get_vocab_size()
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "</s>",
        "added_tokens_decoder": {str(late): {"content": "<|late|>", "special": True}},
    }
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


@pytest.fixture(scope="module", params=["byte-level", "qwen3-gguf", "byte-fallback"])
def model_dir(request, default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if request.param == "byte-level":
        return default_model_dir
    if request.param == "qwen3-gguf":
        return resolve_model(str(cached_tiny_qwen3_gguf()), Path(EngineConfig().cache_dir))
    return byte_fallback_dir(tmp_path_factory.mktemp("spm"))


def both(model_dir: Path) -> tuple[object, object, int]:
    loaded = load_tokenizer(model_dir)
    vocab_size = len(loaded) + 7  # (a model's padded vocabulary: ids no tokenizer has)
    eos = [loaded.eos_token_id]
    read = read_tokenizer(model_dir)
    assert isinstance(read, TokenizerFile)
    return (
        grammar_tokenizer(read, vocab_size, eos),
        grammar_tokenizer(loaded, vocab_size, eos),
        vocab_size,
    )


def test_every_token_reads_as_from_the_loaded_tokenizer(model_dir: Path):
    from_file, from_loaded, vocab_size = both(model_dir)
    assert from_file.vocab_size == from_loaded.vocab_size == vocab_size
    assert from_file.eos_tokens == from_loaded.eos_tokens
    differ = [
        i
        for i in range(vocab_size)
        if from_file.decode_bytes([i]) != from_loaded.decode_bytes([i])
        or from_file.is_special_token(i) != from_loaded.is_special_token(i)
    ]
    assert not differ, f"ids read differently: {differ[:10]}"
    specials = sum(from_file.is_special_token(i) for i in range(vocab_size))
    assert specials >= 2, "the special tokens were found"
    for text in TEXTS:
        assert from_file.tokenize_str(text) == from_loaded.tokenize_str(text)


def test_a_schema_has_the_same_masks_step_by_step(model_dir: Path):
    loaded = load_tokenizer(model_dir)
    args = (len(loaded), (loaded.eos_token_id,))
    matchers = [
        GrammarCompiler(source, *args).matcher(SCHEMA)
        for source in (read_tokenizer(model_dir), loaded)
    ]
    words = -(-len(loaded) // 32)
    for _ in range(12):
        masks = []
        for matcher in matchers:
            mask = np.zeros(words, dtype=np.int32)
            matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            masks.append(mask)
        assert np.array_equal(*masks)
        allowed = np.unpackbits(masks[0].view(np.uint8), bitorder="little").nonzero()[0]
        token = int(next(t for t in allowed if t != loaded.eos_token_id))
        assert all(m.consume_token(token) for m in matchers)


def test_the_added_token_only_the_config_lists_is_read(model_dir: Path):
    read = read_tokenizer(model_dir)
    listed = json.loads((model_dir / "tokenizer_config.json").read_text()).get(
        "added_tokens_decoder", {}
    )
    in_file = {
        a["id"] for a in json.loads((model_dir / "tokenizer.json").read_text())["added_tokens"]
    }
    late = [int(i) for i in listed if int(i) not in in_file]
    if model_dir.name.startswith("spm"):
        assert late, "the byte-fallback tokenizer has one token only its config lists"
    # (the file itself where it lists every token: llguidance reads it by its path, no text in Python)
    assert (read.text is None) == (not late)
    added = {a["id"] for a in json.loads(read.text or read.path.read_text())["added_tokens"]}
    assert set(late) <= added


def test_no_tokenizer_file_is_none_and_a_grammar_then_says_so(tmp_path: Path):
    assert read_tokenizer(tmp_path) is None and read_tokenizer(None) is None
    with pytest.raises(ValueError, match="has no tokenizer"):
        GrammarCompiler(None, 10, (1,)).matcher(StructuredOutput("json_object"))


def test_a_loading_tokenizer_is_built_for_the_grammar_library_only_when_asked(
    default_model_dir: Path,
):
    """The engine core asks once idle after its start (the build holds the GIL for seconds: at construction it
    delayed the core's readiness); asked twice, one build; a grammar works after it, and before it (built then)."""
    from engine.worker.tokenizer_files import grammar_source_loading

    def warm_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "pagedchat-grammar-warm"]

    loaded = load_tokenizer(default_model_dir)
    eos = (loaded.eos_token_id,)
    future = grammar_source_loading(default_model_dir)
    compiler = GrammarCompiler(future, len(loaded), eos)
    future.result(timeout=60)
    time.sleep(0.2)
    assert not warm_threads(), "nothing is built before warm_in_background"
    compiler.warm_in_background()
    compiler.warm_in_background()
    assert len(warm_threads()) == 1
    warm_threads()[0].join(timeout=120)
    assert compiler.matcher(StructuredOutput("json_object")) is not None
    unasked = GrammarCompiler(grammar_source_loading(default_model_dir), len(loaded), eos)
    assert unasked.matcher(SCHEMA) is not None and not warm_threads()
