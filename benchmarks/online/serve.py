"""Workload ``serve`` (shared WORKLOADS.md): online SSE load over real HTTP, reported in the layout of
``vllm bench serve``.

``--num-prompts`` streamed requests, either kept ``--concurrency N`` at a time (N clients that each send their
next request when the previous one ends) or arriving as a Poisson process at ``--request-rate R`` per second
(seeded; the two combine: arrivals at rate R, at most N in flight). Each request asks for exactly
``--output-len`` tokens (ignore_eos, max_tokens) with ``--input-len`` prompt tokens:

- ``--endpoint chat`` (default): ``/v1/chat/completions`` with one user message of filler words that encode
  as one token each; a probe request (also the warm-up) measures what the chat template adds, so the rendered
  prompt has about ``--input-len`` tokens. Totals use the server's own usage counts.
- ``--endpoint completions``: ``/v1/completions`` with token ids uniform in [0, ``--vocab``) as the prompt,
  so lengths are exact; for dummy weights, which have no tokenizer (GPU machines).

TTFT = request sent to the first event carrying text; TPOT = (end - first token) / (output tokens - 1);
ITL = gaps between events carrying text; E2EL = request sent to end of stream. Duration runs from the first
request sent to the last one finished. Every run uses a fresh ``cache_salt`` unless ``--cache-salt`` fixes
one, so a repeated run on the same server does not hit the previous run's prefix blocks.

Without ``--base-url`` the script starts ``python -m app serve`` on a free port with ``--server-args`` and
stops it at the end.

``--client-processes N`` deals the requests round-robin to N spawned processes (benchmarks.online.sse_client: a lean
asyncio HTTP/1.1 client, timestamps on ``time.monotonic``, one clock across processes), each with its share of
``--concurrency``; one Python process cannot parse the tens of thousands of events a second a GPU server sends
at C = 256, and its late reads would pass for server latency. Each process's CPU / wall share is reported, with
a warning above 80%. Default 1: the in-process httpx client (``--compare-offline``: min(8, CPUs / 2) processes).

``--compare-offline`` (workload ``serve-vs-engine``): first the engine's steady decode step at batch C =
``--concurrency``, in this process, built from the same ``--server-args`` (benchmarks.offline.engine_step: the very C
prompts the clients will send, all prefilled, then 40+ decode steps timed; the engine is freed before the server
starts), then C streaming clients on ``--endpoint completions`` (``--num-prompts`` = C, all sent at once).
Reported side by side: the engine's step (ms) and tok/s (C / step); the served TPOT p50 and ITL p50 over the
step; delivered output tok/s over the steady part (every request streaming) and overall, as shares of the
engine's tok/s; TTFT p50 / p99 (benchmarks.online.serve_compare).

    python -m benchmarks.online.serve --concurrency 16 --num-prompts 64 --input-len 256 --output-len 128
    python -m benchmarks.online.serve --request-rate 4 --num-prompts 200 --endpoint completions \\
        --server-args "--load-format dummy --model-config llama-3.2-1b" --json /tmp/serve.json
    python -m benchmarks.online.serve --compare-offline --concurrency 256 --input-len 512 --output-len 256 \\
        --endpoint completions --server-args "--load-format dummy --model-config llama-3.2-1b"
    CPU variant: --compare-offline --concurrency 8 --input-len 512 --output-len 128 --endpoint completions \\
        --server-args "--num-threads 2"
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shlex
import time
import uuid
from dataclasses import asdict
from random import Random
from typing import Any

import httpx

from benchmarks.harness import record
from benchmarks.online.http_client import (
    StreamResult,
    add_server_options,
    banner,
    distribution_ms,
    draw,
    filler_text,
    int_range,
    new_client,
    row,
    served_model,
    server_from_args,
    shown,
    stream_request,
)
from benchmarks.online.serve_compare import (
    check_compare_args,
    client_lines,
    client_warnings,
    comparison,
    comparison_table,
    default_client_processes,
    engine_line,
)
from benchmarks.online.sse_client import ClientLoad, run_clients

logger = logging.getLogger("benchmarks.online.serve")

PROBE_WORDS = 16
ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
SECTIONS = (
    ("ttft_ms", "TTFT", "Time to First Token"),
    ("tpot_ms", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl_ms", "ITL", "Inter-token Latency"),
    ("e2el_ms", "E2EL", "End-to-end Latency"),
)


# requests --------------------------------------------------------------------------------------------------


def request_bodies(
    args: argparse.Namespace, model: str, template_tokens: int, salt: str | None
) -> list[dict[str, Any]]:
    """All requests up front from one seeded generator: per request the prompt length, the prompt, then
    the output length."""
    rng = Random(args.seed)
    bodies = []
    for _ in range(args.num_prompts):
        input_len = draw(rng, args.input_len)
        prompt = prompt_fields(args.endpoint, rng, input_len, template_tokens, args.vocab)
        bodies.append(
            request_body(model, prompt, draw(rng, args.output_len), args.temperature, salt)
        )
    return bodies


def prompt_fields(
    endpoint: str, rng: Random, input_len: int, template_tokens: int, vocab: int
) -> dict[str, Any]:
    if endpoint == "completions":
        return {"prompt": [rng.randrange(vocab) for _ in range(input_len)]}
    words = max(1, input_len - template_tokens)
    return {"messages": [{"role": "user", "content": filler_text(rng, words)}]}


def request_body(
    model: str, prompt: dict[str, Any], max_tokens: int, temperature: float, salt: str | None
) -> dict[str, Any]:
    body = {
        "model": model,
        **prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        # events may carry several tokens (a stream that is behind catches up)
        "return_token_ids": True,
    }
    if salt:
        body["cache_salt"] = salt
    return body


async def probe(
    client: httpx.AsyncClient, url: str, args: argparse.Namespace, model: str, salt: str | None
) -> int:
    """One short request (also the warm-up); for chat returns the tokens the template adds to the content."""
    rng = Random(f"probe-{args.seed}")
    prompt = prompt_fields(args.endpoint, rng, PROBE_WORDS, 0, args.vocab)
    result = await stream_request(
        client, url, request_body(model, prompt, 2, args.temperature, salt)
    )
    if not result.ok:
        raise RuntimeError(f"the probe request failed: {result.error}")
    if args.endpoint != "chat":
        return 0
    logger.info(
        "probe: %d prompt tokens for %d words: the chat template adds %d",
        result.prompt_tokens,
        PROBE_WORDS,
        result.prompt_tokens - PROBE_WORDS,
    )
    return result.prompt_tokens - PROBE_WORDS


# load ------------------------------------------------------------------------------------------------------


def arrival_offsets(count: int, rate: float, rng: Random) -> list[float]:
    """Seconds after the start at which each request is sent: all at 0 for an infinite rate, else a Poisson
    process (exponential gaps with mean 1/rate), the first at 0."""
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        if rate != float("inf"):
            now += rng.expovariate(rate)
    return offsets


def run_load(
    url: str, bodies: list[dict[str, Any]], args: argparse.Namespace
) -> tuple[list[StreamResult], float, list[ClientLoad]]:
    """Send every request on its arrival schedule (at most ``--concurrency`` in flight), from this process or
    from ``--client-processes`` processes; the results, the seconds from the first send to the last finish,
    and each client process's load (none for the in-process client)."""
    offsets = arrival_offsets(len(bodies), args.request_rate, Random(f"arrivals-{args.seed}"))
    if uses_client_processes(args):
        logger.info("%d requests from %d client processes", len(bodies), args.client_processes)
        results, loads = run_clients(
            url, bodies, offsets, args.concurrency, args.client_processes, args.request_timeout
        )
        progress = Progress(len(results))
        for result in results:  # (one line at the end: the processes report when all is done)
            progress.done(result, quiet=True)
    else:
        results, loads = asyncio.run(run_in_process(url, bodies, offsets, args)), []
    return results, max(r.done_at for r in results) - min(r.sent_at for r in results), loads


