"""The engine's request API: stops, lengths, logprobs, seeds, aborts and clear errors on bad input."""

from __future__ import annotations

import math

import pytest
import torch

from engine.config import EngineConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.conftest import SMALL_KV_GIB


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(cpu_weights="float32", kv_cache_memory_gib=SMALL_KV_GIB)


PROMPT = "Write a short poem about the sea, with a title."


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


def test_max_tokens_ends_with_length(llm: LLM):
    (out,) = llm.generate(PROMPT, greedy(max_tokens=7, ignore_eos=True))
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    assert out.usage.completion_tokens == 7 and out.usage.prompt_tokens == len(
        llm.tokenizer.encode(PROMPT)
    )


def test_eos_stops_and_is_not_in_text(llm: LLM):
    (out,) = llm.chat([{"role": "user", "content": "Say hi."}], greedy(max_tokens=200))
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.token_ids[-1] in llm.engine.config.eos_token_ids
    assert "<|im_end|>" not in out.text


def test_stop_string_truncates_output_and_never_leaks(llm: LLM):
    (full,) = llm.generate(PROMPT, greedy(max_tokens=48, ignore_eos=True))
    words = full.text.split()
    stop = " ".join(words[len(words) // 2 : len(words) // 2 + 2])  # two words from the middle
    expected = full.text[: full.text.index(stop)]
    request_id = "stop-test"
    llm.engine.add_request(
        request_id,
        llm.tokenizer.encode(PROMPT),
        greedy(max_tokens=48, ignore_eos=True, stop=[stop]),
    )
    deltas, last = [], None
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            deltas.append(out.text_delta)
            last = out
    assert last.finish_reason == "stop" and last.stop_reason == stop
    assert last.text == "".join(deltas) == expected
    assert all(stop not in "".join(deltas[: i + 1]) for i in range(len(deltas)))


def test_final_outputs_only_equal_the_streamed_ones(llm: LLM):
    """``step(finals_only=True)`` (what ``generate`` runs) hands out only ended samples, each carrying its whole
    output in its delta fields too, equal to the last output of the same requests streamed step by step: stop
    strings, logprobs and n > 1 included."""
    (full,) = llm.generate(PROMPT, greedy(max_tokens=24, ignore_eos=True))
    stop = full.text.split()[4]
    params = [
        greedy(max_tokens=24, ignore_eos=True, stop=[stop]),
        greedy(max_tokens=9, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=6, ignore_eos=True),
    ]
    prompt = llm.tokenizer.encode(PROMPT)

    def run(finals_only: bool) -> dict:
        for i, p in enumerate(params):
            llm.engine.add_request(f"finals-{finals_only}-{i}", prompt, p)
        last, handed_out = {}, []
        while llm.engine.has_unfinished_requests():
            for out in llm.engine.step(finals_only=finals_only):
                handed_out.append(out)
                last[(out.request_id[-1], out.index)] = out
        if finals_only:
            assert all(out.finished for out in handed_out) and len(handed_out) == 4
        return last

    streamed, finals = run(False), run(True)
    assert streamed.keys() == finals.keys() and len(finals) == 4
    for key, out in finals.items():
        assert out.text_delta == out.text == streamed[key].text
        assert out.token_ids_delta == out.token_ids == streamed[key].token_ids
        assert (out.finish_reason, out.stop_reason) == (
            streamed[key].finish_reason,
            streamed[key].stop_reason,
        )
    assert finals[("0", 0)].stop_reason == stop and stop not in finals[("0", 0)].text
    assert [e.token_id for e in finals[("1", 0)].logprobs_delta] == finals[("1", 0)].token_ids
    assert len(finals[("1", 0)].logprobs) == 9


def test_include_stop_str_in_output_keeps_it(llm: LLM):
    (full,) = llm.generate(PROMPT, greedy(max_tokens=48, ignore_eos=True))
    stop = full.text.split()[3]
    (out,) = llm.generate(
        PROMPT, greedy(max_tokens=48, ignore_eos=True, stop=stop, include_stop_str_in_output=True)
    )
    assert out.text == full.text[: full.text.index(stop) + len(stop)]


def test_stop_token_ids_end_the_request(llm: LLM):
    (full,) = llm.generate(PROMPT, greedy(max_tokens=20, ignore_eos=True))
    stop_token = full.token_ids[5]
    (out,) = llm.generate(
        PROMPT, greedy(max_tokens=20, ignore_eos=True, stop_token_ids=[stop_token])
    )
    first = full.token_ids.index(stop_token)
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_token


def test_min_tokens_delays_eos(llm: LLM):
    messages = [{"role": "user", "content": "Say hi."}]
    (short,) = llm.chat(messages, greedy(max_tokens=200))
    (longer,) = llm.chat(messages, greedy(max_tokens=200, min_tokens=len(short.token_ids) + 5))
    assert len(longer.token_ids) >= len(short.token_ids) + 5
    assert all(t not in llm.engine.config.eos_token_ids for t in longer.token_ids[:-1])


def test_logprobs_match_the_model_distribution(llm: LLM, hf_model):
    prompt = llm.tokenizer.encode(PROMPT)
    (out,) = llm.generate([prompt], greedy(max_tokens=4, logprobs=3, ignore_eos=True))
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt + out.token_ids])).logits[0].double()
    ref = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    assert len(out.logprobs) == 4
    for step, lp in enumerate(out.logprobs):
        assert lp.token_id == out.token_ids[step] and lp.rank == 1
        assert math.isclose(lp.logprob, ref[step, lp.token_id].item(), abs_tol=1e-4)
        # the top three by value: two tokens within float32's noise may come in either order on another CPU
        top = torch.topk(ref[step], 3).values.tolist()
        assert [logprob for _, logprob in lp.top] == pytest.approx(top, abs=1e-4)
        assert all(math.isclose(v, ref[step, t].item(), abs_tol=1e-4) for t, v in lp.top)


