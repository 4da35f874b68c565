"""KV blocks saved by sharing (the PagedAttention paper, section 4.4 / figure 15): one prompt sampled ``--n``
times as one request (the prompt computed once, its blocks shared by fork, copy-on-write of the partly filled
last block), and beam search of width 4 and 8 (beams fork and share their common history; a beam that falls
out frees its blocks), each against as many independent requests for the same prompt (each with its own cache
salt, so nothing is shared).

A ``--prompt-len``-token prompt (ids uniform in [0, 10000) from ``random.Random(--seed)``), ``--output-len``
tokens per sample (EOS ignored; seeded sampling at temperature 1, so the samples differ). After every engine
step the blocks some sequence references are counted (``stats()``: total - free). Reported per mode: the peak
and the step-averaged count, the bound ``prompt blocks + n x (output blocks + 1)``, and the saving of the shared
mode over the independent one, next to the paper's figures as the issue quotes them (6-10% for parallel
sampling, 38-55% for beam search, on its traces, whose prompts and outputs differ from this synthetic one).

Beam search runs with EOS ignored for ``--output-len`` tokens, like the samples.

    python -m benchmarks.offline.sharing [--n 8] [--prompt-len 512] [--output-len 128] [--model-config llama-3.2-1b]
        [--device auto] [--json PATH]
    smoke test on the CPU: --device cpu --n 2 --prompt-len 40 --output-len 4 --model-config qwen3-0.6b
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import time
from dataclasses import asdict, dataclass


from benchmarks.harness import record
from benchmarks.harness.engine import add_engine_options, build_engine, release_memory
from benchmarks.harness.workloads import VOCAB
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

logger = logging.getLogger("benchmarks.offline.sharing")

PAPER = {"parallel sampling": "6-10%", "beam search": "38-55%"}


@dataclass(slots=True)
class ModeResult:
    mode: str
    sequences: int
    peak_blocks: int
    mean_blocks: float
    steps: int
    output_tokens: int
    seconds: float


def run_mode(
    engine: LLMEngine, mode: str, prompt: list[int], n: int, output_len: int, seed: int
) -> ModeResult:
    """``shared``: one request with n samples; ``beam``: beam search of width n; ``independent``: n requests,
    nothing shared."""
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=output_len, ignore_eos=True)
    expected_tokens = n * output_len
    if mode == "shared":
        engine.add_request(
            f"{mode}-{seed}",
            prompt,
            SamplingParams(**{**_fields(params), "n": n}),
            cache_salt=f"sharing-{mode}-{seed}",
        )
    elif mode == "beam":
        engine.add_request(
            f"{mode}-{n}-{seed}",
            prompt,
            SamplingParams(
                use_beam_search=True, beam_width=n, max_tokens=output_len, ignore_eos=True
            ),
            cache_salt=f"sharing-{mode}-{n}-{seed}",
        )
        expected_tokens = output_len  # the best hypothesis
    else:
        for i in range(n):
            engine.add_request(
                f"{mode}-{n}-{seed}-{i}",
                prompt,
                SamplingParams(**{**_fields(params), "seed": seed + i}),
                cache_salt=f"sharing-{mode}-{n}-{seed}-{i}",
            )
    counts, tokens, start = [], 0, time.perf_counter()
    while engine.has_unfinished_requests():
        tokens += sum(len(o.token_ids_delta) for o in engine.step())
        stats = engine.stats()
        counts.append(stats.num_blocks - stats.num_free_blocks)
    seconds = time.perf_counter() - start
    assert tokens == expected_tokens, (tokens, expected_tokens)
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks, "blocks still referenced after the run"
    return ModeResult(mode, n, max(counts), statistics.fmean(counts), len(counts), tokens, seconds)


def _fields(params: SamplingParams) -> dict:
    return {
        name: getattr(params, name) for name in ("temperature", "seed", "max_tokens", "ignore_eos")
    }


BEAM_WIDTHS = (4, 8)


def modes(n: int) -> list[tuple[str, int]]:
    """Each sharing mode, and as many independent requests as each mode has sequences."""
    return (
        [("independent", w) for w in sorted({n, *BEAM_WIDTHS})]
        + [("shared", n)]
        + [("beam", w) for w in BEAM_WIDTHS]
    )


def table(results: list[ModeResult], bounds: dict[int, int]) -> str:
    independent = {r.sequences: r for r in results if r.mode == "independent"}
    rows = [
        "| sharing | sequences | KV blocks, peak | KV blocks, step mean | saving vs independent (peak / mean) "
        "| paper's saving |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if r.mode == "independent":
            rows.append(
                f"| independent requests | {r.sequences} | {r.peak_blocks} | {r.mean_blocks:.1f} | - | - |"
            )
            continue
        base = independent[r.sequences]
        name, paper = (
            ("parallel sampling", PAPER["parallel sampling"])
            if r.mode == "shared"
            else ("beam search", PAPER["beam search"])
        )
        rows.append(
            f"| {name} | {r.sequences} | {r.peak_blocks} (bound {bounds[r.sequences]}) | "
            f"{r.mean_blocks:.1f} | {1 - r.peak_blocks / base.peak_blocks:.1%} / "
            f"{1 - r.mean_blocks / base.mean_blocks:.1%} | {paper} |"
        )
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--num-kv-blocks", type=int, default=2048, help="a pool the independent requests fit in"
    )
    parser.add_argument("--json", metavar="PATH")
    add_engine_options(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    load_before = record.load_average()
    rng = random.Random(args.seed)
    prompt = [rng.randrange(VOCAB) for _ in range(args.prompt_len)]
    engine = build_engine(args, seed=args.seed, num_kv_blocks=args.num_kv_blocks)
    device, block = engine.config.torch_device, engine.config.block_size
    results = [
        run_mode(engine, mode, prompt, width, args.output_len, args.seed)
        for mode, width in modes(args.n)
    ]
    assert engine.core.scheduler.num_preemptions == 0, (
        "the pool was too small: preemption distorts the counts"
    )
    del engine
    release_memory(device)
    bounds = {
        r.sequences: -(-args.prompt_len // block) + r.sequences * (-(-args.output_len // block) + 1)
        for r in results
    }
    env = record.environment(__spec__.name, device, load_before)
    workload = {
        k: getattr(args, k) for k in ("n", "prompt_len", "output_len", "seed", "model_config")
    }
    record.write_json(
        args.json,
        {
            "workload": workload,
            "block_size": block,
            "bounds": bounds,
            "environment": env,
            "modes": [asdict(r) for r in results],
        },
    )
    print(
        f"\n## sharing: one {args.prompt_len}-token prompt, {args.n} samples of {args.output_len} tokens; "
        f"{args.model_config} dummy, {env['device']}, block size {block}"
    )
    print(record.environment_line(env) + "\n")
    print(table(results, bounds))


if __name__ == "__main__":
    main()
