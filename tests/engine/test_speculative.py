"""Speculative decoding (n-gram drafts, engine/speculative/) changes how many tokens a step gives, never which
tokens: greedy output equals plain decoding's (and transformers') token for token, under preemption and chunked
prefill too; seeded samples, penalties, logit bias, min_tokens and logprobs are those of plain decoding; a stop
token or the length limit inside a run of accepted drafts ends the sample exactly there; and unseeded sampling
keeps the model's distribution (a chi-square test against the exact probabilities and against plain decoding).

Every test also checks the engine's counters, so none passes with speculation silently off. Prompts are chosen
for the proposer to fire: repeated text, code shown twice, an assistant turn answered the same way before."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import replace
from itertools import product

import pytest
import torch

from engine.config import EngineConfig
from engine.llm import LLM
from engine.output.outputs import RequestOutput
from engine.sampling_params import MAX_SPECULATIVE_CONTEXT, SamplingParams, StructuredOutput
from engine.speculative import speculator as speculator_module
from engine.speculative.draft_length import PROBE_AFTER
from tests.block_invariants import run_checked_outputs
from tests.conftest import SMALL_KV_GIB, hf_greedy
from tests.greedy_agreement import assert_transformers_greedy

NEW_TOKENS = 40

TEXTS = [
    "Repeat after me: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat,",
    "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add(",
    "The capital of France is",
    "Question: what is 12 times 12? Answer:",
    "A long story: " + "the quick brown fox jumps over the lazy dog, " * 6,
]
SAY_HI = [{"role": "user", "content": "Say hi"}]
HELLO = {"role": "assistant", "content": "Hello! How can I help you today?"}

GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(kv_cache_memory_gib=SMALL_KV_GIB)


@pytest.fixture(scope="module")
def spec() -> LLM:
    return LLM(kv_cache_memory_gib=SMALL_KV_GIB, speculative="ngram", num_speculative_tokens=4)


@pytest.fixture(scope="module")
def prompts(plain: LLM) -> list[list[int]]:
    return [plain.tokenizer.encode(t) for t in TEXTS] + [chat_prompt(plain)]


def chat_prompt(llm: LLM) -> list[int]:
    """A chat whose assistant said the same thing three times before: the fourth reply is a draft run with EOS
    inside it. (Not "Hi there! ... today?" twice: the 135M model's reply then hangs on near-ties that a kernel's
    rounding decides either way, and that reply's EOS ends a verification's run, with nothing after it.)"""
    return llm.chat_prompt_ids((SAY_HI + [HELLO]) * 3 + SAY_HI)


def spec_counts(llm: LLM) -> tuple[int, int, int]:
    """(verifications, draft tokens, accepted drafts) so far."""
    s = llm.engine.stats()
    return s.spec_verifications, s.spec_draft_tokens, s.spec_accepted_tokens


def generate_counted(llm: LLM, prompts, params) -> tuple[list[RequestOutput], tuple[int, int, int]]:
    """``llm.generate``'s outputs and the speculation counters' growth over the call."""
    before = spec_counts(llm)
    outputs = llm.generate(prompts, params)
    return outputs, tuple(b - a for a, b in zip(before, spec_counts(llm)))


def token_ids(outputs: list[RequestOutput]) -> list[list[int]]:
    return [list(o.token_ids) for o in outputs]


def assert_idle_and_no_leaks(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert not llm.engine.has_unfinished_requests()
    assert stats.num_free_blocks == stats.num_blocks, "blocks leaked"


@pytest.fixture
def always_draft(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every decode row with a proposal gets as many drafts as fit (the draft length no longer depends on the
    measured step prices): which tokens a verification covers is then a function of the tokens alone."""
    monkeypatch.setattr(speculator_module, "choose_draft_length", lambda state, limit, *_: limit)


def record_accepts(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, list[int]]]:
    """Each verification's (output index of its first token, the tokens it hands its sequence: accepted drafts
    and one more), as they come."""
    speculator = llm.engine.core.speculation.speculator
    accept, runs = speculator.accept, []

    def recording(seq, num_drafts, sampled):
        start = len(seq.token_ids) - num_drafts - seq.num_prompt_tokens
        runs.append((start, accept(seq, num_drafts, sampled)))
        return runs[-1][1]

    monkeypatch.setattr(speculator, "accept", recording)
    return runs


# ---------------------------------------------------------------- greedy equality


