"""Beam search equals transformers' ``generate(num_beams=k, do_sample=False)`` token for token (CPU, float32),
also when the pool is too small and beams are preempted; beams share blocks and free them when they fall out."""

from __future__ import annotations

import pytest
import torch

from engine.output.beam_search import BeamSearch
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.block_invariants import check_pool
from tests.conftest import SMALL_KV_GIB

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Write a haiku about rain:",
    "1, 2, 3, 4,",
    "Hello, my name is",
    "Q: What is the boiling point of water?\nA:",
]
NEW_TOKENS = 12


def hf_beam(hf_model, prompt_ids: list[int], width: int, max_new_tokens: int) -> list[int]:
    """transformers' best hypothesis, cut after its EOS (the rest of the row is padding)."""
    with torch.inference_mode():
        row = hf_model.generate(
            torch.tensor([prompt_ids]),
            num_beams=width,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            num_return_sequences=1,
        )[0, len(prompt_ids) :].tolist()
    eos = hf_model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    ends = [i for i, t in enumerate(row) if t in eos]
    return row[: ends[0] + 1] if ends else row


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(cpu_weights="float32", kv_cache_memory_gib=SMALL_KV_GIB)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_equals_transformers(llm: LLM, hf_model, prompt_ids, width: int):
    expected = [hf_beam(hf_model, ids, width, NEW_TOKENS) for ids in prompt_ids]
    got = llm.beam_search(prompt_ids, beam_width=width, max_tokens=NEW_TOKENS)
    assert [o.token_ids for o in got] == expected
    assert all(o.finished and o.index == 0 for o in got)
    check_pool(llm.engine.block_manager, [])
    assert llm.engine.stats().num_free_blocks == llm.engine.stats().num_blocks


@pytest.fixture(scope="module")
def expected_width4(hf_model, prompt_ids) -> list[list[int]]:
    return [hf_beam(hf_model, ids, 4, NEW_TOKENS) for ids in prompt_ids[:4]]


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_beam_search_under_preemption_gives_the_same_tokens(expected_width4, prompt_ids, mode: str):
    """swap: a preempted beam's request goes to the host with all its beams (shared blocks copied once) and
    comes back together; recompute: the beam computes its tokens again."""
    tight = LLM(
        cpu_weights="float32",
        num_kv_blocks=14,
        max_model_len=96,
        preemption_mode=mode,
        swap_space_gib=0.05,
    )
    got = tight.beam_search(prompt_ids[:4], beam_width=4, max_tokens=NEW_TOKENS)
    assert tight.engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    assert (tight.engine.scheduler.num_swap_outs > 0) == (mode == "swap")
    assert [o.token_ids for o in got] == expected_width4
    check_pool(tight.engine.block_manager, [])


def test_n_best_hypotheses_best_first(llm: LLM, prompt_ids):
    outs = llm.beam_search(prompt_ids[0], beam_width=4, max_tokens=8, n=3)
    assert [o.index for o in outs] == [0, 1, 2]
    scores = [o.cumulative_logprob / len(o.token_ids) for o in outs]  # length_penalty 1
    assert scores == sorted(scores, reverse=True)
    assert len({tuple(o.token_ids) for o in outs}) == 3


def test_beams_share_blocks_and_release_them(llm: LLM, prompt_ids):
    engine = llm.engine
    prompt = prompt_ids[5] * 4  # several full blocks: the beams must share them
    engine.add_request(
        "beams",
        prompt,
        SamplingParams(use_beam_search=True, beam_width=4, max_tokens=20, ignore_eos=True),
    )
    block = engine.config.block_size
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        check_pool(
            engine.core.block_manager,
            list(engine.core.scheduler.running) + list(engine.core.scheduler.waiting),
        )
        stats = engine.stats()
        peak = max(peak, stats.num_blocks - stats.num_free_blocks)
    independent = 4 * -(-(len(prompt) + 20) // block)
    assert peak <= -(-len(prompt) // block) + 4 * (-(-20 // block) + 1) < independent
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


def test_abort_mid_search_frees_every_beam(llm: LLM, prompt_ids):
    engine = llm.engine
    engine.add_request(
        "beam-abort",
        prompt_ids[1],
        SamplingParams(use_beam_search=True, beam_width=3, n=2, max_tokens=30),
    )
    for _ in range(4):
        engine.step()
    finals = engine.abort_request("beam-abort")
    assert [o.index for o in finals] == [0, 1] and all(o.finish_reason == "abort" for o in finals)
    while engine.has_unfinished_requests():
        engine.step()
    check_pool(engine.core.block_manager, [])
    assert engine.core.scheduler.num_unforked == 0 and not engine.core.beams.groups


@pytest.mark.parametrize(
    "field, value",
    [
        ("beam_width", 0),
        ("n", 5),
        ("logprobs", 1),
        ("stop", ["x"]),
        ("early_stopping", "sometimes"),
        ("length_penalty", float("nan")),
    ],
)
def test_bad_beam_search_params_name_the_field(field: str, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{"use_beam_search": True, "beam_width": 4, field: value})


def test_search_stops_once_no_running_beam_can_beat_the_kept_hypotheses():
    """The transformers heuristic, on hand-made log-probs: two hypotheses end at once with high scores; the
    running beams' best score is already worse, so the search is done."""
    search = BeamSearch(width=2, max_new_tokens=10, eos_token_ids=(0,))
    step1 = torch.log(torch.tensor([[0.45, 0.35, 0.2]]))  # EOS, then tokens 1 and 2
    search.step(step1, [[]])
    assert not search.done and search.best(1)[0].token_ids == [0]
    step2 = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2]]))
    search.step(step2, [[1], [2]])
    assert search.done
    assert [h.token_ids for h in search.best(2)] == [[0], [1, 0]]


