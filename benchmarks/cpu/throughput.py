"""Workload ``cpu`` (shared WORKLOADS.md): the embedded default model on a small CPU budget.

SmolLM2-135M-Instruct with ``--cpu-weights`` (default: the engine's auto, the file's own blocks), ``--threads``
threads; one stream and ``--streams`` concurrent streams of ``--new-tokens`` greedy tokens each (EOS ignored, so
every stream produces exactly that many), and the time to the first token of a ~``--long-prompt``-token prompt.
Peers in the same run (``--peer``, one or more):

- ``transformers``: ``generate`` on the float32 export of the same GGUF file (tests/hf_export.py; single
  prompt; a left-padded batch).
- ``llama-cpp``: llama-cpp-python on the very GGUF file the default model comes from. It serves one sequence at
  a time, so N streams are N sequential generations (its aggregate tok/s); its KV cache is cleared before each.
  ``--llama-cpp-dir DIR`` takes it from a ``pip install --target DIR`` build (one per instruction-set level: the
  CMAKE_ARGS are in docs/benchmarks/cpu.md), so that it runs at the level ours runs at (``--isa``).

Output tokens/s = streams x new tokens / wall seconds from submit to all finished. Each of ours' runs gets a fresh
``cache_salt`` so no run reuses the previous run's prefix-cache blocks. With ``--repeats`` the sides alternate
and the table shows each side's best run. A greedy check compares ours' tokens with transformers' on one prompt
(identical with ``--cpu-weights float32``; with a quantized mode it reports where they part).

    python -m benchmarks.cpu.throughput [--cpu-weights auto] [--isa auto] [--peer transformers llama-cpp]
                             [--llama-cpp-dir DIR] [--threads 2] [--new-tokens 128] [--streams 8] [--repeats 1]
                             [--json PATH] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import logging
import os
import pstats
import statistics
import sys
import time
from pathlib import Path
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from benchmarks.harness import record
from benchmarks.harness.peers import LlamaCppPeer, Peer, TransformersPeer
from engine.config import CPU_WEIGHTS
from engine.llm import LLM
from kernels.cpu_native import CPU_ISA_CHOICES
from engine.sampling_params import SamplingParams

logger = logging.getLogger("benchmarks.cpu.throughput")

QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about autumn leaves falling in a quiet park.",
    "Explain in simple words why the sky is blue during the day.",
    "Give me three tips for staying focused while studying at home.",
    "How do I reverse a list in Python?",
    "What are the main differences between a cat and a dog as a pet for a small apartment?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "Suggest a name for a friendly robot that helps children learn to read and write.",
)
PROMPT_LENGTHS = (20, 60)
WARM_UP_TOKENS = 8
_SALTS = itertools.count()


@dataclass(slots=True)
class Side:
    """One engine on one scenario: wall seconds of each repeat."""

    streams: int
    new_tokens: int
    seconds: list[float] = field(default_factory=list)

    @property
    def best_tok_s(self) -> float:
        return self.streams * self.new_tokens / min(self.seconds)

    @property
    def median_tok_s(self) -> float:
        return self.streams * self.new_tokens / statistics.median(self.seconds)


@dataclass(slots=True)
class Latency:
    """Ours, driven step by step: mean time to first token and mean time per output token after it."""

    streams: int
    ttft_s: float
    tpot_s: float


# prompts -------------------------------------------------------------------------------------------------


def chat_prompts(llm: LLM, count: int) -> list[list[int]]:
    """``count`` chat prompts (cycling through QUESTIONS) rendered with the model's chat template."""
    prompts = [llm.chat_prompt_ids([{"role": "user", "content": q}]) for q in QUESTIONS]
    low, high = PROMPT_LENGTHS
    for ids in prompts:
        if not low <= len(ids) <= high:
            logger.warning(
                "prompt of %d tokens is outside the workload's %d-%d", len(ids), low, high
            )
    return [prompts[i % len(prompts)] for i in range(count)]


# ours ----------------------------------------------------------------------------------------------------


def greedy(new_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)


def run_ours(llm: LLM, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, greedy(new_tokens), cache_salt=f"bench-{next(_SALTS)}")
    seconds = time.perf_counter() - start
    return seconds, [o.token_ids for o in outputs]


