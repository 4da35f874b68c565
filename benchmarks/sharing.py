"""KV blocks saved by sharing (the PagedAttention paper, section 4.4 / figure 15): one prompt sampled ``--n``
times as one request (the prompt computed once, its blocks shared by fork, copy-on-write of the partly filled
last block) against ``--n`` independent requests for the same prompt (each with its own cache salt, so nothing
is shared).

A ``--prompt-len``-token prompt (ids uniform in [0, 10000) from ``random.Random(--seed)``), ``--output-len``
tokens per sample (EOS ignored; seeded sampling at temperature 1, so the samples differ). After every engine
step the blocks some sequence references are counted (``stats()``: total - free). Reported per mode: the peak
and the step-averaged count, the bound ``prompt blocks + n x (output blocks + 1)``, and the saving of the shared
mode over the independent one, next to the paper's figures as the issue quotes them (6-10% for parallel
sampling, 38-55% for beam search, on its traces, whose prompts and outputs differ from this synthetic one).

Beam search is not built yet (issue 13); its rows say so.

    python -m benchmarks.sharing [--n 8] [--prompt-len 512] [--output-len 128] [--model-config llama-3.2-1b]
        [--device auto] [--json PATH]
    smoke test on the CPU: --device cpu --n 2 --prompt-len 40 --output-len 4 --model-config qwen3-0.6b
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from benchmarks.common import add_engine_options, build_engine, environment, release_memory
from benchmarks.workloads import VOCAB
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

logger = logging.getLogger("benchmarks.sharing")

PAPER = {"parallel sampling": "6-10%", "beam search": "38-55%"}


@dataclass(slots=True)
class ModeResult:
    mode: str
    peak_blocks: int
    mean_blocks: float
    steps: int
    output_tokens: int
    seconds: float


def run_mode(engine: LLMEngine, mode: str, prompt: list[int], n: int, output_len: int, seed: int) -> ModeResult:
    """``shared``: one request with n samples; ``independent``: n requests, nothing shared."""
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=output_len, ignore_eos=True)
    if mode == "shared":
        engine.add_request(f"{mode}-{seed}", prompt, SamplingParams(**{**_fields(params), "n": n}),
                           cache_salt=f"sharing-{mode}-{seed}")
    else:
        for i in range(n):
            engine.add_request(f"{mode}-{seed}-{i}", prompt, SamplingParams(**{**_fields(params), "seed": seed + i}),
                               cache_salt=f"sharing-{mode}-{seed}-{i}")
    counts, tokens, start = [], 0, time.perf_counter()
    while engine.has_unfinished_requests():
        tokens += sum(len(o.token_ids_delta) for o in engine.step())
        stats = engine.stats()
        counts.append(stats.num_blocks - stats.num_free_blocks)
    seconds = time.perf_counter() - start
    assert tokens == n * output_len, (tokens, n * output_len)
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks, "blocks still referenced after the run"
    return ModeResult(mode, max(counts), statistics.fmean(counts), len(counts), tokens, seconds)


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in ("temperature", "seed", "max_tokens", "ignore_eos")}


def table(results: dict[str, ModeResult], bound: int, n: int) -> str:
    shared, independent = results["shared"], results["independent"]
    peak_saving = 1 - shared.peak_blocks / independent.peak_blocks
    mean_saving = 1 - shared.mean_blocks / independent.mean_blocks
    rows = ["| sharing | KV blocks, peak | KV blocks, step mean | saving (peak / mean) | paper's saving |",
            "|---|---:|---:|---:|---:|",
            f"| {n} independent requests | {independent.peak_blocks} | {independent.mean_blocks:.1f} | - | - |",
            f"| parallel sampling, n={n} | {shared.peak_blocks} (bound {bound}) | {shared.mean_blocks:.1f} | "
            f"{peak_saving:.1%} / {mean_saving:.1%} | {PAPER['parallel sampling']} |",
            f"| beam search | not built yet | | | {PAPER['beam search']} |"]
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH")
    add_engine_options(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    load_before = os.getloadavg()[0]
    rng = random.Random(args.seed)
    prompt = [rng.randrange(VOCAB) for _ in range(args.prompt_len)]
    engine = build_engine(args, seed=args.seed)
    device, block = engine.config.torch_device, engine.config.block_size
    results = {mode: run_mode(engine, mode, prompt, args.n, args.output_len, args.seed)
               for mode in ("shared", "independent")}
    del engine
    release_memory(device)
    bound = -(-args.prompt_len // block) + args.n * (-(-args.output_len // block) + 1)
    env = environment(device, load_before, "benchmarks.sharing")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": {k: getattr(args, k) for k in ("n", "prompt_len", "output_len", "seed",
                                                                  "model_config")},
                       "block_size": block, "bound": bound, "environment": env,
                       "modes": {m: asdict(r) for m, r in results.items()}}, f, indent=2)
    print(f"\n## sharing: one {args.prompt_len}-token prompt, {args.n} samples of {args.output_len} tokens; "
          f"{args.model_config} dummy, {env['device']}, block size {block}")
    print(f"{env['date']}, torch {env['torch']}; command: {env['command']}\n")
    print(table(results, bound, args.n))


if __name__ == "__main__":
    main()
