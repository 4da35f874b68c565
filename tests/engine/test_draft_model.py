"""Speculative decoding with a draft model (``speculative_model``, engine/worker/draft_model.py): a second model
proposes, the target verifies, so greedy output is plain decoding's (and transformers', float32) token for token
whatever the draft says, under preemption, chunked prefill, n > 1, seeds and a grammar; the draft's KV lives in
the target's blocks and is brought up to date before each proposal (a catch-up prefill from the positions it
holds right), so a draft equal to the target has its drafts accepted.

Two drafts: the default model itself (its drafts should all be right: a check that the draft's KV holds exactly
the target's tokens) and a tiny random Llama with the same vocabulary (its drafts are mostly wrong: rejection).
Every test checks the speculation counters, so none passes with speculation silently off."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams, StructuredOutput
from engine.speculative import speculator as speculator_module
from engine.worker.model_sources import default_gguf_file
from tests.block_invariants import run_checked_outputs
from tests.conftest import SMALL_KV_GIB, hf_greedy
from tests.greedy_agreement import assert_transformers_greedy
from tests.two_layer_llama import two_layer_llama_config

NEW_TOKENS = 32
TEXTS = [
    "The capital of France is",
    "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):",
    "Question: what is 12 times 12? Answer:",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(autouse=True)
def always_draft(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every decode row gets as many drafts as fit (not as the measured step prices advise)."""
    monkeypatch.setattr(speculator_module, "choose_draft_length", lambda state, limit, *_: limit)


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random two-layer Llama with the default model's vocabulary and context (its drafts mostly miss)."""
    return tiny_llama(tmp_path_factory.mktemp("tiny-draft"), 49152)