def uses_client_processes(args: argparse.Namespace) -> bool:
    return args.client_processes > 1 or args.compare_offline


async def run_in_process(
    url: str, bodies: list[dict[str, Any]], offsets: list[float], args: argparse.Namespace
) -> list[StreamResult]:
    """The httpx client on this process's event loop, with progress lines as requests finish."""
    gate = asyncio.Semaphore(args.concurrency) if args.concurrency else None
    progress = Progress(len(bodies))

    async def send(client: httpx.AsyncClient, body: dict[str, Any]) -> StreamResult:
        if gate is None:
            return progress.done(await stream_request(client, url, body))
        async with gate:
            return progress.done(await stream_request(client, url, body))

    async with new_client(args.request_timeout) as client:
        start = time.perf_counter()
        tasks = []
        for body, offset in zip(bodies, offsets):
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            tasks.append(asyncio.create_task(send(client, body)))
        return list(await asyncio.gather(*tasks))


class Progress:
    """A log line at every tenth of the requests finished (``quiet``: at the last only)."""

    def __init__(self, total: int) -> None:
        self.total, self.finished, self.failed = total, 0, 0

    def done(self, result: StreamResult, quiet: bool = False) -> StreamResult:
        self.finished += 1
        self.failed += not result.ok
        if result.error and self.failed <= 3:
            logger.warning("request failed: %s", result.error)
        if (
            not quiet and self.finished % max(1, self.total // 10) == 0
        ) or self.finished == self.total:
            logger.info(
                "%d/%d requests finished (%d failed)", self.finished, self.total, self.failed
            )
        return result


# summary and report ----------------------------------------------------------------------------------------


def summarize(
    results: list[StreamResult], duration: float, bodies: list[dict[str, Any]]
) -> dict[str, Any]:
    good = [r for r in results if r.ok]
    input_tokens = sum(r.prompt_tokens for r in good)
    output_tokens = sum(r.completion_tokens for r in good)
    return {
        "successful_requests": len(good),
        "failed_requests": len(results) - len(good),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "cached_prompt_tokens": sum(r.cached_tokens for r in good),
        "request_throughput": len(good) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "ttft_ms": distribution_ms([r.ttft for r in good if r.ttft is not None]),
        "tpot_ms": distribution_ms([r.tpot for r in good if r.tpot is not None]),
        "itl_ms": distribution_ms([gap for r in good for gap in r.itls]),
        "e2el_ms": distribution_ms([r.latency for r in good]),
        "token_events_per_output_token": sum(len(r.token_times) for r in good)
        / max(1, output_tokens),
        "warnings": check_results(good, bodies, results),
    }


def check_results(
    good: list[StreamResult], bodies: list[dict[str, Any]], results: list[StreamResult]
) -> list[str]:
    """What makes the timing columns mean less than they seem."""
    warnings = []
    untimed = sum(1 for r in good if not r.timed)
    if untimed:
        warnings.append(
            f"{untimed} requests streamed their tokens in one event at the end (our server does "
            "so without a tokenizer): TTFT/TPOT/ITL leave them out, E2EL still counts them"
        )
    short = sum(
        1 for r, b in zip(results, bodies) if r.ok and r.completion_tokens != b["max_tokens"]
    )
    if short:
        warnings.append(
            f"{short} requests did not produce exactly max_tokens tokens (ignore_eos not honoured?)"
        )
    errors = sorted({r.error for r in results if r.error})
    warnings += [f"error: {e}" for e in errors[:5]]
    return warnings


def report_lines(summary: dict[str, Any], args: argparse.Namespace) -> list[str]:
    lines = [
        banner("Serving Benchmark Result"),
        row("Successful requests:", summary["successful_requests"]),
        row("Failed requests:", summary["failed_requests"]),
        row("Maximum request concurrency:", args.concurrency),
        row("Request rate (req/s):", args.request_rate),
        row("Benchmark duration (s):", summary["duration_s"]),
        row("Total input tokens:", summary["total_input_tokens"]),
        row("Total generated tokens:", summary["total_output_tokens"]),
        row("Cached prompt tokens (prefix hits):", summary["cached_prompt_tokens"]),
        row("Request throughput (req/s):", summary["request_throughput"]),
        row("Output token throughput (tok/s):", summary["output_throughput"]),
        row("Total Token throughput (tok/s):", summary["total_token_throughput"]),
    ]
    for key, short, title in SECTIONS:
        lines.append(banner(title, "-"))
        stats = summary[key] or {}
        lines += [
            row(f"{label} {short} (ms):", stats.get(stat))
            for label, stat in (("Mean", "mean"), ("Median", "p50"), ("P99", "p99"))
        ]
    lines.append(banner(""))
    return lines + [f"warning: {w}" for w in summary["warnings"]]


# main ------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--endpoint", choices=tuple(ENDPOINTS), default="chat")
    parser.add_argument(
        "--num-prompts", type=int, default=None, help="default 64 (--compare-offline: C)"
    )
    parser.add_argument(
        "--concurrency", type=int, default=None, help="requests in flight at most (clients)"
    )
    parser.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrivals per second (default inf: all sent at once, up to --concurrency)",
    )
    parser.add_argument(
        "--input-len", type=int_range, default=(256, 256), help="prompt tokens: N or LOW-HIGH"
    )
    parser.add_argument(
        "--output-len", type=int_range, default=(128, 128), help="output tokens: N or LOW-HIGH"
    )
    parser.add_argument(
        "--vocab", type=int, default=10000, help="completions: prompt ids uniform in [0, VOCAB)"
    )
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--cache-salt", default=None, help='default: a fresh salt per run; "" sends none'
    )
    parser.add_argument("--json", metavar="PATH", help="also write the numbers here")
    parser.add_argument(
        "--client-processes",
        type=int,
        default=None,
        help="client processes (default 1; --compare-offline: min(8, CPUs / 2))",
    )
    parser.add_argument(
        "--compare-offline",
        action="store_true",
        help="serve-vs-engine: the engine's decode step at batch C first, in this process",
    )
    parser.add_argument(
        "--engine-steps",
        type=int,
        default=40,
        help="--compare-offline: decode steps timed, at least",
    )
    add_server_options(parser)
    args = parser.parse_args(argv)
    if args.compare_offline:
        check_compare_args(parser, args)
    if args.num_prompts is None:
        args.num_prompts = args.concurrency if args.compare_offline else 64
    if args.client_processes is None:
        args.client_processes = default_client_processes() if args.compare_offline else 1
    if (
        args.num_prompts < 1
        or (args.concurrency is not None and args.concurrency < 1)
        or args.request_rate <= 0
        or args.client_processes < 1
    ):
        parser.error(
            "--num-prompts, --concurrency and --client-processes must be >= 1 and --request-rate > 0"
        )
    if args.concurrency is None and args.request_rate == float("inf"):
        logger.warning(
            "neither --concurrency nor --request-rate: all %d requests are sent at once",
            args.num_prompts,
        )
    return args


