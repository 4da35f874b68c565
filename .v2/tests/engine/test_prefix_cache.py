"""Prefix caching through the engine: shared system prompts and earlier turns are computed once."""

from __future__ import annotations

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.conftest import SMALL_KV_GIB

BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
SYSTEM = (
    "You are a careful assistant for a small bakery. You answer questions about bread, opening hours, "
    "allergens and prices. Keep answers short, friendly and precise. Never invent prices. The bakery "
    "opens at seven every morning except Monday, sells sourdough, rye, spelt and white loaves, "
    "croissants and seasonal cakes, and can tell customers which products contain nuts or gluten."
)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_memory_gib=SMALL_KV_GIB)


@pytest.fixture(autouse=True)
def cold_cache(llm: LLM) -> None:
    llm.engine.block_manager.reset_prefix_cache()


def chat_ids(llm: LLM, question: str) -> list[int]:
    return llm.chat_prompt_ids(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    )


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def expected_hit(cached_tokens: list[int], prompt: list[int]) -> int:
    """Full blocks of the common prefix whose KV was written, capped so one prompt token is computed."""
    blocks = min(common_prefix_len(cached_tokens, prompt) // BLOCK, (len(prompt) - 1) // BLOCK)
    return blocks * BLOCK


def test_shared_system_prompt_is_computed_once(llm: LLM):
    first, second = (
        chat_ids(llm, "When do you open on Sunday?"),
        chat_ids(llm, "Is the rye bread vegan?"),
    )
    (out1,) = llm.generate([first], GREEDY)
    assert out1.num_cached_tokens == 0
    written = first + out1.token_ids[:-1]  # the last sampled token never had its KV computed
    (warm,) = llm.generate([second], GREEDY)
    assert warm.num_cached_tokens == expected_hit(written, second) >= 4 * BLOCK
    llm.engine.block_manager.reset_prefix_cache()
    (cold,) = llm.generate([second], GREEDY)
    assert cold.num_cached_tokens == 0
    assert warm.token_ids == cold.token_ids


def test_second_turn_reuses_first_turn_blocks_including_generated_ones(llm: LLM, tokenizer):
    turn1 = chat_ids(llm, "Which breads do you bake every day?")
    (answer,) = llm.generate(
        [turn1], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    )
    follow_up = tokenizer.encode(
        "<|im_end|>\n<|im_start|>user\nAnd on weekends?<|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    )
    turn2 = turn1 + answer.token_ids + follow_up
    (out2,) = llm.generate([turn2], GREEDY)
    written = len(turn1) + len(answer.token_ids) - 1
    assert out2.num_cached_tokens == (written // BLOCK) * BLOCK
    assert out2.num_cached_tokens > len(turn1), "blocks holding generated tokens must be hit too"


def test_cache_salt_isolates_tenants(llm: LLM):
    prompt = chat_ids(llm, "Do you sell gluten-free cakes?")
    (a1,) = llm.generate([prompt], GREEDY, cache_salt="tenant-a")
    (b1,) = llm.generate([prompt], GREEDY, cache_salt="tenant-b")
    (unsalted,) = llm.generate([prompt], GREEDY)
    (a2,) = llm.generate([prompt], GREEDY, cache_salt="tenant-a")
    assert (a1.num_cached_tokens, b1.num_cached_tokens, unsalted.num_cached_tokens) == (0, 0, 0)
    assert a2.num_cached_tokens == ((len(prompt) - 1) // BLOCK) * BLOCK
    assert a1.token_ids == b1.token_ids == unsalted.token_ids == a2.token_ids


def test_prefix_caching_off_never_hits():
    llm = LLM(kv_cache_memory_gib=SMALL_KV_GIB, enable_prefix_caching=False)
    prompt = chat_ids(llm, "Hello?")
    outputs = llm.generate([prompt, prompt], GREEDY) + llm.generate([prompt], GREEDY)
    assert [o.num_cached_tokens for o in outputs] == [0, 0, 0]
    assert llm.engine.stats().prefix_hits == 0


def test_stats_count_prefix_queries_and_hits(llm: LLM):
    before = llm.engine.stats()
    prompt = chat_ids(llm, "How much is a baguette?")
    llm.generate([prompt], GREEDY)
    (again,) = llm.generate([prompt], GREEDY)
    after = llm.engine.stats()
    assert after.prefix_queries - before.prefix_queries == 2 * len(prompt)
    assert after.prefix_hits - before.prefix_hits == again.num_cached_tokens > 0
    assert after.num_free_blocks == after.num_blocks