def test_greedy_output_equals_plain_decoding(plain: LLM, spec: LLM, prompts, always_draft):
    expected = token_ids(plain.generate(prompts, GREEDY))
    outputs, (verified, drafted, accepted) = generate_counted(spec, prompts, GREEDY)
    assert token_ids(outputs) == expected
    assert all(o.finish_reason == "length" for o in outputs)
    assert verified > 0 and drafted > 0, "no drafts proposed"
    assert accepted > NEW_TOKENS, "the repeated prompts' drafts are mostly accepted"
    assert_idle_and_no_leaks(spec)


def test_a_single_request_takes_one_step_less_per_accepted_draft(plain: LLM, spec: LLM, prompts):
    """A lone request's prefill gives its first token and each later step one token plus its accepted drafts:
    steps = 1 + (max_tokens - 1 - accepted), which holds only if every accepted draft is used."""
    expected = token_ids(plain.generate(prompts[0], GREEDY))
    steps = spec.engine.stats().steps
    outputs, (_, _, accepted) = generate_counted(spec, prompts[0], GREEDY)
    assert token_ids(outputs) == expected
    assert accepted > 0  # (how many: the draft length follows the learned step prices)
    assert spec.engine.stats().steps - steps == 1 + (NEW_TOKENS - 1 - accepted)


def test_greedy_output_equals_transformers_float32(hf_model, prompts, always_draft):
    chosen = [prompts[0], prompts[1], prompts[2]]
    llm = LLM(cpu_weights="float32", kv_cache_memory_gib=SMALL_KV_GIB, speculative="ngram")
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs, (_, drafted, accepted) = generate_counted(llm, chosen, greedy)
    assert drafted > 0 and accepted > 0
    expected = [hf_greedy(hf_model, p, 16) for p in chosen]
    assert_transformers_greedy(hf_model, chosen, token_ids(outputs), expected)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preemption_and_a_tiny_token_budget_keep_output_and_block_invariants(
    plain: LLM, prompts, always_draft, async_scheduling
):
    """A pool with room for the longest request alone and a token budget of 12 (prefills in chunks): the pool's
    invariants after every step (every block free or referenced, ref counts = table references), the plain
    tokens, and every block free at the end. With async scheduling too: a step that would give drafts reads
    the step in flight first (its rows' last tokens must be known), the others overlap as usual."""
    longest = max(len(p) for p in prompts) + NEW_TOKENS
    budget = 12
    llm = LLM(
        speculative="ngram",
        num_kv_blocks=-(-longest // 16) + 2,
        max_num_batched_tokens=budget,
        async_scheduling=async_scheduling,
    )
    expected = token_ids(plain.generate(prompts, GREEDY))
    before = spec_counts(llm)
    outputs = run_checked_outputs(llm.engine, prompts, GREEDY)
    _, drafted, accepted = (b - a for a, b in zip(before, spec_counts(llm)))
    assert token_ids(outputs) == expected
    stats = llm.engine.stats()
    assert stats.preemptions > 0, "the pool should have been too small for all prompts at once"
    assert stats.steps >= max(len(p) for p in prompts) // budget
    assert drafted > 0 and accepted > 0
    assert_idle_and_no_leaks(llm)


def test_greedy_parallel_samples_share_the_prompt_and_equal_the_single_answer(
    plain: LLM, spec: LLM, always_draft
):
    """n = 3 greedy samples forked from prompts ending just before and at a block boundary (31 and 32 tokens:
    the forks share the prompt's blocks, a draft must not write a shared one): every sample is the single
    greedy answer, the pool's invariants hold after every step, nothing leaks."""
    ids = plain.tokenizer.encode(TEXTS[0] + TEXTS[0])
    prompts = [ids[:31], ids[:32]]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    single = token_ids(plain.generate(prompts, params))
    before = spec_counts(spec)
    outputs = run_checked_outputs(spec.engine, prompts, replace(params, n=3))
    _, drafted, accepted = (b - a for a, b in zip(before, spec_counts(spec)))
    # (run_checked_outputs keeps each request's last final output: one sample of each)
    assert token_ids(outputs) == single
    samples = spec.generate(prompts, replace(params, n=3))
    assert token_ids(samples) == [single[0]] * 3 + [single[1]] * 3
    assert drafted > 0 and accepted > 0
    assert_idle_and_no_leaks(spec)


def test_blocks_written_by_verified_drafts_serve_prefix_hits(plain: LLM, spec: LLM, always_draft):
    """A later prompt that extends an earlier reply hits the blocks its verification steps filled: they hold
    the kept tokens' KV (a rejected draft's is overwritten before its block is cached), so the logprobs equal
    plain decoding's."""
    prompt = plain.tokenizer.encode(TEXTS[0] + TEXTS[0])[:32]
    (reply,) = token_ids(spec.generate(prompt, GREEDY))
    follow_up = prompt + reply[:30]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    (expected,) = plain.generate(follow_up, params)
    (got,), (_, drafted, _) = generate_counted(spec, follow_up, params)
    assert got.num_cached_tokens >= len(prompt) + 16, "a block of the reply is a hit"
    assert list(got.token_ids) == list(expected.token_ids) and drafted > 0
    for a, b in zip(got.logprobs, expected.logprobs):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-5)


