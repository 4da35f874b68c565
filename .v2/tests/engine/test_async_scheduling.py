"""Async scheduling: sampled ids are read one step late (step N+1 is launched before step N's tokens reach
the host). Whatever the lag, a request's tokens, stop reasons, cached block hashes and the block pool must
be exactly what the synchronous engine gives."""

from __future__ import annotations

import pytest

from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.block_invariants import check_pool
from tests.conftest import SMALL_KV_GIB

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "List three colours of the rainbow:",
    "Once upon a time, " * 6,
]


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p) for p in PROMPTS]


def run(
    prompt_ids: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    async_scheduling: bool,
    **options,
) -> tuple[LLM, list]:
    llm = LLM(kv_cache_memory_gib=SMALL_KV_GIB, async_scheduling=async_scheduling, **options)
    return llm, llm.generate(prompt_ids, params)


def assert_pool_idle(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    check_pool(engine.core.block_manager, [])
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks


def test_stop_token_ends_the_request_where_the_sync_engine_ends_it(prompt_ids):
    free_run = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    _, reference = run(prompt_ids, free_run, async_scheduling=False)
    # stop each request at its own 6th token: the async engine has already launched a step past it
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[o.token_ids[5]]
        )
        for o in reference
    ]
    _, sync_outputs = run(prompt_ids, params, async_scheduling=False)
    llm, async_outputs = run(prompt_ids, params, async_scheduling=True)
    for sync_out, async_out in zip(sync_outputs, async_outputs):
        assert async_out.token_ids == sync_out.token_ids
        assert async_out.finish_reason == sync_out.finish_reason == "stop"
        assert async_out.stop_reason == sync_out.stop_reason
        assert async_out.block_hashes == sync_out.block_hashes
    assert_pool_idle(llm)


def test_penalised_requests_sample_from_known_tokens(prompt_ids):
    params = SamplingParams(
        temperature=0.0,
        max_tokens=16,
        repetition_penalty=1.4,
        frequency_penalty=0.5,
        ignore_eos=True,
    )
    _, sync_outputs = run(prompt_ids, params, async_scheduling=False)
    llm, async_outputs = run(prompt_ids, params, async_scheduling=True)
    assert [o.token_ids for o in async_outputs] == [o.token_ids for o in sync_outputs]
    assert_pool_idle(llm)


def test_a_request_at_its_length_limit_is_not_scheduled_again(prompt_ids):
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    sync_llm, sync_outputs = run(prompt_ids[:1], params, async_scheduling=False)
    async_llm, async_outputs = run(prompt_ids[:1], params, async_scheduling=True)
    assert async_outputs[0].token_ids == sync_outputs[0].token_ids
    # one prefill and four decode passes either way: the pass after the 5th token is never launched
    assert async_llm.engine.stats().steps == sync_llm.engine.stats().steps == 5


def test_abort_while_a_step_is_in_flight_frees_everything(prompt_ids):
    engine = LLMEngine(kv_cache_memory_gib=SMALL_KV_GIB, async_scheduling=True)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("kept", prompt_ids[0], params)
    engine.add_request("dropped", prompt_ids[1], params)
    seen: dict[str, list] = {"kept": [], "dropped": []}
    for _ in range(4):
        for out in engine.step():
            seen[out.request_id].append(out)
    assert engine.core.has_step_in_flight  # the test needs a step whose ids were not read yet
    (final,) = engine.abort_request("dropped")
    assert final.finished and final.finish_reason == "abort"
    assert all(t >= 0 for t in final.token_ids), "a pending placeholder leaked into the output"
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    # nothing after the abort
    assert seen["dropped"] and not any(o.finished for o in seen["dropped"])
    kept = seen["kept"][-1]
    assert kept.finished and len(kept.token_ids) == 12
    _, (reference,) = run([prompt_ids[0]], params, async_scheduling=False)
    assert kept.token_ids == reference.token_ids
    check_pool(engine.core.block_manager, [])
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


def test_deltas_concatenate_to_the_final_output(prompt_ids):
    engine = LLMEngine(
        kv_cache_memory_gib=SMALL_KV_GIB, async_scheduling=True, max_num_batched_tokens=16
    )
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for i, ids in enumerate(prompt_ids):
        engine.add_request(f"r{i}", ids, params)
    deltas: dict[str, list[int]] = {}
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.setdefault(out.request_id, []).extend(out.token_ids_delta)
            if out.finished:
                finals[out.request_id] = out
    assert set(finals) == {f"r{i}" for i in range(len(prompt_ids))}
    for request_id, final in finals.items():
        assert deltas[request_id] == final.token_ids
        assert len(final.token_ids) == 10 and all(t >= 0 for t in final.token_ids)