def measure_latency(llm: LLM, prompts: list[list[int]], new_tokens: int) -> Latency:
    """Drive ``llm.engine`` directly to time each request's first token and the gaps between its tokens."""
    engine, salt = llm.engine, f"bench-{next(_SALTS)}"
    request_ids = [f"latency-{salt}-{i}" for i in range(len(prompts))]
    start = time.perf_counter()
    for request_id, ids in zip(request_ids, prompts):
        engine.add_request(request_id, ids, greedy(new_tokens), cache_salt=salt)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            if output.token_ids_delta:
                first.setdefault(output.request_id, now)
                last[output.request_id] = now
    ttft = statistics.mean(first[r] - start for r in request_ids)
    tpot = statistics.mean((last[r] - first[r]) / (new_tokens - 1) for r in request_ids)
    return Latency(len(prompts), ttft, tpot)


def best_latency(llm: LLM, prompts: list[list[int]], new_tokens: int, repeats: int) -> Latency:
    """The repeat that finished soonest (first token + the rest), like the throughput table's best."""
    runs = [measure_latency(llm, prompts, new_tokens) for _ in range(repeats)]
    return min(runs, key=lambda lat: lat.ttft_s + (new_tokens - 1) * lat.tpot_s)


def long_prompt(llm: LLM, tokens: int) -> list[int]:
    """A chat prompt of about ``tokens`` tokens: a user message of repeated prose, asking for a summary."""
    text = (
        "The lighthouse keeper climbed the spiral stairs each evening, trimmed the wick, polished the lens "
        "and wrote the weather in his log before the ships came past the rocks. "
    )
    words = text * (tokens // 30 + 1)
    ids = llm.chat_prompt_ids([{"role": "user", "content": "Summarize: " + words}])
    while len(ids) > tokens:
        words = words[: int(len(words) * tokens / len(ids)) - 1]
        ids = llm.chat_prompt_ids([{"role": "user", "content": "Summarize: " + words}])
    return ids


def ours_first_token_seconds(llm: LLM, prompt: list[int]) -> float:
    return run_ours(llm, [prompt], 1)[0]


# checks and report ---------------------------------------------------------------------------------------


def check_lengths(name: str, outputs: list[list[int]], new_tokens: int) -> None:
    lengths = sorted({len(o) for o in outputs})
    if lengths != [new_tokens]:
        raise RuntimeError(f"{name}: produced {lengths} tokens per stream, expected {new_tokens}")


def greedy_check(llm: LLM, prompt: list[int], peer_tokens: list[int], new_tokens: int) -> str:
    """Ours against transformers on one prompt. transformers' min_new_tokens masks EOS, while ours' ignore_eos
    lets greedy pick it; so the check run masks EOS on ours too: min_tokens without ignore_eos (vLLM semantics:
    min_tokens masks EOS only when EOS would end the request)."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, min_tokens=new_tokens)
    ours = llm.generate([prompt], params, cache_salt=f"bench-{next(_SALTS)}")[0].token_ids
    same = next((i for i, (a, b) in enumerate(zip(ours, peer_tokens)) if a != b), None)
    if same is None and len(ours) == len(peer_tokens):
        return f"identical: all {len(ours)} greedy tokens match transformers"
    same = min(len(ours), len(peer_tokens)) if same is None else same
    return (
        f"the first {same} of {len(ours)} greedy tokens match transformers (float32), then ours "
        f"{ours[same : same + 3]} vs transformers {peer_tokens[same : same + 3]}"
    )


def table(
    results: dict[str, dict[str, Side]],
    ttft: dict[str, float],
    long_tokens: int,
    latency: list[Latency],
) -> str:
    peers = [side for side in next(iter(results.values())) if side != "ours"]
    rows = [
        "| scenario | ours tok/s | " + " | ".join(f"{p} tok/s | ours / {p}" for p in peers) + " |",
        "|---|---:|" + "---:|---:|" * len(peers),
    ]
    for scenario, sides in results.items():
        ours = sides["ours"].best_tok_s
        rows.append(
            f"| {scenario} | {ours:.1f} | "
            + " | ".join(
                f"{sides[p].best_tok_s:.1f} | {ours / sides[p].best_tok_s:.2f}x" for p in peers
            )
            + " |"
        )
    rows.append(
        f"| TTFT, {long_tokens}-token prompt (ms, best) | {ttft['ours'] * 1e3:.0f} | "
        + " | ".join(f"{ttft[p] * 1e3:.0f} | {ttft['ours'] / ttft[p]:.2f}x the time" for p in peers)
        + " |"
    )
    rows += [
        "",
        "| ours, streams | TTFT mean (ms) | time per output token mean (ms) |",
        "|---:|---:|---:|",
    ]
    rows += [
        f"| {lat.streams} | {lat.ttft_s * 1e3:.1f} | {lat.tpot_s * 1e3:.1f} |" for lat in latency
    ]
    return "\n".join(rows)


def environment(threads: int, load_before: float, llm: LLM, peers: list[Peer]) -> dict[str, Any]:
    """Where and how the numbers were taken; the 1-minute load averages show whether other work shared the
    cores (2 threads on a 2-core machine slow down sharply when anything else runs)."""
    llama_cpp = next((p for p in peers if isinstance(p, LlamaCppPeer)), None)
    return record.environment(
        __spec__.name,
        "cpu",
        load_before=load_before,
        threads=threads,
        cpu_weights=llm.engine.config.cpu_weights,
        cpu_isa=native_level(llm),
        llama_cpp_system_info=llama_cpp.system_info if llama_cpp else None,
    )


def native_level(llm: LLM) -> str:
    """The level ours' native kernels run at ("none": the Python path)."""
    from kernels import cpu_native

    config = llm.engine.config
    if (
        config.cpu_weights in ("float32", "bfloat16")
        or os.environ.get("PAGEDCHAT_CPU_NATIVE") == "0"
    ):
        return "none"
    return cpu_native.resolve_isa(config.cpu_isa)


# main ----------------------------------------------------------------------------------------------------

PEERS = ("transformers", "llama-cpp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cpu-weights", default="auto", choices=("auto", *CPU_WEIGHTS))
    parser.add_argument(
        "--peer",
        nargs="+",
        choices=PEERS,
        default=["transformers"],
        help="peers run in the same command (llama-cpp needs llama-cpp-python)",
    )
    parser.add_argument(
        "--isa",
        default="auto",
        choices=CPU_ISA_CHOICES,
        help="the instruction-set level of ours' native kernels (a level the CPU lacks is refused)",
    )
    parser.add_argument(
        "--llama-cpp-dir",
        metavar="DIR",
        help="import llama-cpp-python from DIR (a pip --target build for one level)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--tuned-threads",
        action="store_true",
        help="start torch at --threads but leave the engine's num_threads unset: it measures which count is "
        "faster as it runs (engine/worker/cpu_threads.py; what `pagedchat serve` does without --num-threads)",
    )
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--long-prompt", type=int, default=500, help="tokens of the TTFT prompt")
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs of each scenario; the table shows the best"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the numbers here")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after the benchmark, cProfile one run of ours with --streams streams",
    )
    args = parser.parse_args(argv)
    if (
        min(args.threads, args.new_tokens - 1, args.streams, args.repeats) < 1
        or args.long_prompt < 16
    ):
        parser.error(
            "--threads, --streams, --repeats must be >= 1, --new-tokens >= 2, --long-prompt >= 16"
        )
    return args