def one_token_last_chunk(plain: LLM, n: int) -> tuple[list[list[int]], list[int], int]:
    """A 17-token prompt under a 16-token budget (no prefix cache): its last prefill chunk is one token, an entry
    shaped like a decode. Returns the ``n`` greedy samples' tokens, plain decoding's, and the drafts verified."""
    prompt = plain.tokenizer.encode(REPEATED)[:17]
    params = SamplingParams(n=n, temperature=0.0, max_tokens=16, ignore_eos=True)
    (expected,) = token_ids(plain.generate(prompt, replace(params, n=1)))
    llm = LLM(
        speculative="ngram",
        kv_cache_memory_gib=SMALL_KV_GIB,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
    )
    outputs, (_, drafted, _) = generate_counted(llm, prompt, params)
    assert_idle_and_no_leaks(llm)
    return token_ids(outputs), expected, drafted


def test_a_one_token_last_prefill_chunk_with_drafts_keeps_the_tokens(plain: LLM, always_draft):
    got, expected, drafted = one_token_last_chunk(plain, 1)
    assert got == [expected] and drafted > 0


def test_parallel_samples_forked_from_a_one_token_last_prefill_chunk(plain: LLM, always_draft):
    """The chunk's entry is decode-shaped, but its samples fork from its row: it gets no drafts (a drafted
    entry has no plain row to fork from)."""
    got, expected, drafted = one_token_last_chunk(plain, 2)
    assert got == [expected, expected] and drafted > 0


@pytest.mark.parametrize("speculative", [None, "ngram"], ids=["plain", "speculative"])
def test_swapped_parallel_samples_keep_their_tokens(plain: LLM, prompts, speculative, always_draft):
    """Two n = 2 requests in a pool with room for the longest alone, preempted by swapping: every sample is
    the single greedy answer (the prompts of 31 and 65 tokens: the second's samples share a partly filled
    last block when they are swapped out; it is swapped in and copied on write in one step, the swap-in
    first)."""
    chosen = [prompts[1], prompts[4]]
    assert [len(p) for p in chosen] == [31, 65]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    single = token_ids(plain.generate(chosen, params))
    llm = LLM(
        speculative=speculative,
        num_kv_blocks=-(-(65 + 40) // 16) + 2,
        max_num_batched_tokens=64,
        preemption_mode="swap",
        step_time_target_s=0.0,
    )
    outputs = llm.generate(chosen, replace(params, n=2))
    assert llm.engine.stats().preemptions > 0
    assert token_ids(outputs) == [single[0]] * 2 + [single[1]] * 2


# ---------------------------------------------------------------- sampling options as plain decoding


REPEATED = TEXTS[0]


def test_seeded_parallel_samples_equal_plain_decoding(plain: LLM, spec: LLM, always_draft):
    params = [
        SamplingParams(n=3, temperature=0.8, seed=1234, max_tokens=32, ignore_eos=True),
        SamplingParams(n=2, best_of=3, temperature=0.8, seed=99, max_tokens=24, ignore_eos=True),
    ]
    prompts = [REPEATED, TEXTS[1]]
    expected = plain.generate(prompts, params)
    outputs, (_, drafted, accepted) = generate_counted(spec, prompts, params)
    assert [(o.index, list(o.token_ids)) for o in outputs] == [
        (o.index, list(o.token_ids)) for o in expected
    ]
    assert len({tuple(o.token_ids) for o in outputs[:3]}) > 1, "the seeded samples should differ"
    for got, want in zip(
        outputs[3:], expected[3:]
    ):  # best_of: the same two of three, in the same order
        assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-4)
    assert drafted > 0 and accepted > 0
    assert_idle_and_no_leaks(spec)


