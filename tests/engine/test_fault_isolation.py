"""One request's failure ends that request only: the engine, the other requests and the block pool carry on.
Also: values no request may use are refused at submission, and pinned presets never stall the scheduler."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from engine.async_engine import AsyncEngine
from engine.request_stream import RequestFailedError
from engine.sample.sampler import Sampler
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.output import output_processor
from engine.sampling_params import SamplingParams, StructuredOutput
from tests.block_invariants import check_pool
from tests.conftest import SMALL_KV_GIB
from tests.engine_faults import check_idle_pool, fail_sampling_of

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def prompts(tokenizer, count: int) -> list[list[int]]:
    return [
        tokenizer.encode(f"Request number {i} asks about the number {i * 7}.") for i in range(count)
    ]


def assert_idle(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests()
    check_pool(engine.core.block_manager, [])
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


@pytest.fixture
def faulty_sampler(monkeypatch):
    """Sampling raises for any batch holding request ``bad`` (as a broken logits processor would)."""
    original = Sampler.__call__

    def sample(self, logits, seqs, *args, **kwargs):
        if any(seq.request_id == "bad" for seq in seqs):
            raise RuntimeError("injected logits-processor fault")
        return original(self, logits, seqs, *args, **kwargs)

    monkeypatch.setattr(Sampler, "__call__", sample)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_bad_sampling_value_ends_only_that_request(tokenizer, faulty_sampler, async_scheduling):
    ids = prompts(tokenizer, 8)
    engine = LLMEngine(kv_cache_memory_gib=SMALL_KV_GIB, async_scheduling=async_scheduling)
    for i, prompt in enumerate(ids):
        engine.add_request("bad" if i == 3 else f"ok{i}", prompt, GREEDY)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["bad"].finish_reason == "error"
    assert "injected logits-processor fault" in finals["bad"].error
    good = [finals[f"ok{i}"] for i in range(8) if i != 3]
    assert all(o.finish_reason == "length" and o.error is None for o in good)
    reference = LLM(kv_cache_memory_gib=SMALL_KV_GIB).generate(
        [p for i, p in enumerate(ids) if i != 3], GREEDY
    )
    assert [o.token_ids for o in good] == [o.token_ids for o in reference]
    assert_idle(engine)


def test_detokenizer_fault_ends_only_that_request(tokenizer, monkeypatch):
    engine = LLMEngine(kv_cache_memory_gib=SMALL_KV_GIB)
    ids = prompts(tokenizer, 3)

    class BrokenDetokenizer:
        def __init__(self, *args):
            pass

        def update(self, token_ids):
            raise UnicodeError("injected detokenizer fault")

        def take_delta(self, finished):
            return ""

    for i, prompt in enumerate(ids):
        with monkeypatch.context() as patch:  # the front's side: r1's detokenizer is broken
            if i == 1:
                patch.setattr(output_processor, "IncrementalDetokenizer", BrokenDetokenizer)
            engine.add_request(f"r{i}", prompt, GREEDY)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["r1"].finish_reason == "error" and "UnicodeError" in finals["r1"].error
    assert finals["r0"].finish_reason == finals["r2"].finish_reason == "length"
    assert len(finals["r0"].token_ids) == len(finals["r2"].token_ids) == 12
    assert_idle(engine)


async def test_failed_request_raises_in_its_stream_and_the_engine_stays_healthy(tokenizer):
    engine = AsyncEngine(kv_cache_memory_gib=SMALL_KV_GIB)
    await engine.start()
    try:
        await engine.call(fail_sampling_of, "bad")  # in the core's process
        ids = prompts(tokenizer, 4)

        async def consume(request_id: str, prompt: list[int]):
            tokens = []
            async for out in engine.generate(prompt, GREEDY, request_id=request_id):
                tokens += out.token_ids_delta
            return tokens

        results = await asyncio.wait_for(
            asyncio.gather(
                *(consume("bad" if i == 0 else f"ok{i}", p) for i, p in enumerate(ids)),
                return_exceptions=True,
            ),
            timeout=120,
        )
        assert isinstance(results[0], RequestFailedError)
        assert "injected logits-processor fault" in str(results[0])
        assert all(isinstance(r, list) and len(r) == 12 for r in results[1:])
        assert engine.healthy
        after = await consume("after", ids[1])  # the engine still serves
        assert after == results[1]
        assert await engine.call(check_idle_pool) == engine.stats().num_blocks
    finally:
        await engine.stop()


@pytest.fixture(scope="module")
def small_engine() -> LLMEngine:
    return LLMEngine(kv_cache_memory_gib=SMALL_KV_GIB)


@pytest.mark.parametrize(
    "field, params",
    [
        ("top_k", SamplingParams(top_k=10**6, top_p=0.5)),
        ("logit_bias", SamplingParams(logit_bias={10**6: 1.0})),
        (
            "response_format",
            SamplingParams(
                structured_output=StructuredOutput("json_schema", '{"type": "nonsense"}')
            ),
        ),
    ],
)
def test_values_beyond_the_model_are_refused_at_submission(small_engine, field, params):
    with pytest.raises(ValueError, match=f"^{field}:"):
        small_engine.add_request("r", [1, 2, 3], params)
    assert not small_engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "field, options",
    [
        ("seed", {"seed": 2**64}),
        ("top_k", {"top_k": 2**40}),
        ("max_tokens", {"max_tokens": 2**40}),
        ("stop", {"stop": ["x"] * 17}),
        ("stop", {"stop": ["x" * 257]}),
        ("logit_bias", {"logit_bias": {1: 101.0}}),
        ("logit_bias", {"logit_bias": {i: 1.0 for i in range(301)}}),
    ],
)
def test_sampling_params_refuse_out_of_range_values(field, options):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**options)


def test_pinned_presets_never_stall_the_scheduler(tokenizer):
    """40 blocks, a 9-block pinned preset, then a request that fits the context but not the unpinned pool:
    the pins give way (logged) instead of the engine stalling for good."""
    engine = LLMEngine(num_kv_blocks=40, max_num_batched_tokens=256)
    preset = (tokenizer.encode("You are a helpful assistant. " * 40))[: 9 * 16]
    engine.add_request("preset", preset + [1], SamplingParams(temperature=0.0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.pin_prefix("p", preset, None, share=0.5) == 9
    prompt = (tokenizer.encode("Tell me a long story about the sea. " * 40))[:300]
    engine.add_request(
        "long", prompt, SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    )
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
    assert [len(o.token_ids) for o in finals] == [300]
    assert engine.core.block_manager.num_pinned_blocks == 0
    assert_idle(engine)


def test_json_schema_outputs_parse_and_validate(tokenizer):
    llm = LLM(kv_cache_memory_gib=SMALL_KV_GIB)
    schema = {
        "type": "object",
        "additionalProperties": False,
        "required": ["name", "age", "city", "member"],
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer"},
            "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
            "member": {"type": "boolean"},
        },
    }
    questions = [
        "Describe a person as JSON.",
        "Who lives in Rome? Answer in JSON.",
        "Invent a club member.",
        "JSON for an old man from Oslo.",
    ]
    prompts_ = [llm.chat_prompt_ids([{"role": "user", "content": q}]) for q in questions]
    spec = StructuredOutput("json_schema", json.dumps(schema))
    # room to spare: the grammar ends each object, and a sampled age may run to many digits
    params = [
        SamplingParams(
            temperature=0.0 if i < 4 else 1.0, seed=i, max_tokens=160, structured_output=spec
        )
        for i in range(20)
    ]
    outputs = llm.generate([prompts_[i % 4] for i in range(20)], params)
    for out in outputs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)
    assert_idle(llm.engine)