def make_peer(name: str, llm: LLM, args: argparse.Namespace) -> Any:
    from engine.worker.model_sources import default_gguf_file

    if name == "transformers":
        from tests.hf_export import hf_directory

        export = hf_directory(default_gguf_file(), Path(llm.engine.config.cache_dir))
        return TransformersPeer(str(export), llm.engine.config.eos_token_ids[0])
    from kernels.cpu_native import resolve_isa

    return LlamaCppPeer(
        str(default_gguf_file()), args.threads, args.llama_cpp_dir, resolve_isa(args.isa)
    )


def warm_up(llm: LLM, peers: list[Peer], prompts: list[list[int]]) -> None:
    """One short run of each side and shape, so one-time costs (allocator, kernels) fall outside timing."""
    for batch in (prompts[:1], prompts):
        run_ours(llm, batch, WARM_UP_TOKENS)
        for peer in peers:
            peer.generate(batch, WARM_UP_TOKENS)


def benchmark(
    llm: LLM, peers: list[Peer], prompts: list[list[int]], long: list[int], args: argparse.Namespace
) -> tuple[dict[str, dict[str, Side]], dict[str, float], list[int]]:
    """The sides alternate within each repeat, so drift in the machine hits all alike."""
    scenarios = {"1 stream": prompts[:1], f"{args.streams} streams": prompts}
    sides: dict[str, Any] = {"ours": lambda b, n: run_ours(llm, b, n)}
    sides.update({peer.name: peer.generate for peer in peers})
    results = {
        name: {side: Side(len(batch), args.new_tokens) for side in sides}
        for name, batch in scenarios.items()
    }
    ttft_runs: dict[str, list[float]] = {side: [] for side in sides}
    first_token = {"ours": lambda p: ours_first_token_seconds(llm, p)}
    first_token.update({peer.name: peer.first_token_seconds for peer in peers})
    transformers_single: list[int] = []
    for _ in range(args.repeats):
        for name, batch in scenarios.items():
            for side, run in sides.items():
                seconds, outputs = run(batch, args.new_tokens)
                check_lengths(f"{side}, {name}", outputs, args.new_tokens)
                results[name][side].seconds.append(seconds)
                if side == "transformers" and len(batch) == 1:
                    transformers_single = outputs[0]
                logger.info("%s, %s: %.2f s", side, name, seconds)
        for side, run in first_token.items():
            ttft_runs[side].append(run(long))
            logger.info("%s, TTFT of %d tokens: %.3f s", side, len(long), ttft_runs[side][-1])
    return results, {side: min(runs) for side, runs in ttft_runs.items()}, transformers_single