def test_penalties_bias_and_logprobs_equal_plain_decoding(plain: LLM, spec: LLM, always_draft):
    tokenizer = plain.tokenizer
    the, cat = tokenizer.encode(" the")[0], tokenizer.encode(" cat")[0]
    base = {"temperature": 0.0, "max_tokens": 32, "ignore_eos": True}
    params = [
        SamplingParams(repetition_penalty=1.1, **base),
        SamplingParams(frequency_penalty=0.3, presence_penalty=0.2, **base),
        SamplingParams(logit_bias={the: -100.0, cat: 2.0}, **base),
        SamplingParams(logprobs=5, **base),
        SamplingParams(logprobs=3, temperature=0.7, seed=5, max_tokens=32, ignore_eos=True),
    ]
    prompts = [REPEATED, REPEATED, REPEATED, TEXTS[1], REPEATED]
    expected = plain.generate(prompts, params)
    outputs, (_, drafted, accepted) = generate_counted(spec, prompts, params)
    assert token_ids(outputs) == token_ids(expected)
    assert the not in outputs[2].token_ids
    for got, want in zip(outputs[3:], expected[3:]):
        assert len(got.logprobs) == len(want.logprobs) == 32
        for a, b in zip(got.logprobs, want.logprobs):
            assert (a.token_id, a.rank) == (b.token_id, b.rank)
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-5)
    assert drafted > 0 and accepted > 0


def test_async_scheduling_with_drafts_keeps_sampling_options(plain: LLM, prompts, always_draft):
    """Async scheduling on: seeded parallel samples, penalties, logprobs and greedy rows in one batch, the same
    tokens (and logprobs) as plain decoding, drafts verified."""
    llm = LLM(kv_cache_memory_gib=SMALL_KV_GIB, speculative="ngram", async_scheduling=True)
    base = {"max_tokens": 32, "ignore_eos": True}
    params = [
        SamplingParams(n=3, temperature=0.8, seed=7, **base),
        SamplingParams(temperature=0.0, frequency_penalty=0.3, repetition_penalty=1.1, **base),
        SamplingParams(temperature=0.0, logprobs=2, **base),
        SamplingParams(temperature=0.0, **base),
    ]
    chosen = [prompts[0], prompts[0], prompts[1], prompts[-1]]
    expected = plain.generate(chosen, params)
    outputs, (_, drafted, accepted) = generate_counted(llm, chosen, params)
    assert token_ids(outputs) == token_ids(expected)
    for a, b in zip(outputs[4].logprobs, expected[4].logprobs):
        assert (a.token_id, a.rank) == (b.token_id, b.rank)
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
    assert drafted > 0 and accepted > 0
    assert_idle_and_no_leaks(llm)


def test_structured_output_with_drafts_equals_plain_decoding(plain: LLM, spec: LLM, always_draft):
    """Under a grammar, drafts are cut to what the grammar accepts and each verify row is sampled under its own
    position's mask: the same JSON as plain decoding (the prompt's objects are the drafts' source; one of
    them breaks off into text the grammar refuses)."""
    prompt = (
        'Data: {"name": "Ann", "age": 31} {"name": "Bob", "age": 42} {"name": "Ann", oops} JSON:'
    )
    schema = json.dumps(
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
        }
    )
    base = {"temperature": 0.0, "max_tokens": 32}
    params = [
        SamplingParams(structured_output=StructuredOutput(kind="json_object"), **base),
        SamplingParams(
            structured_output=StructuredOutput(kind="json_schema", schema=schema), **base
        ),
    ]
    expected = plain.generate([prompt] * 2, params)
    outputs, (_, drafted, accepted) = generate_counted(spec, [prompt] * 2, params)
    assert token_ids(outputs) == token_ids(expected)
    assert all(o.finish_reason == "stop" for o in outputs), [o.text for o in outputs]
    for o in outputs:
        json.loads(o.text)
    assert set(json.loads(outputs[1].text)) >= {"name", "age"}
    assert drafted > 0 and accepted > 0