def benchmark(base_url: str, args: argparse.Namespace) -> tuple[dict[str, Any], list[StreamResult]]:
    """The probe, then the load; the summary (with the client processes' loads) and every request's timings."""
    salt = f"bench-serve-{uuid.uuid4().hex[:12]}" if args.cache_salt is None else args.cache_salt
    url = base_url + ENDPOINTS[args.endpoint]
    model, template_tokens = asyncio.run(model_and_probe(base_url, url, args, salt))
    bodies = request_bodies(args, model, template_tokens, salt)
    logger.info("%d requests to %s (%s), salt %r", len(bodies), url, model, salt)
    results, duration, loads = run_load(url, bodies, args)
    summary = {"model": model, "endpoint": args.endpoint, **summarize(results, duration, bodies)}
    if loads:
        summary["client_processes"] = [
            asdict(load) | {"busy": load.busy, "events_per_cpu_s": load.events_per_cpu_s}
            for load in loads
        ]
        summary["warnings"] += client_warnings(loads)
    return summary, results


async def model_and_probe(
    base_url: str, url: str, args: argparse.Namespace, salt: str | None
) -> tuple[str, int]:
    async with new_client(args.request_timeout) as client:
        model = await served_model(client, base_url)
        return model, await probe(client, url, args, model, salt)


