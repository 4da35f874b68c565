"""The CPU step's thread count, chosen by measuring steps as the engine runs (``num_threads`` unset).

A step's parallel sections end at barriers. With another process busy on one of the cores, the thread that
shares that core runs a scheduler slice at a time and every barrier waits for it: on 2 vCPUs with one busy loop
beside the server, a 128-token stream took 2.63-2.72 s at 2 threads against 0.91-0.97 s at 1 (quiet: 0.72-0.74 s
against 0.87-0.92). Which count is faster depends on what else runs, so the runner measures: every
few seconds it runs a trial of ``TRIAL_STEPS`` steps alternating between the count it keeps and the other
candidate (all the threads torch started with, or half of them), and keeps the other when the medians of the
trial's steps of its most common row count say it is faster by ``MARGIN``. Alternating step by step compares
the two under the same load and nearly the same contexts; a trial costs a few steps at the slower count, so the
wait between trials doubles while they keep the count (``TRIAL_EVERY_S`` up to ``MAX_TRIAL_EVERY_S``: a
neighbour that comes or goes is noticed within that).

Only where the step's numbers do not depend on the thread count: the native CPU step (kernels/cpu_decode.cpp),
whose parallel tasks each compute their own outputs in a fixed order, and the GGUF output layer; so greedy tokens
do not change with it (tests/engine/test_cpu_threads.py).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

from engine.config import EngineConfig

logger = logging.getLogger(__name__)
T = TypeVar("T")

TRIAL_EVERY_S = 5.0  # seconds of steps before the first trial and after one that switched
MAX_TRIAL_EVERY_S = (
    40.0  # each trial that keeps the count doubles the wait before the next, up to this
)
TRIAL_STEPS = 16  # steps of a trial, half at each count
MIN_SAMPLES = 4  # steps of each count (of the trial's most common row count) a decision needs
MARGIN = (
    0.9  # the other count is kept when its median step is at most this fraction of the kept one's
)


class ThreadTuner:
    def __init__(self, max_threads: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_threads = self.threads = max_threads
        self.clock = clock
        self.next_trial = clock() + TRIAL_EVERY_S
        self.interval = TRIAL_EVERY_S
        self.candidate = 0  # the count tried against ``threads`` in the running trial
        self.samples: list[tuple[int, int, float]] | None = (
            None  # its (threads, rows, seconds); None: none runs
        )
        self.trials = self.switches = 0

    def run(self, step: Callable[[], T], rows: int) -> T:
        """``step()`` (a CPU step of ``rows`` token rows, run by the time it returns) at this step's count."""
        self.before_step()
        start = time.perf_counter()
        result = step()
        self.after_step(rows, time.perf_counter() - start)
        return result

    def before_step(self) -> None:
        """Set the coming step's thread count (a trial's steps alternate)."""
        if self.samples is None and self.clock() >= self.next_trial:
            self.samples = []
            self.candidate = (
                self.max_threads
                if self.threads < self.max_threads
                else max(1, self.max_threads // 2)
            )
        count = self.threads
        if self.samples is not None and len(self.samples) % 2:
            count = self.candidate
        if torch.get_num_threads() != count:
            torch.set_num_threads(count)

    def after_step(self, rows: int, seconds: float) -> None:
        """The step just run: ``rows`` token rows in ``seconds``."""
        if self.samples is None:
            return
        self.samples.append((torch.get_num_threads(), rows, seconds))
        if len(self.samples) >= TRIAL_STEPS:
            self._decide()

    def _decide(self) -> None:
        samples, self.samples = self.samples, None
        self.trials += 1
        self.interval = min(2 * self.interval, MAX_TRIAL_EVERY_S)
        rows = Counter(r for _, r, _ in samples).most_common(1)[0][0]
        kept = [s for t, r, s in samples if r == rows and t == self.threads]
        tried = [s for t, r, s in samples if r == rows and t == self.candidate]
        if min(len(kept), len(tried)) >= MIN_SAMPLES:
            kept_s, tried_s = statistics.median(kept), statistics.median(tried)
            if tried_s <= MARGIN * kept_s:
                logger.info(
                    "CPU threads %d -> %d: a %d-row step took %.1f ms at %d, %.1f ms at %d",
                    self.threads,
                    self.candidate,
                    rows,
                    1000 * kept_s,
                    self.threads,
                    1000 * tried_s,
                    self.candidate,
                )
                self.threads = self.candidate
                self.switches += 1
                self.interval = TRIAL_EVERY_S
        self.next_trial = self.clock() + self.interval
        torch.set_num_threads(self.threads)


def thread_tuner(config: EngineConfig, model: nn.Module) -> ThreadTuner | None:
    """A tuner where it applies: the CPU, one rank, ``num_threads`` unset, more than one thread, and a model whose
    step is the native one (its numbers independent of the thread count)."""
    decoder = getattr(model, "cpu_decoder", None)
    native = decoder is not None and decoder.native_step is not None
    if config.torch_device.type != "cpu" or config.num_threads is not None or not native:
        return None
    if config.tensor_parallel_size > 1 or torch.get_num_threads() < 2:
        return None
    return ThreadTuner(torch.get_num_threads())
