"""The CPU step's thread count, measured as the engine runs (engine/worker/cpu_threads.py): trials alternate the
kept count and the other candidate step by step and keep the faster by the margin; and the native step's tokens
and log-probabilities do not depend on the thread count, so greedy output is the same while trials run."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.worker import cpu_threads
from engine.worker.cpu_threads import (
    MARGIN,
    MAX_TRIAL_EVERY_S,
    TRIAL_EVERY_S,
    TRIAL_STEPS,
    ThreadTuner,
)
from tests.conftest import SMALL_KV_GIB


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_trial(tuner: ThreadTuner, seconds_at: dict[int, float], rows: int = 1) -> list[int]:
    """One trial's steps (the clock moved to its start), each taking ``seconds_at[threads]``; the counts used."""
    tuner.clock.now = tuner.next_trial
    used = []
    for _ in range(TRIAL_STEPS):
        tuner.before_step()
        used.append(torch.get_num_threads())
        tuner.after_step(rows, seconds_at[used[-1]])
    return used


def test_a_trial_alternates_and_keeps_the_faster_count(restore_threads):
    clock = Clock()
    tuner = ThreadTuner(2, clock)
    tuner.before_step()  # (before the first trial is due: the kept count)
    assert torch.get_num_threads() == 2 and tuner.samples is None
    tuner.after_step(1, 0.005)
    # quiet: 2 threads faster; the kept count stays
    used = run_trial(tuner, {2: 0.005, 1: 0.007})
    assert used == [2, 1] * (TRIAL_STEPS // 2)
    assert tuner.threads == 2 and tuner.trials == 1 and torch.get_num_threads() == 2
    assert tuner.next_trial == clock.now + 2 * TRIAL_EVERY_S, "a trial that keeps the count: later"
    # a neighbour takes a core: 1 thread is faster; switched
    run_trial(tuner, {2: 0.016, 1: 0.007})
    assert tuner.threads == 1 and tuner.switches == 1 and torch.get_num_threads() == 1
    assert tuner.next_trial == clock.now + TRIAL_EVERY_S, "after a switch: soon"
    # the next trial tries 2 again: within the margin, 1 stays; once the neighbour has gone, back to 2
    run_trial(tuner, {2: 0.007 * (MARGIN + 0.05), 1: 0.007})
    assert tuner.threads == 1
    run_trial(tuner, {2: 0.005, 1: 0.007})
    assert tuner.threads == 2 and tuner.switches == 2
    for _ in range(5):  # (kept again and again: the wait doubles up to its cap)
        run_trial(tuner, {2: 0.005, 1: 0.007})
    assert tuner.next_trial == clock.now + MAX_TRIAL_EVERY_S


def test_a_trial_compares_steps_of_its_most_common_row_count(restore_threads):
    """Steps of other shapes (a long prompt's chunk) do not count, and too few steps of a shape decide nothing."""
    tuner = ThreadTuner(2, Clock())
    tuner.clock.now = tuner.next_trial
    for i in range(TRIAL_STEPS):
        tuner.before_step()
        threads = torch.get_num_threads()
        # the 1-thread steps are the long ones, but only because they are prompts (rows 512): 1 row decides
        rows = 512 if threads == 1 and i % 4 == 1 else 1
        tuner.after_step(rows, 0.5 if rows == 512 else (0.004 if threads == 1 else 0.006))
    assert tuner.threads == 1, "the one-row steps were faster at 1 thread"
    tuner.clock.now = tuner.next_trial
    for i in range(TRIAL_STEPS):  # every step a new shape: nothing to compare
        tuner.before_step()
        tuner.after_step(i + 1, 0.001 if torch.get_num_threads() == 2 else 0.009)
    assert tuner.threads == 1 and tuner.trials == 2


def test_greedy_tokens_and_logprobs_do_not_change_while_trials_run(restore_threads, monkeypatch):
    """Every step alternates 2 and 1 threads (a trial always running): the tokens and log-probabilities of plain
    runs at a fixed count."""
    torch.set_num_threads(2)
    prompts = ["The capital of France is", "def add(a, b):\n    return a + b\n"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    fixed = LLM(kv_cache_memory_gib=SMALL_KV_GIB, num_threads=2)
    expected = fixed.generate(prompts, params)
    monkeypatch.setattr(cpu_threads, "TRIAL_EVERY_S", 0.0)
    monkeypatch.setattr(cpu_threads, "MARGIN", 0.0)  # (never switch: every trial alternates again)
    llm = LLM(kv_cache_memory_gib=SMALL_KV_GIB)
    tuner = llm.engine.core.runner.threads
    assert tuner is not None and fixed.engine.core.runner.threads is None
    outputs = llm.generate(prompts, params)
    assert tuner.trials >= 1
    for got, want in zip(outputs, expected):
        assert list(got.token_ids) == list(want.token_ids)
        assert [(p.logprob, p.top) for p in got.logprobs] == [
            (p.logprob, p.top) for p in want.logprobs
        ]