# ------------------------------------------------------------------ beam searches and a small KV pool


def _run_to_the_end(engine, max_steps: int) -> dict:
    """Every request's final outputs, the pool checked each step; fails (rather than hangs) on a stall."""
    finals: dict = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finals
        for out in engine.step():
            if out.finished:
                finals.setdefault(out.request_id, []).append(out)
        scheduler = engine.core.scheduler
        check_pool(
            engine.core.block_manager,
            list(scheduler.running) + list(scheduler.waiting) + list(scheduler.swapped),
        )
    raise AssertionError(f"not done after {max_steps} steps: stalled")


def test_beam_searches_that_fit_alone_but_not_together_all_finish(prompt_ids):
    """Three searches of 4 beams in a pool that holds any one, not all: each beam step needs every live beam's
    row, so beams awaiting their step would hold the blocks a preempted beam of theirs (or of another search)
    needs. The newest search gives its blocks back and all finish, with the tokens each gets alone."""
    params = SamplingParams(use_beam_search=True, beam_width=4, max_tokens=24, ignore_eos=True)
    prompts = [prompt_ids[0], prompt_ids[2], prompt_ids[4]]
    # (the file's blocks on the native kernels: a row's numbers depend on no other row, as in float32, and a step
    # costs a quarter of float32's; this test compares the engine with itself)
    alone = LLM(cpu_weights="file", kv_cache_memory_gib=SMALL_KV_GIB)
    expected = [out.token_ids for out in alone.beam_search(prompts, beam_width=4, max_tokens=24)]
    tight = LLM(cpu_weights="file", num_kv_blocks=14, max_model_len=96)
    for name, prompt, tenant in zip("xyz", prompts, ("a", "b", "b")):
        tight.engine.add_request(name, prompt, params, tenant=tenant)
    finals = _run_to_the_end(tight.engine, max_steps=3000)
    assert [finals[name][0].token_ids for name in "xyz"] == expected
    assert tight.engine.core.scheduler.num_preemptions > 0, "the pool was meant to be short"
    check_pool(tight.engine.core.block_manager, [])
    assert tight.engine.stats().num_free_blocks == tight.engine.stats().num_blocks


@pytest.mark.parametrize("beside", [False, True])
def test_a_beam_search_that_outgrows_the_kv_pool_ends_with_length_and_stalls_nothing(
    tokenizer, prompt_ids, beside, caplog
):
    """Six diverging beams of 85 tokens need more blocks than the pool's 14: a step needs every live beam's row,
    so the beams awaiting it would hold the blocks their last one needs, for good (the engine stepped empty). The
    search gives its blocks back while another request waits (that one runs with its own tokens), and ends with
    its best hypotheses ("length") once it is alone."""
    params = SamplingParams(use_beam_search=True, beam_width=6, max_tokens=85, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    light_prompt = tokenizer.encode("Name three rivers of Europe:")
    tight = LLM(cpu_weights="file", num_kv_blocks=14, max_model_len=96)  # (as above)
    if beside:
        tight.engine.add_request("light", light_prompt, greedy)
        expected_light = _run_to_the_end(tight.engine, max_steps=100)["light"][0].token_ids
    tight.engine.add_request("search", [1, 2, 3, 4, 5, 6, 7], params)
    finals = {}
    for _ in range(3000 if beside else 0):
        finals.update((out.request_id, out) for out in tight.engine.step() if out.finished)
        if tight.engine.core.scheduler.num_preemptions:
            break  # (the pool is short now: a request that comes waits for blocks)
    if beside:
        tight.engine.add_request("light", light_prompt, greedy)
    for name, outs in _run_to_the_end(tight.engine, max_steps=3000).items():
        finals[name] = outs[0]
    search = finals["search"]
    assert search.finish_reason == "length" and 8 < len(search.token_ids) < 85
    if beside:
        assert finals["light"].token_ids == expected_light
    assert ("gave way" in caplog.text) == beside and "beams need more KV" in caplog.text
    check_pool(tight.engine.core.block_manager, [])
    assert tight.engine.stats().num_free_blocks == tight.engine.stats().num_blocks
    assert not tight.engine.core.beams.groups and tight.engine.core.num_open_samples == 0
