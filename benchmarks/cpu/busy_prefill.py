"""A long prompt's first token on the CPU, on a quiet machine and beside a busy neighbour (issue 49).

The default model, in-process (LLMEngine), default settings (the CPU's step-time target and shared-step factor
included). After a warm-up (a few short requests: the step cost model gets its prices), a prompt of
``--prompt-tokens`` fresh token ids (no prefix hit) is sent alone, ``--repeats`` times: its TTFT, the steps its
prefill took and the prompt tokens per second they achieved. Then the same prompt beside a running stream (its
TTFT, and the stream's mean and longest interval between tokens meanwhile). Then again with one busy-looping
process beside the engine (``python -c "while True: pass"``: on a 2-vCPU machine, a neighbour taking one core),
after a warm-up under that load. The goal: busy TTFT <= 2x quiet TTFT.

    python -m benchmarks.cpu.busy_prefill [--prompt-tokens 2000] [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from dataclasses import asdict, dataclass
from random import Random

from benchmarks.harness import record
from benchmarks.harness.processes import neighbours
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

GOAL = 2.0  # busy TTFT / quiet TTFT
STREAM_TOKENS = 4096  # the stream beside the prompt: it outlasts the prompt's prefill


@dataclass(slots=True)
class Prefill:
    ttft_s: float
    steps: int  # steps from the request's arrival to its first token
    prompt_tok_s: float  # the prompt's tokens over its TTFT
    # beside a stream: the stream's mean and longest interval between tokens while the prompt was computed
    stream_mean_s: float | None = None
    stream_max_s: float | None = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warm-up-requests", type=int, default=4)
    parser.add_argument("--json", default=None, help="write the numbers here")
    return parser.parse_args(argv)


def warm_up(engine: LLMEngine, rng: Random, requests: int) -> None:
    """Short requests of a few sizes: first-run costs out of the way, the cost model priced on this load."""
    for i in range(requests):
        prompt = fresh_prompt(rng, 16 + 48 * i)
        engine.add_request(f"warm-up-{rng.random()}", prompt, greedy(8))
        run_all(engine)


def fresh_prompt(rng: Random, length: int) -> list[int]:
    return [rng.randrange(100, 20_000) for _ in range(length)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def run_all(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def first_token(engine: LLMEngine, prompt: list[int], stream: str | None) -> Prefill:
    """The prompt's TTFT (its request generates one token), and the ``stream``'s intervals meanwhile."""
    request_id = f"prompt-{time.monotonic_ns()}"
    start = time.perf_counter()
    engine.add_request(request_id, prompt, greedy(1))
    steps, stream_times = 0, [start]
    while True:
        outputs = engine.step()
        steps += 1
        now = time.perf_counter()
        if any(out.request_id == stream and out.token_ids for out in outputs):
            stream_times.append(now)
        if any(out.request_id == request_id and out.token_ids for out in outputs):
            break
    ttft = now - start
    gaps = [b - a for a, b in itertools.pairwise(stream_times)]
    return Prefill(
        ttft,
        steps,
        len(prompt) / ttft,
        statistics.mean(gaps) if gaps else None,
        max(gaps) if gaps else None,
    )


def measure(engine: LLMEngine, rng: Random, args: argparse.Namespace) -> dict[str, list[Prefill]]:
    """The prompt alone, then beside a stream, ``args.repeats`` times each."""
    warm_up(engine, rng, args.warm_up_requests)
    alone = [
        first_token(engine, fresh_prompt(rng, args.prompt_tokens), None)
        for _ in range(args.repeats)
    ]
    run_all(engine)
    beside = []
    for _ in range(args.repeats):
        stream = f"stream-{rng.random()}"
        engine.add_request(stream, fresh_prompt(rng, 32), greedy(STREAM_TOKENS))
        for _ in range(8):  # (the stream decodes before the prompt arrives)
            engine.step()
        beside.append(first_token(engine, fresh_prompt(rng, args.prompt_tokens), stream))
        engine.abort_request(stream)
        run_all(engine)
    return {"alone": alone, "beside a stream": beside}


def report(results: dict[str, dict[str, list[Prefill]]]) -> dict[str, float]:
    print(
        f"{'load':<6} {'case':<16} {'TTFT s':>8} {'steps':>6} {'prompt tok/s':>13} {'stream gap':>22}"
    )
    medians = {}
    for load, cases in results.items():
        for case, runs in cases.items():
            ttft = statistics.median(run.ttft_s for run in runs)
            medians[f"{load} {case}"] = ttft
            gaps = "-"
            if runs[0].stream_mean_s is not None:
                mean = statistics.median(run.stream_mean_s for run in runs)
                worst = max(run.stream_max_s for run in runs)
                gaps = f"mean {mean:.2f} s, max {worst:.2f} s"
            steps = statistics.median(run.steps for run in runs)
            tok_s = statistics.median(run.prompt_tok_s for run in runs)
            print(f"{load:<6} {case:<16} {ttft:>8.2f} {steps:>6.0f} {tok_s:>13.0f} {gaps:>22}")
    ratio = medians["busy alone"] / medians["quiet alone"]
    verdict = "meets" if ratio <= GOAL else "misses"
    print(f"busy / quiet TTFT, alone: {ratio:.2f}x ({verdict} the goal of {GOAL:.0f}x)")
    return {"busy_over_quiet": ratio, **medians}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load_before = record.load_average()
    engine = LLMEngine(device="cpu")
    rng = Random(0)
    results = {"quiet": measure(engine, rng, args)}
    with neighbours(1):
        results["busy"] = measure(engine, rng, args)
    env = record.environment(
        __spec__.name,
        engine.config.torch_device,
        load_before,
        step_time_target_s=engine.config.step_time_target_s,
        shared_step_time_factor=engine.config.shared_step_time_factor,
        prices=str(engine.core.scheduler.step_cost.prices()),
    )
    summary = report(results)
    print(f"prices after the busy run: {env['prices']}")
    print(record.environment_line(env))
    record.write_json(
        args.json,
        {
            "environment": env,
            "summary": summary,
            "runs": {
                load: {case: [asdict(run) for run in runs] for case, runs in cases.items()}
                for load, cases in results.items()
            },
        },
    )


if __name__ == "__main__":
    main()
