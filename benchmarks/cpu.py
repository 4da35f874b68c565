"""Workload ``cpu`` (shared WORKLOADS.md): the embedded default model on a small CPU budget.

SmolLM2-135M-Instruct, float32, ``--threads`` torch threads; one stream and ``--streams`` concurrent streams
of ``--new-tokens`` greedy tokens each (EOS ignored, so every stream produces exactly that many).
Peer in the same run: transformers ``generate`` on the engine's converted HF directory of the same model
(single prompt; a left-padded batch). Output tokens/s = streams x new tokens / wall seconds from submit
to all finished. Each of ours' runs gets a fresh ``cache_salt`` so no run reuses the previous run's
prefix-cache blocks (transformers caches nothing between calls). With ``--repeats`` the two sides alternate
and the table shows each side's best run. A greedy check compares ours' and transformers' tokens on one prompt.

    python -m benchmarks.cpu [--threads 2] [--new-tokens 128] [--streams 8] [--repeats 1] [--json PATH] [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import datetime
import itertools
import json
import logging
import os
import platform
import pstats
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from engine.llm_engine import LLM
from engine.sampling_params import SamplingParams

logger = logging.getLogger("benchmarks.cpu")

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
            logger.warning("prompt of %d tokens is outside the workload's %d-%d", len(ids), low, high)
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


# transformers --------------------------------------------------------------------------------------------

def load_peer(model_path: str) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return model.eval()


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left padding keeps every prompt's last token in the last column, where generation continues."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


@torch.inference_mode()
def run_peer(model: Any, prompts: list[list[int]], new_tokens: int, pad_id: int
             ) -> tuple[float, list[list[int]]]:
    ids, mask = left_pad(prompts, pad_id)
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id)
    seconds = time.perf_counter() - start
    return seconds, out[:, ids.shape[1]:].tolist()


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
    return (f"DIFFERENT: the first {same} of {len(ours)} greedy tokens match, then ours "
            f"{ours[same:same + 3]} vs transformers {peer_tokens[same:same + 3]}")


def table(results: dict[str, dict[str, Side]], latency: list[Latency]) -> str:
    rows = ["| scenario | ours tok/s | transformers tok/s | ours / transformers |",
            "|---|---:|---:|---:|"]
    for scenario, sides in results.items():
        ours, peer = sides["ours"], sides["transformers"]
        rows.append(f"| {scenario} | {ours.best_tok_s:.1f} | {peer.best_tok_s:.1f} | "
                    f"{ours.best_tok_s / peer.best_tok_s:.2f}x |")
    rows += ["", "| ours, streams | TTFT mean (ms) | time per output token mean (ms) |", "|---:|---:|---:|"]
    rows += [f"| {lat.streams} | {lat.ttft_s * 1e3:.1f} | {lat.tpot_s * 1e3:.1f} |" for lat in latency]
    return "\n".join(rows)


def environment(threads: int, load_before: float) -> dict[str, Any]:
    """Where and how the numbers were taken; the 1-minute load averages show whether other work shared the
    cores (2 threads on a 2-core machine slow down sharply when anything else runs)."""
    import transformers

    return {"load_average_before": load_before, "load_average_after": os.getloadavg()[0],
            "date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "transformers": transformers.__version__, "threads": threads,
            "processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "command": " ".join(["python -m benchmarks.cpu", *sys.argv[1:]])}


# main ----------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each scenario; the table shows the best")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers here")
    parser.add_argument("--profile", action="store_true",
                        help="after the benchmark, cProfile one run of ours with --streams streams")
    args = parser.parse_args(argv)
    if min(args.threads, args.new_tokens - 1, args.streams, args.repeats) < 1:
        parser.error("--threads, --streams, --repeats must be >= 1 and --new-tokens >= 2")
    return args


def warm_up(llm: LLM, peer: Any, prompts: list[list[int]], pad_id: int) -> None:
    """One short run of each side and shape, so one-time costs (allocator, kernels) fall outside timing."""
    for batch in (prompts[:1], prompts):
        run_ours(llm, batch, WARM_UP_TOKENS)
        run_peer(peer, batch, WARM_UP_TOKENS, pad_id)


def benchmark(llm: LLM, peer: Any, prompts: list[list[int]], args: argparse.Namespace
              ) -> tuple[dict[str, dict[str, Side]], list[int]]:
    """Ours and transformers alternate within each repeat, so drift in the machine hits both alike."""
    pad_id = llm.engine.config.eos_token_ids[0]
    scenarios = {"1 stream": prompts[:1], f"{args.streams} streams": prompts}
    results = {name: {side: Side(len(batch), args.new_tokens) for side in ("ours", "transformers")}
               for name, batch in scenarios.items()}
    peer_single: list[int] = []
    for _ in range(args.repeats):
        for name, batch in scenarios.items():
            for side, run in (("ours", lambda b: run_ours(llm, b, args.new_tokens)),
                              ("transformers", lambda b: run_peer(peer, b, args.new_tokens, pad_id))):
                seconds, outputs = run(batch)
                check_lengths(f"{side}, {name}", outputs, args.new_tokens)
                results[name][side].seconds.append(seconds)
                if side == "transformers" and len(batch) == 1:
                    peer_single = outputs[0]
                logger.info("%s, %s: %.2f s", side, name, seconds)
    return results, peer_single


def profile_ours(llm: LLM, prompts: list[list[int]], new_tokens: int, top: int = 15) -> None:
    profiler = cProfile.Profile()
    profiler.runcall(run_ours, llm, prompts, new_tokens)
    print(f"\ncProfile of ours, {len(prompts)} streams x {new_tokens} tokens (top {top} by cumulative time):")
    pstats.Stats(profiler, stream=sys.stdout).sort_stats("cumulative").print_stats(top)


def report(results: dict[str, dict[str, Side]], latency: list[Latency], check: str, env: dict[str, Any],
           args: argparse.Namespace) -> None:
    print(f"\n## cpu workload: SmolLM2-135M-Instruct, float32, {args.new_tokens} new tokens per stream, "
          f"best of {args.repeats}\n")
    print(table(results, latency))
    print(f"\ngreedy check (single prompt): {check}")
    print(f"{env['date']}, torch {env['torch']}, transformers {env['transformers']}, {env['threads']} threads, "
          f"{env['processor']} ({env['cpu_count']} CPUs), load average {env['load_average_before']:.2f} before / "
          f"{env['load_average_after']:.2f} after; command: {env['command']}")
    if args.json:
        throughput = {name: {side: {"seconds": s.seconds, "best_tok_s": s.best_tok_s, "median_tok_s": s.median_tok_s}
                             for side, s in sides.items()} for name, sides in results.items()}
        dump = {"environment": env, "greedy_check": check, "throughput": throughput,
                "latency": [asdict(lat) for lat in latency]}
        with open(args.json, "w") as f:
            json.dump(dump, f, indent=2)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    llm = LLM(num_threads=args.threads, dtype="float32")
    peer = load_peer(llm.engine.config.model_path)
    prompts = chat_prompts(llm, args.streams)
    logger.info("prompt lengths: %s", [len(p) for p in prompts])
    warm_up(llm, peer, prompts, llm.engine.config.eos_token_ids[0])
    results, peer_single = benchmark(llm, peer, prompts, args)
    latency = [best_latency(llm, batch, args.new_tokens, args.repeats) for batch in (prompts[:1], prompts)]
    check = greedy_check(llm, prompts[0], peer_single, args.new_tokens)
    report(results, latency, check, environment(args.threads, load_before), args)
    if args.profile:
        profile_ours(llm, prompts, args.new_tokens)


if __name__ == "__main__":
    main()
