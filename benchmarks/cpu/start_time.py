"""How long ``pagedchat serve --model FILE`` takes to a healthy ``/health``, and the served processes' memory.

Per file: one first start on a cache that has not seen the file (its config and tokenizer described once; the
native kernels copied in, as they are per machine, not per model), then ``--repeats`` second starts; each start's
seconds to ``GET /health`` 200, the seconds of a ``response_format`` request sent then (it waits for the grammar
workers, which warm once the server is healthy) and of a second one, and the resident memory of the server's
processes (the front, the engine core, the grammar workers) at /health and ``--settle`` seconds later (the grammar
workers and the core build their grammar tokenizer once healthy). ``--neighbours N`` runs N busy-looping processes beside it, as a shared machine would.

    python -m benchmarks.cpu.start_time --model FILE.gguf [FILE.gguf ...] [--repeats 5] [--settle 15]
                                        [--neighbours 0] [--threads 2] [--json PATH]

(the default model: ``--model default``; dummy weights: ``--model dummy --server-args="--load-format dummy
--model-config llama-3.2-1b --device cuda"``)
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import shlex
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.cpu.own_gguf import starts_cache, time_to_healthy
from benchmarks.harness import record
from benchmarks.harness.processes import neighbours

logger = logging.getLogger("benchmarks.cpu.start_time")


def model_file(name: str) -> Path | None:
    """The file ``--model`` names (None for ``dummy``: dummy weights of ``--server-args``' model config)."""
    if name == "dummy":
        return None
    if name == "default":
        from engine.worker.model_sources import default_gguf_file

        return default_gguf_file()
    return Path(name).resolve()


def measure(model: Path | None, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    cache_dir = starts_cache(work)
    first_s, first_rss = time_to_healthy(model, cache_dir, args)
    seconds, served = [], []
    # (dummy weights have no tokenizer: no response_format)
    probe = first_structured if model is not None else None
    for _ in range(args.repeats):
        healthy_s, rss = time_to_healthy(model, cache_dir, args, args.settle, probe)
        seconds.append(healthy_s)
        served.append(rss)
        logger.info("%s: healthy in %.2f s, %s", model or "dummy", healthy_s, rss)
    return {
        "model": str(model or "dummy"),
        "size_mib": model.stat().st_size / 2**20 if model is not None else 0.0,
        "first_start_s": first_s,
        "first_start_rss_mib": first_rss,
        "second_start_s": seconds,
        "second_start_median_s": statistics.median(seconds),
        "served_rss_mib": served,
    }


def first_structured(base_url: str) -> dict[str, float]:
    """Seconds of a ``response_format`` chat request sent the moment the server is healthy (it waits for the
    grammar workers' warm-up), then of a second one."""
    body = {
        "messages": [{"role": "user", "content": "Reply with a JSON object."}],
        "max_tokens": 8,
        "temperature": 0,
        "response_format": {"type": "json_object"},
    }
    seconds = {}
    for name in ("first_structured_s", "second_structured_s"):
        start = time.perf_counter()
        reply = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=300)
        reply.raise_for_status()
        seconds[name] = time.perf_counter() - start
    return seconds


def _mib(rss: dict[str, float]) -> str:
    return ", ".join(f"{name} {mib:.0f}" for name, mib in rss.items())


def report(results: list[dict[str, Any]], env: dict[str, Any]) -> str:
    rows = [
        "| file | MiB | first start s | second start s: median (min-max) | first / second response_format "
        "at /health, s | served RSS MiB at /health 200 | and settled |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        last = r["served_rss_mib"][-1]
        memory = {k: v for k, v in last.items() if not k.endswith("_structured_s")}
        at_health = {k: v for k, v in memory.items() if not k.startswith("settled_")}
        settled = {k[len("settled_") :]: v for k, v in memory.items() if k.startswith("settled_")}
        first = statistics.median(m.get("first_structured_s", 0.0) for m in r["served_rss_mib"])
        second = statistics.median(m.get("second_structured_s", 0.0) for m in r["served_rss_mib"])
        s = r["second_start_s"]
        rows.append(
            f"| {Path(r['model']).name} | {r['size_mib']:.0f} | {r['first_start_s']:.1f} | "
            f"{r['second_start_median_s']:.2f} ({min(s):.2f}-{max(s):.2f}) | {first:.2f} / {second:.2f} "
            f"| {_mib(at_health)} | {_mib(settled)} |"
        )
    rows.append(f"\n{record.environment_line(env)}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", default=["default"], metavar="FILE.gguf")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--settle", type=float, default=15.0)
    parser.add_argument("--neighbours", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--isa", default="auto")
    parser.add_argument(
        "--server-args", type=shlex.split, default=[], help='e.g. "--device cuda --dtype bfloat16"'
    )
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    load_before = record.load_average()
    results = []
    with (
        tempfile.TemporaryDirectory(prefix="pagedchat-starts-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        stack.enter_context(neighbours(args.neighbours))
        for name in args.model:
            model = model_file(name)
            results.append(measure(model, args, Path(tmp) / (model.stem if model else "dummy")))
    env = record.environment(
        __spec__.name, load_before=load_before, threads=args.threads, neighbours=args.neighbours
    )
    print(report(results, env))
    record.write_json(args.json, {"environment": env, "files": results})


if __name__ == "__main__":
    main()
