"""Warm start (issue 54): the nano workload run by the first requests after an engine start, in a fresh process
whose Triton cache directory (``TRITON_CACHE_DIR``) starts empty, against the same run in a second fresh process
over the cache the first one filled; with the engine's start-up warm-up (engine/worker/warm_up.py) off and on.

Each run is a process of its own (``--child``): it builds the dummy-weights engine (start seconds: weights, KV
sizing, CUDA graphs and the warm-up, which is also reported alone), then drives the nano workload
(benchmarks/offline/nano.py's requests, greedy) with no warm-up of its own, so its first steps are the first
requests a server would see. Throughput = output tokens / wall seconds; the Triton variants compiled (or loaded
from the cache) during the run are listed by kernel and specialization key.

    python -m benchmarks.offline.warm_start --model-config llama-3.2-1b [--num-requests 256] [--modes off on]
        [--kv-cache-dtype fp8] [--json PATH]
    smoke test on the CPU: --device cpu --num-requests 2 --max-prompt-len 8 --max-output-len 4
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import kernels
from benchmarks.harness import record
from benchmarks.harness.workloads import capped, nano_workload
from engine.worker.dummy_model import DUMMY_ARCHITECTURES

RUNS = ("first", "second")


def variant_keys() -> set[tuple[str, str]]:
    """(kernel, specialization key) of every Triton variant the ``kernels`` package holds in this process."""
    import triton

    keys = set()
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"kernels.{info.name}")
        for name, value in vars(module).items():
            if not isinstance(value, triton.runtime.jit.JITFunction):
                continue
            for entry in (getattr(value, "device_caches", {}) or {}).values():
                cache = entry[0] if isinstance(entry, tuple) else entry
                keys |= {(f"{info.name}.{name}", str(key)) for key in cache}
    return keys


def run_child(args: argparse.Namespace) -> dict[str, Any]:
    """One start and one timed nano run in this process."""
    import torch

    from benchmarks.harness.engine import build_engine, synchronize
    from benchmarks.offline.nano import drive

    requests = nano_workload(
        args.num_requests, args.seed, capped(args.max_prompt_len), capped(args.max_output_len)
    )
    start = time.perf_counter()
    engine = build_engine(
        args, seed=args.seed, kv_cache_dtype=args.kv_cache_dtype, warm_up=args.warm_up
    )
    start_seconds = time.perf_counter() - start
    before = variant_keys() if engine.config.torch_device.type == "cuda" else set()
    start = time.perf_counter()
    tokens = drive(engine, requests, "run")
    synchronize(engine.config.torch_device)
    seconds = time.perf_counter() - start
    after = variant_keys() if engine.config.torch_device.type == "cuda" else set()
    new = sorted(after - before)
    return {
        "warm_up": args.warm_up,
        "start_seconds": start_seconds,
        "warm_up_seconds": engine.core.warm_up_seconds,
        "output_tokens": tokens,
        "seconds": seconds,
        "tok_s": tokens / seconds,
        "variants_at_start": len(before),
        "compiled_in_run": [{"kernel": k, "key": key[:1500]} for k, key in new],
        "device": record.device_name(engine.config.torch_device),
        "torch": torch.__version__,
    }


def spawn(args: argparse.Namespace, warm_up: bool, cache_dir: str) -> dict[str, Any]:
    """A child process over ``cache_dir``; its result."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as out:
        path = out.name
    command = [
        sys.executable,
        "-m",
        "benchmarks.offline.warm_start",
        "--child",
        "--child-json",
        path,
    ]
    command += ["--warm-up" if warm_up else "--no-warm-up", "--model-config", args.model_config]
    for flag in ("num_requests", "seed", "device", "dtype", "kv_cache_dtype"):
        command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    for flag in ("max_prompt_len", "max_output_len"):
        if getattr(args, flag) is not None:
            command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    subprocess.run(command, check=True, env={**os.environ, "TRITON_CACHE_DIR": cache_dir})
    result = json.loads(Path(path).read_text())
    os.unlink(path)
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-config", required=True, choices=sorted(DUMMY_ARCHITECTURES))
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    parser.add_argument("--max-prompt-len", type=int, help="smoke tests only")
    parser.add_argument("--max-output-len", type=int, help="smoke tests only")
    parser.add_argument("--modes", nargs="+", choices=("off", "on"), default=["off", "on"])
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-json", help=argparse.SUPPRESS)
    parser.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=True)
    return parser.parse_args(argv)


def table(results: dict[str, list[dict[str, Any]]]) -> str:
    rows = [
        "| warm-up | run | start s (warm-up s) | tok/s | run s | variants compiled in the run |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for mode, runs in results.items():
        for name, run in zip(RUNS, runs):
            rows.append(
                f"| {mode} | {name} | {run['start_seconds']:.1f} ({run['warm_up_seconds']:.1f}) | "
                f"{run['tok_s']:.0f} | {run['seconds']:.2f} | {len(run['compiled_in_run'])} |"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        Path(args.child_json).write_text(json.dumps(run_child(args)))
        return
    load_before = record.load_average()
    results: dict[str, list[dict[str, Any]]] = {}
    result: dict[str, Any] = {"model": args.model_config, "runs": results}
    for mode in args.modes:
        with tempfile.TemporaryDirectory(prefix="triton-cache-") as cache_dir:
            results[mode] = [spawn(args, mode == "on", cache_dir) for _ in RUNS]
        result["summary"] = summary = {
            mode: {
                "first_over_second": runs[0]["tok_s"] / runs[1]["tok_s"],
                "start_seconds": [run["start_seconds"] for run in runs],
            }
            for mode, runs in results.items()
        }
        # (after each mode: a later one's failure keeps the earlier numbers)
        result["environment"] = record.environment(__spec__.name, None, load_before)
        result["environment"]["device"] = results[mode][0]["device"]
        record.write_json(args.json, result)
    print(f"\n## warm start: {args.model_config}, {args.num_requests} nano requests\n")
    print(table(results))
    for mode, runs in results.items():
        for name, run in zip(RUNS, runs):
            for variant in run["compiled_in_run"]:
                print(
                    f"warm-up {mode}, {name} run compiled: {variant['kernel']} {variant['key'][:160]}"
                )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