def measure_engine(args: argparse.Namespace) -> dict[str, Any]:
    """The engine's decode step at batch C on the very prompts the clients send (same seed, same draws), with
    the engine options of ``--server-args``. Imported here: the client processes re-import this module."""
    from benchmarks.offline.engine_step import (
        decode_step_seconds,
        engine_config_from_server_args,
    )

    prompts = [body["prompt"] for body in request_bodies(args, "", 0, None)]
    config = engine_config_from_server_args(shlex.split(args.server_args))
    return decode_step_seconds(config, prompts, args.output_len[0], min_steps=args.engine_steps)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    args = parse_args(argv)
    load_before = record.load_average()
    engine = measure_engine(args) if args.compare_offline else None
    with server_from_args(args) as base_url:
        summary, results = benchmark(base_url, args)
    server_args = None if args.base_url else shlex.split(args.server_args)
    env = record.environment(
        __spec__.name, load_before=load_before, argv=argv, server_args=server_args
    )
    output: dict[str, Any] = {"environment": env, "summary": summary}
    if engine is not None:
        output |= {"engine": engine, "comparison": comparison(engine, summary, results)}
    print_report(output, args)
    if args.json:
        # JSON has no inf
        arguments = {k: (None if v == float("inf") else v) for k, v in vars(args).items()}
        record.write_json(args.json, {"arguments": arguments, **output})


def print_report(output: dict[str, Any], args: argparse.Namespace) -> None:
    summary, env = output["summary"], output["environment"]
    print(
        f"\n## serve workload: {summary['model']}, {ENDPOINTS[args.endpoint]}, input {shown(args.input_len)}, "
        f"output {shown(args.output_len)} tokens\n"
    )
    print("\n".join(report_lines(summary, args)))
    if "comparison" in output:
        print(
            f"\n## serve-vs-engine: batch C = {args.concurrency}, prompt {shown(args.input_len)}, output "
            f"{shown(args.output_len)} tokens\n"
        )
        print(comparison_table(output["comparison"]) + "\n")
        print(engine_line(output["engine"]))
    if summary.get("client_processes"):
        print(
            "\n".join(
                client_lines(
                    [
                        ClientLoad(
                            **{k: load[k] for k in ("requests", "events", "wall_s", "cpu_s")}
                        )
                        for load in summary["client_processes"]
                    ]
                )
            )
        )
    print(record.environment_line(env))


if __name__ == "__main__":
    main()