def profile_ours(llm: LLM, prompts: list[list[int]], new_tokens: int, top: int = 15) -> None:
    profiler = cProfile.Profile()
    profiler.runcall(run_ours, llm, prompts, new_tokens)
    print(
        f"\ncProfile of ours, {len(prompts)} streams x {new_tokens} tokens (top {top} by cumulative time):"
    )
    pstats.Stats(profiler, stream=sys.stdout).sort_stats("cumulative").print_stats(top)


def report(
    results: dict[str, dict[str, Side]],
    ttft: dict[str, float],
    long_tokens: int,
    latency: list[Latency],
    check: str,
    env: dict[str, Any],
    args: argparse.Namespace,
) -> None:
    print(
        f"\n## cpu workload: SmolLM2-135M-Instruct, ours with {env['cpu_weights']} weights at {env['cpu_isa']}, "
        f"{args.new_tokens} new tokens per stream, best of {args.repeats}\n"
    )
    print(table(results, ttft, long_tokens, latency))
    print(f"\ngreedy check (single prompt): {check}")
    print(f"{env['threads']} threads; {record.environment_line(env)}")
    if env["llama_cpp_system_info"]:
        print(f"llama.cpp system info: {env['llama_cpp_system_info']}")
    if args.json:
        throughput = {
            name: {
                side: {
                    "seconds": s.seconds,
                    "best_tok_s": s.best_tok_s,
                    "median_tok_s": s.median_tok_s,
                }
                for side, s in sides.items()
            }
            for name, sides in results.items()
        }
        dump = {
            "environment": env,
            "greedy_check": check,
            "throughput": throughput,
            "ttft_long_prompt": {"tokens": long_tokens, "best_seconds": ttft},
            "latency": [asdict(lat) for lat in latency],
        }
        record.write_json(args.json, dump)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    load_before = record.load_average()
    llm = LLM(
        num_threads=None if args.tuned_threads else args.threads,
        dtype="float32",
        cpu_weights=args.cpu_weights,
        cpu_isa=args.isa,
    )
    peers = [make_peer(name, llm, args) for name in args.peer]
    prompts = chat_prompts(llm, args.streams)
    long = long_prompt(llm, args.long_prompt)
    logger.info("prompt lengths: %s; TTFT prompt: %d tokens", [len(p) for p in prompts], len(long))
    warm_up(llm, peers, prompts)
    results, ttft, transformers_single = benchmark(llm, peers, prompts, long, args)
    latency = [
        best_latency(llm, batch, args.new_tokens, args.repeats) for batch in (prompts[:1], prompts)
    ]
    check = (
        greedy_check(llm, prompts[0], transformers_single, args.new_tokens)
        if transformers_single
        else "not run (needs --peer transformers)"
    )
    report(
        results,
        ttft,
        len(long),
        latency,
        check,
        environment(args.threads, load_before, llm, peers),
        args,
    )
    if args.profile:
        profile_ours(llm, prompts, args.new_tokens)


if __name__ == "__main__":
    main()