def tiny_llama(path: Path, vocab_size: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(7)
    fields = two_layer_llama_config(
        vocab_size=vocab_size,
        hidden_size=64,
        head_dim=16,
        intermediate_size=128,
        bos_token_id=1,
        eos_token_id=2,
    )
    config = LlamaConfig(
        **{k: v for k, v in fields.items() if k not in ("model_type", "architectures")}
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(kv_cache_memory_gib=SMALL_KV_GIB)


@pytest.fixture(scope="module")
def self_drafted() -> LLM:
    """The default model drafting for itself."""
    return LLM(kv_cache_memory_gib=SMALL_KV_GIB, speculative_model=str(default_gguf_file()))


@pytest.fixture(scope="module")
def prompts(plain: LLM) -> list[list[int]]:
    return [plain.tokenizer.encode(t) for t in TEXTS]


def counts(llm: LLM) -> tuple[int, int, int]:
    s = llm.engine.stats()
    return s.spec_verifications, s.spec_draft_tokens, s.spec_accepted_tokens


def generate_counted(llm: LLM, prompts, params):
    before = counts(llm)
    outputs = llm.generate(prompts, params)
    return outputs, tuple(b - a for a, b in zip(before, counts(llm)))


def token_ids(outputs) -> list[list[int]]:
    return [list(o.token_ids) for o in outputs]


def assert_idle_and_no_leaks(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert not llm.engine.has_unfinished_requests()
    assert stats.num_free_blocks == stats.num_blocks, "blocks leaked"


def test_a_draft_equal_to_the_model_has_its_drafts_accepted(plain: LLM, self_drafted: LLM, prompts):
    """The draft's KV is caught up over each prompt and kept right through verifications (rejected rows
    overwritten), so the same model drafting for itself proposes the target's own greedy tokens."""
    expected = token_ids(plain.generate(prompts, GREEDY))
    outputs, (verified, drafted, accepted) = generate_counted(self_drafted, prompts, GREEDY)
    assert token_ids(outputs) == expected
    assert verified > 0 and drafted >= 2 * verified
    assert accepted >= 0.9 * drafted, f"{accepted} of {drafted} drafts accepted"
    assert self_drafted.engine.stats().steps < 3 * NEW_TOKENS
    assert_idle_and_no_leaks(self_drafted)


def test_a_prefix_cached_prompt_keeps_the_drafts_right(self_drafted: LLM, prompts):
    """A prompt that extends an earlier one hits its cached blocks, which hold the target's KV: the draft's is
    caught up over the whole prompt before its first proposal, so the drafts stay right."""
    first = prompts[1] + [13] * 20
    self_drafted.generate([first], GREEDY)
    cached = self_drafted.engine.stats().prefix_hits
    outputs, (_, drafted, accepted) = generate_counted(self_drafted, [first + [13] * 5], GREEDY)
    assert self_drafted.engine.stats().prefix_hits - cached >= 32
    assert len(outputs[0].token_ids) == NEW_TOKENS
    assert drafted > 0 and accepted >= 0.9 * drafted


def test_greedy_output_equals_transformers_float32_with_a_wrong_draft(
    hf_model, tiny_draft, prompts
):
    """A float32 target with a random draft: drafts rejected (and some accepted by chance or not), the output
    transformers' greedy tokens."""
    llm = LLM(
        cpu_weights="float32", kv_cache_memory_gib=SMALL_KV_GIB, speculative_model=str(tiny_draft)
    )
    chosen = prompts[:2]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs, (verified, drafted, accepted) = generate_counted(llm, chosen, greedy)
    assert verified > 0 and drafted > accepted, "the random draft's drafts should miss"
    expected = [hf_greedy(hf_model, p, 16) for p in chosen]
    assert_transformers_greedy(hf_model, chosen, token_ids(outputs), expected)


def test_preemption_parallel_samples_and_chunks_keep_output_and_invariants(plain: LLM, prompts):
    """A pool with room for the longest request alone (preemption), a token budget of 12 (prefill chunks),
    n = 2 greedy samples (forks sharing blocks): the pool's invariants after every step, every sample the single
    greedy answer, nothing leaked."""
    longest = max(len(p) for p in prompts) + NEW_TOKENS
    llm = LLM(
        speculative_model=str(default_gguf_file()),
        num_kv_blocks=-(-longest // 16) + 3,
        max_num_batched_tokens=12,
    )
    expected = token_ids(plain.generate(prompts, GREEDY))
    before = counts(llm)
    outputs = run_checked_outputs(llm.engine, prompts, replace(GREEDY, n=2))
    _, drafted, accepted = (b - a for a, b in zip(before, counts(llm)))
    assert token_ids(outputs) == expected
    assert llm.engine.stats().preemptions > 0, "the pool should have been too small for all at once"
    assert drafted > 0 and accepted > 0
    assert_idle_and_no_leaks(llm)


def test_seeded_sampling_and_a_grammar_equal_plain_decoding(plain: LLM, self_drafted: LLM, prompts):
    """A seeded sample draws each position's noise whatever the drafts (so drafts keep its distribution: the
    statistical test is test_speculative.py's, the same verification); under a JSON schema the drafts are cut
    to what the grammar accepts."""
    seeded = SamplingParams(temperature=0.9, seed=42, max_tokens=24, ignore_eos=True)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    structured = SamplingParams(
        temperature=0.0,
        max_tokens=24,
        structured_output=StructuredOutput(kind="json_schema", schema=json.dumps(schema)),
    )
    for params in (seeded, structured):
        expected = plain.generate(prompts[:2], params)
        outputs, (_, drafted, accepted) = generate_counted(self_drafted, prompts[:2], params)
        assert token_ids(outputs) == token_ids(expected)
        assert drafted > 0 and accepted > 0
    assert all(o.text.startswith('{"n"') for o in outputs), [o.text for o in outputs]
    assert_idle_and_no_leaks(self_drafted)


def test_a_draft_that_keeps_missing_is_probed_ever_less_often(tiny_draft, monkeypatch):
    """With every draft length chosen 0, a random draft's sequence gets one-draft probes (each a catch-up of the
    draft over the steps skipped), the wait doubling after each probe that misses."""
    llm = LLM(kv_cache_memory_gib=SMALL_KV_GIB, speculative_model=str(tiny_draft))
    monkeypatch.setattr(speculator_module, "choose_draft_length", lambda *_: 0)
    speculator = llm.engine.core.speculation.speculator
    accept, at = speculator.accept, []

    def recording(seq, num_drafts, sampled):
        at.append(len(seq.token_ids) - num_drafts)
        return accept(seq, num_drafts, sampled)

    monkeypatch.setattr(speculator, "accept", recording)
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    llm.generate([llm.tokenizer.encode(TEXTS[0])], params)
    gaps = [b - a for a, b in zip(at, at[1:])]
    assert len(at) >= 3 and all(later >= 1.8 * earlier for earlier, later in zip(gaps, gaps[1:])), (
        at
    )


def test_an_id_past_a_smaller_draft_vocabulary_is_read_as_its_last(tmp_path: Path, prompts):
    """A draft whose (padded) vocabulary is 100 ids short of the model's: a prompt holding an id in the gap is
    served with plain decoding's tokens, the draft reading it as its own last id."""
    draft = tiny_llama(tmp_path / "short", 49152 - 100)
    llm = LLM(kv_cache_memory_gib=SMALL_KV_GIB, speculative_model=str(draft))
    plain = LLM(kv_cache_memory_gib=SMALL_KV_GIB)
    prompt = prompts[0] + [49152 - 20, 49152 - 1] + prompts[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs, (_, drafted, _) = generate_counted(llm, [prompt], greedy)
    assert token_ids(outputs) == token_ids(plain.generate([prompt], greedy))
    assert drafted > 0
    assert_idle_and_no_leaks(llm)


@pytest.mark.parametrize(
    "options, field",
    [
        ({"speculative": "draft"}, "speculative_model"),
        ({"speculative": "ngram", "speculative_model": "x"}, "speculative_model"),
    ],
)
def test_config_rejects_a_draft_method_without_its_model(options, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        EngineConfig(**options)


def test_a_draft_of_another_vocabulary_or_a_shorter_context_is_refused(tmp_path: Path):
    other = tiny_llama(tmp_path / "other", 32000)
    with pytest.raises(ValueError, match="^speculative_model: .*vocabulary"):
        LLM(num_kv_blocks=8, speculative_model=str(other))
    short = tmp_path / "other" / "config.json"
    short.write_text(
        json.dumps(
            {**json.loads(short.read_text()), "max_position_embeddings": 64, "vocab_size": 49152}
        )
    )
    with pytest.raises(ValueError, match="^speculative_model: .*max_model_len"):
        LLM(num_kv_blocks=8, speculative_model=str(other))
