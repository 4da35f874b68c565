"""How far an FP8 KV cache (``--kv-cache-dtype fp8``: e4m3, per-layer scales 1.0) moves the default model's greedy
output from the model-dtype cache, on the CPU with the real weights. The reference is ``--cpu-weights float32`` (the
module path, token-exact with transformers) with a float32 cache; the FP8 run differs only in the cache. 16 chat
prompts (tests/engine/test_cpu_weights.py's) x 64 greedy tokens, EOS ignored. For scale, the same numbers for the
weights' own drift (``--weights-drift``: bfloat16 and q4 weights over a float32 cache, against the same reference)
and for FP8 over the q4 weights against q4 with a float32 cache (the CPU's default weights).

Every engine runs with ``step_time_target_s=0``: prefill chunks cut by measured step time would make the batches,
hence the last bits of the float32 K and V, depend on timing, and the e4m3 rounding turns such a one-ulp
difference into a visible one now and then (measured: FP8 runs then differ from each other; float32 runs do not).

Per run: prompts whose first token equals the reference's, the mean share of each output identical to the
reference's before the first difference, the share of all positions equal, and the mean |logprob difference| of
the chosen tokens where both runs had the same context and chose the same token (the positions before the first
difference); and its output tokens/s (all prompts as one batch, after one warm-up request; the CPU runs an FP8
cache through the torch references, not the native decode step, so FP8 is a memory option there, not a speed one).

    python -m benchmarks.cpu.kv_fp8_quality [--prompts 16] [--tokens 64] [--weights-drift bfloat16 q4] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import record

from engine.chat_template import chat_prompt_ids
from engine.config import EngineConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.worker.tokenizer_files import load_tokenizer
from engine.worker.model_sources import ensure_default_model
from tests.engine.test_cpu_weights import QUESTIONS, first_divergence


@dataclass(slots=True)
class GreedyRun:
    tokens: list[list[int]]  # per prompt
    logprobs: list[list[float]]  # per prompt, each chosen token's log-probability
    tokens_per_s: float  # output tokens / wall seconds of the whole batch


def greedy_run(llm: LLM, prompts: list[list[int]], tokens: int) -> GreedyRun:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=0)
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=2))  # (warm-up)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    return GreedyRun(
        [o.token_ids for o in outputs],
        [[lp.logprob for lp in o.logprobs] for o in outputs],
        sum(len(o.token_ids) for o in outputs) / seconds,
    )


def compare(reference: GreedyRun, other: GreedyRun) -> dict[str, float]:
    """Agreement of ``other`` with ``reference`` (see the module's docstring)."""
    pairs = list(zip(reference.tokens, other.tokens))
    shared = [first_divergence(a, b) for a, b in pairs]
    diffs = [
        abs(x - y)
        for n, ra, ro in zip(shared, reference.logprobs, other.logprobs)
        for x, y in zip(ra[:n], ro[:n])
    ]
    return {
        "prompts": len(pairs),
        "first_token_equal": sum(a[0] == b[0] for a, b in pairs),
        "identical_prefix_share": sum(n / len(a) for n, (a, _) in zip(shared, pairs)) / len(pairs),
        "positions_equal": sum(x == y for a, b in pairs for x, y in zip(a, b))
        / sum(len(a) for a, _ in pairs),
        "mean_abs_logprob_diff": sum(diffs) / len(diffs) if diffs else float("nan"),
        "max_abs_logprob_diff": max(diffs, default=float("nan")),
        "tokens_per_s": other.tokens_per_s,
        "reference_tokens_per_s": reference.tokens_per_s,
    }


def chat_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    """The first ``count`` chat prompts, each one user question, templated for the model."""
    return [chat_prompt_ids(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS[:count]]


def engine_run(prompts: list[list[int]], tokens: int, **options) -> GreedyRun:
    """A fresh engine of ``options`` runs the prompts and is shut down (one model in memory at a time)."""
    llm = LLM(**options)
    try:
        return greedy_run(llm, prompts, tokens)
    finally:
        llm.shutdown()
        del llm
        gc.collect()


def measure(
    prompts_count: int, tokens: int, threads: int, weights_drift: list[str]
) -> dict[str, dict[str, float]]:
    """Each run's agreement, by name."""
    common = dict(num_threads=threads, kv_cache_memory_gib=0.25, step_time_target_s=0)
    tokenizer = load_tokenizer(ensure_default_model(Path(EngineConfig(device="cpu").cache_dir)))
    prompts = chat_prompts(tokenizer, prompts_count)
    reference = engine_run(prompts, tokens, cpu_weights="float32", **common)
    results = {
        "fp8 KV, float32 weights": compare(
            reference,
            engine_run(prompts, tokens, cpu_weights="float32", kv_cache_dtype="fp8", **common),
        )
    }
    for mode in weights_drift:
        results[f"float32 KV, {mode} weights"] = compare(
            reference, engine_run(prompts, tokens, cpu_weights=mode, **common)
        )
    if "q4" in weights_drift:
        q4_reference = engine_run(prompts, tokens, cpu_weights="q4", **common)
        results["fp8 KV, q4 weights (vs q4 weights, float32 KV)"] = compare(
            q4_reference,
            engine_run(prompts, tokens, cpu_weights="q4", kv_cache_dtype="fp8", **common),
        )
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=16, help="how many of the 16 chat prompts")
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument(
        "--weights-drift",
        nargs="*",
        default=["bfloat16", "q4"],
        help="cpu_weights modes whose drift (float32 KV) is shown for scale",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = record.load_average()
    results = measure(args.prompts, args.tokens, args.threads, args.weights_drift)
    print(
        f"\n{args.prompts} prompts x {args.tokens} greedy tokens; reference: float32 weights, float32 KV"
    )
    print(
        "| run | first token equal | identical prefix, mean share | positions equal | mean \\|logprob diff\\| "
        "(shared prefix) | max \\|logprob diff\\| | tok/s (its reference's) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        print(
            f"| {name} | {r['first_token_equal']}/{r['prompts']} | {r['identical_prefix_share']:.2f} | "
            f"{r['positions_equal']:.2f} | {r['mean_abs_logprob_diff']:.4f} | {r['max_abs_logprob_diff']:.3f} | "
            f"{r['tokens_per_s']:.0f} ({r['reference_tokens_per_s']:.0f}) |"
        )
    env = record.environment(__spec__.name, "cpu", load_before=load_before, threads=args.threads)
    print(record.environment_line(env))
    record.write_json(args.json, {"environment": env, "runs": results})


if __name__ == "__main__":
    main()
