"""The engine's steady decode step at batch C, measured in process: the floor that ``benchmarks.online.serve
--compare-offline`` (workload ``serve-vs-engine``) holds the served TPOT and delivered tok/s against.

The engine is built from the very flags the server gets (``--server-args``), parsed by the server's own
parser, so the in-process engine and the served one run the same configuration. C requests are prefilled
(every prompt computed: the step is decode-only, C rows), a few steps run untimed, then ``engine.step()`` is
timed over at least ``min_steps`` consecutive steps. The engine is freed before returning, so that the server
started next gets the GPU memory back.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from random import Random
from typing import Any

from engine.config import EngineConfig

logger = logging.getLogger("benchmarks.offline.engine_step")

# decode steps after the prefill, untimed (the first replays of each graph, allocator growth)
WARMUP_STEPS = 5


def engine_config_from_server_args(server_args: list[str]) -> EngineConfig:
    """The EngineConfig that ``python -m app serve *server_args`` builds. The server's own parser reads the flags
    (``--flag value``, ``--flag``, ``--no-flag``), so the two cannot disagree; server-only flags (``--max-queue``)
    are accepted and have no effect here. An unknown flag exits with argparse's message, as the server would."""
    from app.cli import build_parser, engine_config_from_args

    return engine_config_from_args(build_parser().parse_args(["serve", *server_args]))


