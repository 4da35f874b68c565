"""The host tier of the prefix cache: cached blocks evicted from a small device pool are kept in host memory and
copied back on a later prefix hit; the conversation's greedy tokens equal those of an engine that recomputes
them, the request reports them as cached, and device and host slots are accounted for at every step."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.block_invariants import check_pool

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# the first turn's blocks cannot survive the fillers
SMALL = dict(num_kv_blocks=8, max_model_len=128)
SYSTEM = (
    "You are a careful assistant. Answer in one short paragraph, cite no sources, and keep a friendly "
    "tone. The user is planning a trip through the mountains in late autumn and asks about weather, "
    "trails, and what to pack."
)
FILLERS = [
    "Write a haiku about the sea and the moon rising over quiet water tonight.",
    "List five prime numbers and explain in one sentence why each of them is prime.",
    "Describe a red bicycle leaning on a wall in the rain, in two sentences.",
]


def check_host_tier(engine: LLMEngine) -> None:
    cache = engine.core.block_manager.host_cache
    slots = list(cache.entries.values())
    assert len(set(slots)) == len(slots), "a host slot holds two blocks"
    assert all(cache.first_slot <= s < cache.first_slot + cache.num_slots for s in slots)
    assert not set(slots) & set(cache.free), "a host slot both free and holding a block"
    assert len(slots) + len(cache.free) + len(cache.freed_this_step) == cache.num_slots


def run(engine: LLMEngine, request_id: str, *prompts: list[int]) -> tuple[list[int], int]:
    """Greedy tokens and cached prompt tokens of the first of ``prompts`` (all submitted together), with the
    invariants checked at every step."""
    for i, ids in enumerate(prompts):
        engine.add_request(f"{request_id}-{i}", ids, GREEDY)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id == f"{request_id}-0":
                final = out
        scheduler = engine.core.scheduler
        check_pool(
            engine.core.block_manager,
            list(scheduler.running) + list(scheduler.waiting) + list(scheduler.swapped),
        )
        if engine.core.block_manager.host_cache is not None:
            check_host_tier(engine)
    return final.token_ids, final.num_cached_tokens


def conversation(engine: LLMEngine, tokenizer) -> list[tuple[list[int], int]]:
    """Turn 1, three unrelated requests that need the whole pool, then turn 2 (turn 1's prompt + answer + a
    new question) and the fillers' first one again."""
    first = tokenizer.encode(SYSTEM + " Where should I start?")
    results = [run(engine, "turn-1", first)]
    run(engine, "fillers", *(tokenizer.encode(text) for text in FILLERS))
    second = first + results[0][0] + tokenizer.encode(" And what about the weather in November?")
    results.append(run(engine, "turn-2", second))
    results.append(run(engine, "filler-again", tokenizer.encode(FILLERS[0])))
    return results


@pytest.fixture(scope="module")
def recomputed(tokenizer) -> list[tuple[list[int], int]]:
    return conversation(LLM(**SMALL).engine, tokenizer)


@pytest.fixture(scope="module")
def tiered(tokenizer) -> tuple[LLMEngine, list[tuple[list[int], int]]]:
    """An engine with a host tier after the conversation, and the conversation's results."""
    engine = LLM(host_cache_gib=0.05, **SMALL).engine
    return engine, conversation(engine, tokenizer)


def test_evicted_prefix_comes_back_from_the_host_with_the_same_tokens(
    tokenizer, recomputed, tiered
):
    engine, results = tiered
    assert [tokens for tokens, _ in results] == [tokens for tokens, _ in recomputed]
    stats = engine.stats()
    assert stats.host_cache_stores > 0, "the pool was meant to evict cached blocks"
    assert (
        stats.prefix_host_hits > 0
        and stats.prefix_device_hits + stats.prefix_host_hits == stats.prefix_hits
    )
    # turn 2 finds its head (system prompt + turn 1) cached: on the host here, recomputed without the tier
    first_ids = tokenizer.encode(SYSTEM + " Where should I start?")
    head_blocks = (len(first_ids) + len(results[0][0])) // engine.config.block_size
    assert results[1][1] >= (head_blocks - 1) * engine.config.block_size
    assert recomputed[1][1] < results[1][1]
    assert stats.num_host_cached_blocks == len(engine.core.block_manager.host_cache.entries) > 0


def test_host_cache_needs_prefix_caching_and_a_real_size():
    with pytest.raises(ValueError, match="host_cache_gib"):
        EngineConfig(host_cache_gib=-0.5)
    engine = LLM(host_cache_gib=0.05, enable_prefix_caching=False, **SMALL).engine
    assert engine.core.block_manager.host_cache is None


def test_metrics_split_device_and_host_hits(tiered):
    """/metrics exposes the engine's split: hits on the device and hits restored from the host tier."""
    from prometheus_client.parser import text_string_to_metric_families

    from app.metrics import ServerMetrics

    engine, _ = tiered
    stats = engine.stats()
    text = ServerMetrics("m", engine.stats).exposition().decode()
    values = {
        s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
    }
    assert values["pagedchat:prefix_cache_host_hits_total"] == stats.prefix_host_hits > 0
    assert (
        values["pagedchat:prefix_cache_device_hits_total"]
        == stats.prefix_hits - stats.prefix_host_hits
    )
    assert values["pagedchat:prefix_cache_hits_total"] == stats.prefix_hits
    assert values["pagedchat:host_cache_blocks"] == len(
        engine.core.block_manager.host_cache.entries
    )


def test_reset_prefix_cache_empties_the_host_tier_too(tokenizer, tiered):
    """(Last in the module: it empties the shared engine's caches.)"""
    engine, _ = tiered
    assert engine.core.block_manager.host_cache.entries
    engine.core.block_manager.reset_prefix_cache()
    assert not engine.core.block_manager.host_cache.entries
    check_host_tier(engine)
    tokens, cached = run(engine, "after-reset", tokenizer.encode(SYSTEM + " Where should I start?"))
    assert cached == 0 and len(tokens) == GREEDY.max_tokens
