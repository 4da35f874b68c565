"""The numbers of ``benchmarks.online.serve --compare-offline`` (workload ``serve-vs-engine``): the served stream held
against the engine's own decode step at the same batch.

The engine's step at batch C is the floor of the served time per output token: each step gives every running
request one token. What the HTTP server adds (its event loop, JSON, SSE, the sockets) shows as TPOT and ITL
above the step, and as delivered tok/s below C / step. Delivered tok/s is counted two ways: over the steady
part (every request streaming: from the last request's first token to the first request's last token, the
part where the engine runs C decode rows a step) and over the whole run (first request sent to last done,
prefill and tail included).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from benchmarks.online.http_client import StreamResult
from benchmarks.online.sse_client import BUSY_SHARE, ClientLoad

# flags -----------------------------------------------------------------------------------------------------


def default_client_processes() -> int:
    """Half the CPUs, at most 8: enough to parse a GPU server's events, and leaves the server its share."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def check_compare_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """serve-vs-engine compares C streams with the engine at batch C: C requests of one shape, all at once,
    token-id prompts (the engine takes ids), and a server started here (after the engine is freed)."""
    problems = [
        (args.concurrency is None, "needs --concurrency C"),
        (
            args.num_prompts not in (None, args.concurrency),
            "sends C requests: --num-prompts must equal --concurrency",
        ),
        (
            args.endpoint != "completions",
            "needs --endpoint completions (token-id prompts, as the engine gets)",
        ),
        (args.request_rate != float("inf"), "sends all C at once: no --request-rate"),
        (
            args.base_url is not None,
            "starts its own server after the engine is freed: no --base-url",
        ),
        (
            args.input_len[0] != args.input_len[1] or args.output_len[0] != args.output_len[1],
            "needs fixed --input-len and --output-len",
        ),
        (args.engine_steps < 1, "--engine-steps must be >= 1"),
    ]
    for failed, message in problems:
        if failed:
            parser.error(f"--compare-offline {message}")


# numbers ---------------------------------------------------------------------------------------------------


def steady_window(results: list[StreamResult]) -> tuple[float, float] | None:
    """(start, end): from the moment the last request got its first token to the moment the first request got
    its last; None when they do not overlap (no moment when every request was streaming)."""
    streamed = [r for r in results if r.ok and r.token_times]
    if not streamed:
        return None
    start = max(r.token_times[0] for r in streamed)
    end = min(r.token_times[-1] for r in streamed)
    return (start, end) if end > start else None


def tokens_between(results: list[StreamResult], start: float, end: float) -> int:
    """Tokens of the events that arrived in (start, end]: the window's opening event is the last first token,
    which the prefill produced, not a decode step inside the window."""
    return sum(
        count
        for r in results
        if r.ok
        for at, count in zip(r.token_times, r.token_counts)
        if start < at <= end
    )


def comparison(
    engine: dict[str, Any], summary: dict[str, Any], results: list[StreamResult]
) -> dict[str, Any]:
    """Served over engine: TPOT and ITL p50 over the step (x), delivered tok/s over C / step (a share)."""
    step_ms, engine_tok_s = engine["step_ms_mean"], engine["tok_s"]
    window = steady_window(results)
    steady_tok_s = tokens_between(results, *window) / (window[1] - window[0]) if window else None
    tpot, itl, ttft = (summary[key] or {} for key in ("tpot_ms", "itl_ms", "ttft_ms"))
    overall_tok_s = summary["output_throughput"]
    return {
        "batch": engine["batch"],
        "engine_step_ms": step_ms,
        "engine_step_ms_median": engine["step_ms_median"],
        "engine_tok_s": engine_tok_s,
        "served_tpot_p50_ms": tpot.get("p50"),
        "tpot_over_step": _ratio(tpot.get("p50"), step_ms),
        "engine_arrivals_tpot_p50_ms": engine.get("arrivals_tpot_ms_p50"),
        "tpot_over_engine_tpot": _ratio(tpot.get("p50"), engine.get("arrivals_tpot_ms_p50") or 0.0),
        "served_itl_p50_ms": itl.get("p50"),
        "itl_over_step": _ratio(itl.get("p50"), step_ms),
        "steady_window_s": window[1] - window[0] if window else None,
        "delivered_steady_tok_s": steady_tok_s,
        "steady_share_of_engine": _ratio(steady_tok_s, engine_tok_s),
        "delivered_overall_tok_s": overall_tok_s,
        "overall_share_of_engine": _ratio(overall_tok_s, engine_tok_s),
        "ttft_p50_ms": ttft.get("p50"),
        "ttft_p99_ms": ttft.get("p99"),
    }


def _ratio(value: float | None, reference: float) -> float | None:
    return value / reference if value is not None and reference else None


def client_warnings(loads: list[ClientLoad]) -> list[str]:
    busy = [(i, load.busy) for i, load in enumerate(loads) if load.busy > BUSY_SHARE]
    return [
        f"client process {i} was busy {share:.0%} of the time (> {BUSY_SHARE:.0%}): the client may be the "
        "bottleneck; raise --client-processes"
        for i, share in busy
    ]


# report ----------------------------------------------------------------------------------------------------


def comparison_table(c: dict[str, Any]) -> str:
    def num(value: float | None, digits: int = 2) -> str:
        return "-" if value is None else f"{value:,.{digits}f}"

    def share(value: float | None) -> str:
        return "-" if value is None else f"{value:.0%}"

    step, engine_tok_s = num(c["engine_step_ms"]), num(c["engine_tok_s"], 0)
    rows = [
        (
            f"batch C = {c['batch']}",
            "engine (in process)",
            "served (HTTP, C streams)",
            "served / engine",
        ),
        ("---", "---:", "---:", "---:"),
        (
            "ms per token: step mean vs TPOT p50",
            f"{step} (median {num(c['engine_step_ms_median'])})",
            num(c["served_tpot_p50_ms"]),
            f"{num(c['tpot_over_step'])}x",
        ),
        (
            "ms per token: TPOT p50, same arrivals in process vs served",
            num(c.get("engine_arrivals_tpot_p50_ms")),
            num(c["served_tpot_p50_ms"]),
            f"{num(c.get('tpot_over_engine_tpot'))}x",
        ),
        (
            "ms between tokens: step mean vs ITL p50",
            step,
            num(c["served_itl_p50_ms"]),
            f"{num(c['itl_over_step'])}x",
        ),
        (
            f"output tok/s, steady (all C streaming, {num(c['steady_window_s'])} s)",
            engine_tok_s,
            num(c["delivered_steady_tok_s"], 0),
            share(c["steady_share_of_engine"]),
        ),
        (
            "output tok/s, overall (prefill and tail included)",
            engine_tok_s,
            num(c["delivered_overall_tok_s"], 0),
            share(c["overall_share_of_engine"]),
        ),
        ("TTFT p50 / p99, ms", "-", f"{num(c['ttft_p50_ms'])} / {num(c['ttft_p99_ms'])}", "-"),
    ]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in rows)


def engine_line(engine: dict[str, Any]) -> str:
    return (
        f"engine: {engine['model']} on {engine['device']} ({engine['dtype']}), built in "
        f"{engine['build_seconds']:.1f} s; {engine['batch']} prompts of {engine['input_len']} tokens prefilled in "
        f"{engine['prefill_steps']} steps ({engine['prefill_seconds']:.2f} s); {engine['steps']} decode steps timed over contexts "
        f"{engine['context_first']}-{engine['context_last']}"
        + ("" if engine["full_batches"] else " (NOT all full batches: see the log)")
    )


def client_lines(loads: list[ClientLoad]) -> list[str]:
    """Per client process: its requests, events, busy share and capacity (events it could parse per CPU
    second)."""
    lines = [f"client processes: {len(loads)}"]
    lines += [
        f"  process {i}: {load.requests} requests, {load.events} events in {load.wall_s:.1f} s "
        f"({load.events / load.wall_s if load.wall_s else 0:,.0f} events/s), CPU {load.cpu_s:.1f} s = "
        f"busy {load.busy:.0%}; capacity ~{load.events_per_cpu_s:,.0f} events per CPU second"
        for i, load in enumerate(loads)
    ]
    return lines