def test_max_tokens_is_reached_exactly_never_one_past(plain: LLM, spec: LLM, always_draft):
    (full,) = token_ids(plain.generate(REPEATED, SamplingParams(temperature=0.0, max_tokens=9)))
    limits = list(range(2, 10))
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in limits]
    outputs, (_, drafted, accepted) = generate_counted(spec, [REPEATED] * len(limits), params)
    assert token_ids(outputs) == [full[:m] for m in limits]
    assert all(o.finish_reason == "length" for o in outputs)
    assert drafted > 0 and accepted > 0
    assert_idle_and_no_leaks(spec)


def test_max_model_len_is_reached_exactly_with_drafts(plain: LLM, always_draft):
    """A 64-token model length: the drafts stop at its room, the sample ends at 64 tokens in all (length)."""
    prompt = plain.tokenizer.encode(REPEATED)
    llm = LLM(speculative="ngram", kv_cache_memory_gib=SMALL_KV_GIB, max_model_len=64)
    room = 64 - len(prompt)
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    (expected,) = token_ids(plain.generate(prompt, replace(params, max_tokens=room)))
    (got,), (_, _, accepted) = generate_counted(llm, prompt, params)
    assert list(got.token_ids) == expected and len(expected) == room
    assert got.finish_reason == "length" and accepted > 0


def test_stop_strings_inside_accepted_drafts_end_the_text_there(
    plain: LLM, spec: LLM, always_draft
):
    params = [
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop=["on the mat, the"]),
        SamplingParams(
            temperature=0.0, max_tokens=NEW_TOKENS, stop=["sat on"], include_stop_str_in_output=True
        ),
    ]
    expected = plain.generate([REPEATED] * 2, params)
    outputs, (_, drafted, accepted) = generate_counted(spec, [REPEATED] * 2, params)
    assert [(o.text, list(o.token_ids), o.finish_reason, o.stop_reason) for o in outputs] == [
        (o.text, list(o.token_ids), o.finish_reason, o.stop_reason) for o in expected
    ]
    assert outputs[0].finish_reason == "stop" and "on the mat, the" not in outputs[0].text
    assert outputs[1].text.endswith("sat on")
    assert drafted > 0 and accepted > 0


def test_eos_inside_accepted_drafts_ends_the_sample_there(
    plain: LLM, spec: LLM, monkeypatch, always_draft
):
    prompt = chat_prompt(spec)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    (expected,) = plain.generate(prompt, params)
    runs = record_accepts(spec, monkeypatch)
    (got,) = spec.generate(prompt, params)
    (eos,) = spec.engine.config.eos_token_ids
    assert list(got.token_ids) == list(expected.token_ids)
    assert got.finish_reason == expected.finish_reason == "stop"
    assert got.token_ids[-1] == eos and eos not in got.token_ids[:-1]
    assert any(eos in run[:-1] for _, run in runs), (
        "EOS should have come inside a run, tokens after it"
    )


def test_stop_token_inside_accepted_drafts_and_min_tokens(
    plain: LLM, spec: LLM, monkeypatch, always_draft
):
    """A stop token the greedy output first reaches inside a verification's run (accepted drafts after it): the
    sample ends there; with min_tokens past it, that stop is masked there, as in plain decoding."""
    runs = record_accepts(spec, monkeypatch)
    (free,) = token_ids(spec.generate(REPEATED, GREEDY))
    assert all(free[start : start + len(run)] == run for start, run in runs)
    first = {t: free.index(t) for t in reversed(free)}
    inside = None
    for start, run in runs:  # a token whose first occurrence is inside a run, not its last token
        inside = next((t for i, t in enumerate(run[:-1]) if first[t] == start + i), None)
        if inside is not None:
            break
    assert inside is not None
    params = [
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop_token_ids=[inside]),
        SamplingParams(
            temperature=0.0,
            max_tokens=NEW_TOKENS,
            stop_token_ids=[inside],
            min_tokens=first[inside] + 2,
        ),
    ]
    expected = plain.generate([REPEATED] * 2, params)
    runs.clear()
    outputs = spec.generate([REPEATED] * 2, params)
    assert token_ids(outputs) == token_ids(expected)
    assert list(outputs[0].token_ids) == free[: first[inside] + 1]
    assert outputs[0].finish_reason == "stop" and outputs[0].stop_reason == inside
    assert len(outputs[1].token_ids) > first[inside] + 1, (
        "min_tokens masks the stop at first[inside]"
    )
    assert any(inside in run[:-1] for _, run in runs)