def test_same_seed_same_output_whatever_the_batch(llm: LLM):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    (alone,) = llm.generate(PROMPT, params)
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batched = llm.generate(["Tell me a joke.", PROMPT, "Count to five."], [others, params, others])
    assert batched[1].token_ids == alone.token_ids
    (other_seed,) = llm.generate(
        PROMPT,
        SamplingParams(temperature=0.9, top_p=0.95, seed=4321, max_tokens=16, ignore_eos=True),
    )
    assert other_seed.token_ids != alone.token_ids


def test_abort_frees_blocks_and_reports_abort(llm: LLM):
    engine = llm.engine
    engine.add_request(
        "to-abort", llm.tokenizer.encode(PROMPT), greedy(max_tokens=100, ignore_eos=True)
    )
    for _ in range(3):
        engine.step()
    assert engine.stats().num_free_blocks < engine.stats().num_blocks
    (final,) = engine.abort_request("to-abort")
    assert final.finished and final.finish_reason == "abort" and 0 < len(final.token_ids) < 100
    assert not engine.has_unfinished_requests()
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.5),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0.0),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("logprobs", 21),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
        ("n", 0),
        ("n", 129),
        ("best_of", 0),
        ("seed", 1.5),
        ("temperature", float("nan")),
        ("temperature", 3.4e38),
    ],
)
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


@pytest.mark.parametrize(
    "field, value",
    [
        ("block_size", 12),
        ("max_num_seqs", 0),
        ("dtype", "float64"),
        ("prefix_hash", "md5"),
        ("gpu_memory_utilization", 1.5),
        ("load_format", "pickle"),
        ("device", "tpu"),
    ],
)
def test_bad_engine_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_prompt_longer_than_max_model_len_is_rejected():
    llm = LLM(cpu_weights="float32", kv_cache_memory_gib=SMALL_KV_GIB, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len=64"):
        llm.generate([[1] * 64], greedy(max_tokens=1))
    assert not llm.engine.has_unfinished_requests()


def test_generation_stops_at_max_model_len():
    llm = LLM(cpu_weights="float32", kv_cache_memory_gib=SMALL_KV_GIB, max_model_len=40)
    (out,) = llm.generate([[1] * 30], greedy(max_tokens=None, ignore_eos=True))
    assert len(out.token_ids) == 10 and out.finish_reason == "length"


def test_prompt_too_large_for_the_pool_is_rejected_not_left_waiting():
    # 64 tokens in all: max_model_len is capped to the pool
    llm = LLM(cpu_weights="float32", num_kv_blocks=4)
    assert llm.engine.config.max_model_len == 64
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[5] * 100], greedy(max_tokens=4))


@pytest.mark.parametrize(
    "prompt, match",
    [
        ([], "at least one"),
        ([1, 10**9], "token ids"),
        ([1, -3], "token ids"),
        ([1, 2.0], "token ids"),
        ([4, "5"], "token ids"),
        ([4, None], "token ids"),
    ],
)
def test_bad_prompts_are_rejected(llm: LLM, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], greedy(max_tokens=1))
    assert not llm.engine.has_unfinished_requests()


def test_duplicate_request_id_is_rejected(llm: LLM):
    llm.engine.add_request("dup", [1, 2, 3], greedy(max_tokens=2))
    with pytest.raises(ValueError, match="request_id"):
        llm.engine.add_request("dup", [1, 2, 3], greedy(max_tokens=2))
    llm.engine.abort_request("dup")


def test_max_model_len_beyond_the_model_is_rejected():
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(cpu_weights="float32", kv_cache_memory_gib=SMALL_KV_GIB, max_model_len=10**6)
