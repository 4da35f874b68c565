"""IncrementalDetokenizer: token-by-token text equals a full decode, deltas never carry a broken character or
a (possibly partial) stop string, and stop strings cut the text where vLLM would."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from engine.output.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"

TEXTS = [
    "Hello, world! This is a test.",
    "  leading spaces, trailing spaces  ",
    "line one\nline two\n\n\tindented\r\nwindows line",
    "def f(x):\n    return x * 2  # double\n",
    "東京都に行きました。終わり。その後、家に帰りました。",
    "你好，世界！我们今天学习中文。",
    "한국어 문장도 있습니다.",
    "Party time 🎉!! 🚀🔥 and then 👍🏽 done",
    "family 👨‍👩‍👧 flags 🇯🇵🇫🇷 keycap 1️⃣",
    "café naïve résumé Ångström façade crème brûlée",
    "combining: e\u0301 a\u0308 n\u0303",
    " Ελληνικά και русский текст",
    "mixed: price €42, 10°C, ½ cup, ∑ x² ≤ ∞",
]


@pytest.fixture(scope="module")
def tok(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """The default model's tokenizer (conftest's session fixture)."""
    return tokenizer


@pytest.fixture(scope="module")
def prompt_ids(tok: PreTrainedTokenizerBase) -> list[int]:
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Say something."}], add_generation_prompt=True, tokenize=False
    )
    return tok.encode(text, add_special_tokens=False)


def _encode(tok: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _stream(
    detok: IncrementalDetokenizer, ids: list[int], chunks: list[int] | None = None
) -> tuple[list[str], str | None, int]:
    """Feed ids (one at a time, or in the given chunk sizes) like the engine would; return the deltas, the
    matched stop string and how many ids were fed before it matched."""
    chunks = chunks or [1] * len(ids)
    deltas: list[str] = []
    fed = 0
    for size in chunks:
        stop = detok.update(ids[fed : fed + size])
        fed += size
        if stop is not None:
            deltas.append(detok.take_delta(finished=True))
            return deltas, stop, fed
        deltas.append(detok.take_delta(finished=False))
    deltas.append(detok.take_delta(finished=True))
    return deltas, None, fed


def _random_chunks(rng: random.Random, n: int) -> list[int]:
    chunks: list[int] = []
    while sum(chunks) < n:
        chunks.append(min(rng.randint(1, 4), n - sum(chunks)))
    return chunks


def _random_text(rng: random.Random) -> str:
    alphabet = "abcdefXYZ  \n\t.,!?'0123éüñçß东京你好世界한국🎉🚀👍🏽😀€°½∑"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_full_decode(tok, prompt_ids, text):
    ids = _encode(tok, text)
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams())
    _, stop, _ = _stream(detok, ids)
    assert stop is None
    assert detok.text == tok.decode(ids, skip_special_tokens=True)


def test_random_texts_in_random_chunks_equal_full_decode(tok, prompt_ids):
    rng = random.Random(1234)
    for _ in range(300):
        ids = _encode(tok, _random_text(rng))
        detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams())
        deltas, _, _ = _stream(detok, ids, _random_chunks(rng, len(ids)))
        expected = tok.decode(ids, skip_special_tokens=True)
        assert detok.text == expected
        assert "".join(deltas) == expected


@pytest.mark.parametrize("text", TEXTS)
def test_concatenated_deltas_equal_final_text(tok, prompt_ids, text):
    ids = _encode(tok, text)
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams())
    deltas, _, _ = _stream(detok, ids)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("text", [t for t in TEXTS if not t.isascii()])
def test_multibyte_characters_never_broken_in_deltas(tok, prompt_ids, text):
    ids = _encode(tok, text)
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams())
    deltas, _, _ = _stream(detok, ids)
    assert all(REPLACEMENT_CHAR not in delta for delta in deltas)
    assert REPLACEMENT_CHAR not in detok.text


def test_multibyte_test_texts_really_split_characters_across_tokens(tok):
    # Guards the test above: without tokens that decode to U+FFFD on their own it would prove nothing.
    for text in ["東京都に行きました。", "Party time 🎉!!", "family 👨‍👩‍👧"]:
        assert any(REPLACEMENT_CHAR in tok.decode([i]) for i in _encode(tok, text))


def test_first_output_token_keeps_its_leading_space(tok, prompt_ids):
    ids = _encode(tok, " Hello there")
    for prompt in (prompt_ids, []):
        detok = IncrementalDetokenizer(tok, prompt, SamplingParams())
        detok.update(ids[:1])
        assert detok.take_delta(finished=False) == tok.decode(ids[:1])
        assert detok.text.startswith(" Hello")


def _tiny_sentencepiece_style_tokenizer() -> PreTrainedTokenizerFast:
    # Metaspace ("▁word") decoding drops the space of a text's first word, unlike byte-level BPE.
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "▁there": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


def test_prompt_context_keeps_first_output_space_for_sentencepiece_style_tokenizers():
    tok = _tiny_sentencepiece_style_tokenizer()
    prompt, output = tok.encode("Hello"), tok.encode("world there")
    assert tok.decode(output) == "world there"  # decoded alone, the first space is lost...
    expected = tok.decode(prompt + output)[len(tok.decode(prompt)) :]
    assert expected == " world there"  # ...but in context it is there
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams())
    deltas, _, _ = _stream(detok, output)
    assert detok.text == expected
    assert "".join(deltas) == expected


def test_prompt_text_is_not_part_of_output_or_stop_search(tok, prompt_ids):
    # The prompt ends with "assistant\n"; seeding the window with it must not leak into text or match a stop.
    assert tok.decode(prompt_ids).endswith("assistant\n")
    ids = _encode(tok, "Sure.")
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(stop=["assistant"]))
    _, stop, _ = _stream(detok, ids)
    assert stop is None
    assert detok.text == "Sure."


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens_is_honoured(tok, prompt_ids, skip):
    ids = _encode(tok, "Done.") + [tok.convert_tokens_to_ids("<|im_end|>")] + _encode(tok, " after")
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(skip_special_tokens=skip))
    deltas, _, _ = _stream(detok, ids)
    expected = tok.decode(ids, skip_special_tokens=skip)
    assert detok.text == expected
    assert "".join(deltas) == expected
    assert ("<|im_end|>" in expected) == (not skip)


@pytest.mark.parametrize(
    "text, stop",
    [
        ("The answer is 42. STOP_HERE and more", "STOP_HERE"),
        ("東京都に行きました。終わり。その後", "終わり"),
        ("Party time 🎉!! and then", "🎉!!"),
        ("hello world", "lo wo"),  # starts and ends inside tokens
    ],
)
def test_stop_string_split_across_tokens_never_leaks(tok, prompt_ids, text, stop):
    ids = _encode(tok, text)
    full = tok.decode(ids)
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(stop=[stop]))
    deltas, matched, fed = _stream(detok, ids)
    assert matched == stop
    assert detok.text == full[: full.index(stop)]
    assert "".join(deltas) == full[: full.index(stop)]
    assert all(stop not in delta for delta in deltas)
    # It matched on the very token that completed the stop string, not later.
    assert stop in tok.decode(ids[:fed]) and stop not in tok.decode(ids[: fed - 1])


def test_stop_string_spans_several_tokens(tok):
    # Guards the test above: the ASCII stop string really is cut into several tokens.
    pieces = [tok.decode([i]).strip() for i in _encode(tok, "The answer is 42. STOP_HERE and more")]
    inside_stop = [piece for piece in pieces if piece and piece in "STOP_HERE"]
    assert len(inside_stop) >= 3


def test_include_stop_str_in_output_keeps_the_stop_string(tok, prompt_ids):
    text, stop = "The answer is 42. STOP_HERE and more", "STOP_HERE"
    ids = _encode(tok, text)
    params = SamplingParams(stop=[stop], include_stop_str_in_output=True)
    detok = IncrementalDetokenizer(tok, prompt_ids, params)
    deltas, matched, _ = _stream(detok, ids)
    expected = text[: text.index(stop) + len(stop)]
    assert matched == stop
    assert detok.text == expected
    assert "".join(deltas) == expected


@pytest.mark.parametrize("chunked", [False, True])
def test_earliest_of_several_stop_strings_wins(tok, prompt_ids, chunked):
    # "world" is listed first but "hello" occurs first in the text, so "hello" wins even when both arrive
    # in the same update.
    text = "say hello to the world"
    ids = _encode(tok, text)
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(stop=["world", "hello"]))
    deltas, matched, _ = _stream(detok, ids, [len(ids)] if chunked else None)
    assert matched == "hello"
    assert detok.text == text[: text.index("hello")]
    assert "".join(deltas) == text[: text.index("hello")]


def test_same_start_stop_strings_shorter_wins(tok, prompt_ids):
    text = "abc def"
    ids = _encode(tok, text)
    params = SamplingParams(stop=["abc d", "abc"], include_stop_str_in_output=True)
    detok = IncrementalDetokenizer(tok, prompt_ids, params)
    assert detok.update(ids) == "abc"
    assert detok.text == "abc"


def test_partial_stop_prefix_that_diverges_is_released(tok, prompt_ids):
    text, stop = "Go to the park.", "the end"
    ids = _encode(tok, text)
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(stop=[stop]))
    sent = ""
    for k in range(1, len(ids) + 1):
        assert detok.update(ids[k - 1 : k]) is None
        sent += detok.take_delta(finished=False)
        so_far = tok.decode(ids[:k])
        if so_far.endswith(" the"):
            # Ambiguous: "the" may be the start of "the end", so it is held back...
            assert sent == so_far[: -len("the")]
        else:
            # ...and released as soon as the next token rules the stop string out.
            assert sent == so_far
    assert sent == text


def test_finished_flushes_held_back_text(tok, prompt_ids):
    text, stop = "I will now say the", "the end"
    ids = _encode(tok, text)
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(stop=[stop]))
    assert detok.update(ids) is None
    assert detok.take_delta(finished=False) == text[: -len("the")]
    assert detok.take_delta(finished=True) == "the"
    assert detok.take_delta(finished=True) == ""


def test_update_after_stop_is_an_error(tok, prompt_ids):
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(stop=["world"]))
    assert detok.update(_encode(tok, "hello world")) == "world"
    with pytest.raises(RuntimeError):
        detok.update(_encode(tok, " again"))


class _DecodeLengthSpy:
    """Wraps a tokenizer and records the longest id list passed to decode."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.longest = 0

    def decode(self, ids: list[int], **kwargs: object) -> str:
        self.longest = max(self.longest, len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def test_each_step_decodes_a_small_window_not_the_whole_output(tok, prompt_ids):
    ids = _encode(tok, "the quick brown fox jumps over the lazy dog 🎉 東京 " * 40)
    spy = _DecodeLengthSpy(tok)
    detok = IncrementalDetokenizer(spy, prompt_ids, SamplingParams())
    _stream(detok, ids)
    assert len(ids) > 400
    assert spy.longest <= 12
    assert detok.text == tok.decode(ids)