def test_a_request_may_turn_speculation_off(plain: LLM, spec: LLM, always_draft):
    off = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, speculative=False)
    (expected,) = token_ids(plain.generate(REPEATED, off))
    outputs, counts = generate_counted(spec, REPEATED, off)
    assert token_ids(outputs) == [expected]
    assert counts == (0, 0, 0), "no drafts for a request with speculative=False"
    on = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs, (_, drafted, _) = generate_counted(spec, REPEATED, on)
    assert token_ids(outputs) == [expected] and drafted > 0


def test_beam_search_runs_without_drafts_and_finds_plain_beams(plain: LLM, spec: LLM, always_draft):
    expected = plain.beam_search(REPEATED, beam_width=3, max_tokens=12, n=2)
    before = spec_counts(spec)
    got = spec.beam_search(REPEATED, beam_width=3, max_tokens=12, n=2)
    assert token_ids(got) == token_ids(expected)
    assert spec_counts(spec) == before, "beam search requests get no drafts"


def test_speculative_context_supplies_accepted_drafts(plain: LLM, spec: LLM, always_draft):
    """A regenerated reply: its earlier text as speculative_context gives drafts that are accepted, the same
    output either way."""
    prompt = "Write one sentence about the sea."
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    (earlier,) = token_ids(plain.generate(prompt, params))
    outputs, (_, _, without) = generate_counted(spec, prompt, params)
    assert token_ids(outputs) == [earlier]
    with_context = SamplingParams(
        temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, speculative_context=earlier
    )
    outputs, (_, _, accepted) = generate_counted(spec, prompt, with_context)
    assert token_ids(outputs) == [earlier]
    assert accepted >= without + NEW_TOKENS // 2, (accepted, without)


def test_a_sequence_whose_drafts_are_never_worth_it_is_probed_after_probe_after_steps(
    spec: LLM, monkeypatch
):
    """With every draft length chosen 0, a sequence still gets one draft after PROBE_AFTER steps without any
    (its text may have turned repetitive), and again PROBE_AFTER steps after that probe: 39 decode steps' worth
    of tokens after the first hold two probes, whatever each probe's outcome."""
    monkeypatch.setattr(speculator_module, "choose_draft_length", lambda *_: 0)
    assert PROBE_AFTER == 16  # (the count below)
    outputs, (verified, drafted, _) = generate_counted(spec, REPEATED, GREEDY)
    assert len(outputs[0].token_ids) == NEW_TOKENS == 40
    assert verified == drafted == 2


# ---------------------------------------------------------------- distribution (unseeded sampling)

YES_NO = "yes no yes yes no no yes no yes yes no yes no no yes"
DRAWN = 3  # tokens compared per sample: the first from the prefill, the next two drafts verified in one step
SAMPLES = 256  # with speculation, and as many without
FALSE_FAILURE = 3e-5  # per chi-square test; three tests, < 1e-4 in all


def chi_square_p_value(statistic: float, degrees: int) -> float:
    """P(X >= statistic) for X chi-square with ``degrees`` degrees of freedom: Q(degrees / 2, statistic / 2)."""
    return float(
        torch.special.gammaincc(torch.tensor(degrees / 2.0), torch.tensor(statistic / 2.0))
    )


def exact_probabilities(plain: LLM, prompt: list[int], words: list[int]) -> dict[tuple, float]:
    """P(the first DRAWN tokens = w) for each w in ``words`` ** DRAWN, by the chain rule over the model's own
    logprobs (temperature 1: the raw distribution), and the rest as ``("other",)``."""
    prefixes = [list(p) for d in range(DRAWN) for p in product(words, repeat=d)]
    greedy = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)
    steps = plain.generate([prompt + p for p in prefixes], greedy)
    step = {tuple(p): dict(o.logprobs[0].top) for p, o in zip(prefixes, steps)}
    probabilities = {}
    for outcome in product(words, repeat=DRAWN):
        logprob = sum(step[outcome[:i]][outcome[i]] for i in range(DRAWN))
        probabilities[outcome] = math.exp(logprob)
    probabilities[("other",)] = 1.0 - sum(probabilities.values())
    return probabilities


def outcome_counts(outputs: list[RequestOutput], words: list[int]) -> Counter:
    counts = Counter()
    for o in outputs:
        drawn = tuple(o.token_ids[:DRAWN])
        counts[drawn if all(t in words for t in drawn) else ("other",)] += 1
    return counts