def random_prompts(batch: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    """``batch`` prompts of ``input_len`` ids uniform in [0, vocab), from one seeded generator."""
    rng = Random(seed)
    return [[rng.randrange(vocab) for _ in range(input_len)] for _ in range(batch)]


def decode_step_seconds(
    config: EngineConfig,
    prompts: list[list[int]],
    output_len: int,
    min_steps: int = 40,
    warmup_steps: int = WARMUP_STEPS,
) -> dict[str, Any]:
    """Wall seconds of one decode step at batch ``len(prompts)`` (mean and median), and what it implies: the
    engine's tok/s at that batch. The timed steps cover the contexts the served requests go through (from the
    end of the prefill to ``output_len`` tokens), and at least ``min_steps`` of them. The prompts are the
    caller's so the served run can send the very same ones."""
    from engine.llm_engine import LLMEngine

    start = time.perf_counter()
    engine = LLMEngine(config)
    build_seconds = time.perf_counter() - start
    device = engine.config.torch_device
    request_ids = [f"step-{i}" for i in range(len(prompts))]
    try:
        result = _measure(
            engine, dict(zip(request_ids, prompts)), output_len, min_steps, warmup_steps
        )
        _abort(engine, request_ids)
        result |= same_arrivals_tpot(engine, prompts, output_len)
    finally:
        _abort(engine, request_ids)
        engine.shutdown()  # (the KV tiers' thread and writes)
        del engine
        _release_memory(device)
    return {"build_seconds": build_seconds, **result}


def same_arrivals_tpot(engine: Any, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    """The engine's own TPOT p50 (per request: (last token - first token) / (tokens - 1)) for the served run's
    arrivals: all prompts at once, ``output_len`` tokens each, stepped to the end in process. It includes what the
    served TPOT includes and a decode step does not: the steps where later prompts' prefill chunks run beside the
    first requests' decodes. (Each prompt's first id is changed, so nothing hits the prefix cache of the decode
    measurement.)"""
    from benchmarks.harness.engine import greedy

    vocab = engine.config.hf_config.vocab_size
    ids = {f"arrivals-{i}": [(p[0] + 1) % vocab, *p[1:]] for i, p in enumerate(prompts)}
    times: dict[str, list[float]] = {request_id: [] for request_id in ids}
    for request_id, prompt in ids.items():
        engine.add_request(request_id, prompt, greedy(output_len))
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            times[out.request_id] += [now] * len(out.token_ids_delta)
    tpots = sorted((t[-1] - t[0]) / (len(t) - 1) * 1e3 for t in times.values() if len(t) > 1)
    tpot = statistics.median(tpots) if tpots else None
    logger.info(
        "engine: TPOT p50 %.2f ms on the served run's arrivals, in process", tpot or float("nan")
    )
    return {"arrivals_tpot_ms_p50": tpot}


def _measure(
    engine: Any, requests: dict[str, list[int]], output_len: int, min_steps: int, warmup_steps: int
) -> dict[str, Any]:
    from benchmarks.harness.engine import greedy, synchronize
    from benchmarks.offline.nano import time_steps

    prompts, batch = list(requests.values()), len(requests)
    max_tokens = engine_max_tokens(engine.config, prompts, output_len, min_steps, warmup_steps)
    for request_id, prompt in requests.items():
        engine.add_request(request_id, prompt, greedy(max_tokens))
    start = time.perf_counter()
    prefill_steps = _step_until_decode_only(engine, batch)
    synchronize(engine.config.torch_device)
    prefill_seconds = time.perf_counter() - start
    for _ in range(warmup_steps):
        engine.step()
    lead = max(seq.num_tokens - seq.num_prompt_tokens for seq in engine.last_batch.seqs)
    steps = max(min_steps, output_len - lead)
    timed = time_steps(engine, steps)
    # every timed step decoded all C: none finished, and each step produced C tokens
    full = timed["finished_during"] == 0 and round(timed["tokens_per_step"]) == batch
    if not full:
        logger.warning("the timed steps were not all full decode batches of %d: %s", batch, timed)
    step_s = timed["wall_ms_mean"] / 1e3
    logger.info(
        "engine: decode step at batch %d: %.2f ms mean, %.2f ms median over %d steps (%.0f tok/s)",
        batch,
        timed["wall_ms_mean"],
        timed["wall_ms_median"],
        steps,
        batch / step_s,
    )
    return {
        "batch": batch,
        "input_len": len(prompts[0]),
        "max_tokens": max_tokens,
        "prefill_steps": prefill_steps,
        "prefill_seconds": prefill_seconds,
        "warmup_steps": warmup_steps,
        "steps": steps,
        "context_first": len(prompts[0]) + lead,
        "context_last": len(prompts[0]) + lead + steps,
        "step_ms_mean": timed["wall_ms_mean"],
        "step_ms_median": timed["wall_ms_median"],
        "tok_s": batch / step_s,
        "host_ms": timed["host_ms"],
        "full_batches": full,
        "device": str(engine.config.torch_device),
        "dtype": str(engine.config.torch_dtype),
        "model": engine.config.model_id,
    }


def engine_max_tokens(
    config: EngineConfig,
    prompts: list[list[int]],
    output_len: int,
    min_steps: int,
    warmup_steps: int,
) -> int:
    """Enough that no request finishes before the timed steps end: during a prefill of P steps (the prompts'
    tokens over the step's token budget) the first request prefilled may produce up to P tokens already."""
    prefill_bound = math.ceil(sum(map(len, prompts)) / config.max_num_batched_tokens) + 1
    wanted = output_len + prefill_bound + warmup_steps + min_steps
    return min(wanted, config.max_model_len - max(map(len, prompts)))


def _step_until_decode_only(engine: Any, batch: int) -> int:
    """Step until a step is decode-only with all ``batch`` requests (every prompt computed); the steps taken."""
    steps = 0
    while True:
        engine.step()
        steps += 1
        shape = engine.last_batch
        if len(shape.seqs) == batch and shape.num_decodes == batch:
            return steps
        if not engine.has_unfinished_requests():
            raise RuntimeError(
                f"the requests finished before a decode-only step of {batch} (max_tokens too small?)"
            )


def _abort(engine: Any, request_ids: list[str]) -> None:
    """End the requests (they were given room to run past the timed steps) and drain the pipeline."""
    for request_id in request_ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()


def _release_memory(device: Any) -> None:
    from benchmarks.harness.engine import release_memory

    release_memory(device)
    if device.type == "cuda":
        import torch

        logger.info(
            "engine freed: %.2f GiB still allocated on %s",
            torch.cuda.memory_allocated(device) / 2**30,
            device,
        )
