"""Fairness inside the engine, without the server: a light tenant's request beside a heavy tenant's n = 128,
in-process (LLMEngine), so the engine's share of a served TPOT (benchmarks/online/fairness.py) can be told from the
front's.

Per run: the light request's mean interval between its tokens (wall time of the steps that gave it one), the
rows of those steps, the same request alone, and the shared step's measured prices. Dummy weights on a GPU; the
default model on the CPU.

    python -m benchmarks.online.fairness_engine                       # GPU: dummy llama-3.2-1b
    python -m benchmarks.online.fairness_engine --device cpu          # CPU: the default model
"""

from __future__ import annotations

import argparse
import statistics
import time
from random import Random


from benchmarks.harness import record
from benchmarks.harness.engine import add_engine_options, build_engine, greedy, synchronize, warm_up
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_engine_options(parser)
    parser.add_argument("--light-tokens", type=int, default=128)
    parser.add_argument("--heavy-tokens", type=int, default=1000)
    parser.add_argument("--prompt-len", type=int, default=48)
    parser.add_argument(
        "--factor", type=float, default=None, help="shared_step_time_factor (default: the engine's)"
    )
    return parser.parse_args(argv)


def light_intervals(
    engine: LLMEngine,
    prompt: list[int],
    tokens: int,
    heavy: bool,
    heavy_prompt: list[int],
    heavy_tokens: int,
) -> tuple[list[float], list[int]]:
    """Seconds between the light request's tokens, and the rows of each step while it ran."""
    if heavy:
        engine.add_request(
            "heavy",
            heavy_prompt,
            SamplingParams(
                temperature=1.0, n=128, max_tokens=heavy_tokens, ignore_eos=True, seed=1
            ),
            tenant="heavy",
        )
        for _ in range(3):  # the heavy request runs: its prompt computed, its samples forked
            engine.step()
    engine.add_request("light", prompt, greedy(tokens), tenant="light")
    times, rows = [], []
    while engine.core.has_request("light"):
        outputs = engine.step()
        synchronize(engine.config.torch_device)
        rows.append(len(engine.last_batch.seqs))
        if any(out.request_id == "light" and out.token_ids for out in outputs):
            times.append(time.perf_counter())
    while engine.has_unfinished_requests():
        engine.abort_request("heavy")
        engine.step()
    return [b - a for a, b in zip(times, times[1:])], rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    options = {} if args.factor is None else {"shared_step_time_factor": args.factor}
    if args.device == "cpu":
        engine = LLMEngine(**options, device="cpu", kv_cache_memory_gib=1.0)
    else:
        engine = build_engine(args, **options)
        warm_up(engine, args.prompt_len)
    rng = Random(0)
    prompt = [rng.randrange(100, 20_000) for _ in range(args.prompt_len)]
    heavy_prompt = [rng.randrange(100, 20_000) for _ in range(args.prompt_len)]
    alone, _ = light_intervals(
        engine, prompt, args.light_tokens, False, heavy_prompt, args.heavy_tokens
    )
    shared, rows = light_intervals(
        engine, prompt, args.light_tokens, True, heavy_prompt, args.heavy_tokens
    )
    print(record.environment_line(record.environment(__spec__.name, engine.config.torch_device)))
    print(
        f"factor {engine.config.shared_step_time_factor}; "
        f"prices {engine.core.scheduler.step_cost.prices()}"
    )
    print(f"light alone:      {statistics.median(alone) * 1e3:.3f} ms per token (median)")
    print(
        f"beside n=128:     {statistics.median(shared) * 1e3:.3f} ms per token (median), "
        f"{statistics.mean(shared) * 1e3:.3f} mean; rows per step median {statistics.median(rows)}, "
        f"mean {statistics.mean(rows):.1f}"
    )
    print(f"ratio (median):   {statistics.median(shared) / statistics.median(alone):.2f}")


if __name__ == "__main__":
    main()