def goodness_of_fit(counts: Counter, probabilities: dict[tuple, float]) -> float:
    total = sum(counts.values())
    statistic = sum((counts[k] - total * p) ** 2 / (total * p) for k, p in probabilities.items())
    return chi_square_p_value(statistic, len(probabilities) - 1)


def homogeneity(first: Counter, second: Counter, keys: list) -> float:
    """The chi-square test that two samples come from one distribution (a 2 x len(keys) table)."""
    n1, n2 = sum(first.values()), sum(second.values())
    statistic = 0.0
    for k in keys:
        column = first[k] + second[k]
        for counts, n in ((first, n1), (second, n2)):
            expected = column * n / (n1 + n2)
            statistic += (counts[k] - expected) ** 2 / expected
    return chi_square_p_value(statistic, len(keys) - 1)


def test_sampling_keeps_the_models_distribution(plain: LLM, spec: LLM, always_draft, monkeypatch):
    """Temperature 1, unseeded, 256 samples of the first three tokens of a yes/no list with and without
    speculation. The n-gram proposer drafts the second and third (what followed the last ``yes`` or ``no``); a
    wrong acceptance rule (a draft kept more often than the model would pick it, or rows sharing their noise)
    moves the joint distribution of the 8 yes/no outcomes far off the model's own, whose probabilities are
    computed from its logprobs."""
    tokenizer = plain.tokenizer
    prompt = tokenizer.encode(YES_NO)
    words = [tokenizer.encode(" yes")[0], tokenizer.encode(" no")[0]]
    probabilities = exact_probabilities(plain, prompt, words)
    assert min(probabilities.values()) * SAMPLES >= 5, probabilities  # (the approximation holds)
    # (max_tokens: room for two drafts after the first token, and the token after them)
    params = SamplingParams(n=64, temperature=1.0, max_tokens=DRAWN + 1, ignore_eos=True)
    # (64 samples a request: drafts for batches of that many decode rows too)
    monkeypatch.setattr(spec.engine.core.speculation.speculator, "max_batch", 64)
    drawn, (verified, drafted, accepted) = [], (0, 0, 0)
    for _ in range(SAMPLES // 64):
        outputs, counts = generate_counted(spec, prompt, params)
        drawn += outputs
        verified, drafted, accepted = (a + b for a, b in zip((verified, drafted, accepted), counts))
    # a first token of the list has a bigram to follow in the prompt: two drafts
    listed = sum(o.token_ids[0] in words for o in drawn)
    assert verified >= listed and drafted >= 2 * listed, "every listed sample verifies two drafts"
    assert 0 < accepted < drafted, "some drafts kept, some rejected"
    reference = []
    for _ in range(SAMPLES // 128):
        reference += plain.generate(
            prompt, SamplingParams(n=128, temperature=1.0, max_tokens=DRAWN)
        )
    with_drafts, without = outcome_counts(drawn, words), outcome_counts(reference, words)
    print("speculative", with_drafts, "plain", without, "exact", probabilities)
    assert goodness_of_fit(without, probabilities) > FALSE_FAILURE, "plain decoding's own check"
    assert goodness_of_fit(with_drafts, probabilities) > FALSE_FAILURE
    assert homogeneity(with_drafts, without, list(probabilities)) > FALSE_FAILURE


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "options, field",
    [
        ({"speculative": "x"}, "speculative"),
        ({"speculative": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"speculative": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens"),
        ({"speculative": "ngram", "speculative_max_batch": 0}, "speculative_max_batch"),
    ],
)
def test_config_rejects_bad_speculative_options(options, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        EngineConfig(**options)


@pytest.mark.parametrize(
    "options, field",
    [
        ({"speculative": "yes"}, "speculative"),
        ({"speculative_context": [5, -1]}, "speculative_context"),
        ({"speculative_context": [1.5]}, "speculative_context"),
        ({"speculative_context": [0] * (MAX_SPECULATIVE_CONTEXT + 1)}, "speculative_context"),
    ],
)
def test_sampling_params_reject_bad_speculative_fields(options, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**options)


def test_a_context_id_outside_the_vocabulary_is_refused_at_add_request(spec: LLM):
    vocab = spec.engine.core.info.vocab_size
    SamplingParams(speculative_context=[vocab])  # (the vocabulary is known to the engine only)
    with pytest.raises(ValueError, match="^speculative_context:"):
        spec.engine.add_request(
            "bad-context", [1, 2, 3], SamplingParams(speculative_context=[vocab])
        )
    assert not spec.engine.has_unfinished_requests()
