"""Workload "Your own GGUF vs llama.cpp" (shared WORKLOADS.md): a user's GGUF file (K-quants: Q4_K_M, Q5_K_M, Q6_K,
Q8_0; ``benchmarks.cpu.make_kquants`` makes them from one source with llama.cpp's quantizer) served by pagedchat in
the file's own block formats and by llama.cpp (llama-cpp-python) built for the same instruction-set level, with the
same threads and the same prompt tokens. Per file:

- time to healthy: ``pagedchat serve --model FILE`` until ``GET /health`` answers, on a cache that has never seen
  the file (first start: its config and tokenizer described once) and again (second start). The native kernels
  are built already (they are per machine, not per model: a fresh cache dir is given the built ones).
- load: each engine's own construction in a fresh process (``LLM(model=FILE)``, ``llama_cpp.Llama(FILE)``).
- greedy agreement on the first 16 tokens of 8 chat prompts, between the two engines and each against pagedchat's
  float32 mode on the same file (its weights de-quantized: token-exact with transformers in tests).
- 1-stream and 8-stream output tok/s (``--new-tokens`` each, EOS ignored; llama.cpp runs streams one after the
  other, as it serves one sequence at a time), and the time to the first token of a ~500-token prompt.
- resident memory: each engine's process peak (VmHWM) and its RSS at the end (the mapped file's touched pages
  count in both engines); and the served process tree's (the front, the engine core, the grammar workers) once the
  second start is healthy.

Each engine runs in a process of its own, so load times and memory are its own.

    python -m benchmarks.cpu.own_gguf --model FILE.gguf [FILE.gguf ...] [--isa auto] [--llama-cpp-dir DIR]
                                      [--threads 2] [--new-tokens 64] [--streams 8] [--repeats 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness import record
from benchmarks.harness.processes import resident_by_name
from benchmarks.online.http_client import stop_process, wait_for_health
from kernels.cpu_native import CPU_ISA_CHOICES

logger = logging.getLogger("benchmarks.cpu.own_gguf")

AGREEMENT_TOKENS = 16
SIDES = ("ours", "llama.cpp", "float32")
REPO_ROOT = Path(__file__).resolve().parents[2]


# one engine, in its own process -----------------------------------------------------------------------------


def kv_bytes_per_token(model: Path, element_bytes: int) -> int:
    """K and V of every layer for one position, from the file's metadata."""
    from engine.weights.gguf_config import hf_config
    from engine.weights.gguf_file import GGUFFile

    gguf = GGUFFile(model)
    config = hf_config(gguf)
    gguf.close()
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * element_bytes


def memory() -> dict[str, float]:
    """This process's peak and current resident memory, MiB."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            fields[key] = int(value.split()[0]) / 1024
    return {"peak_rss_mib": fields["VmHWM"], "rss_mib": fields["VmRSS"]}


def run_side(args: argparse.Namespace) -> dict[str, Any]:
    """``args.side`` on ``args.model``: its numbers, and (ours) the prompts every side then uses."""
    import torch

    from benchmarks.cpu.throughput import Side, chat_prompts, long_prompt, run_ours

    torch.set_num_threads(args.threads)
    (model,) = args.model
    prompts_file = Path(args.prompts)
    start = time.perf_counter()
    if args.side == "llama.cpp":
        from benchmarks.harness.peers import LlamaCppPeer

        from kernels.cpu_native import resolve_isa

        peer = LlamaCppPeer(model, args.threads, args.llama_cpp_dir, resolve_isa(args.isa))
        load_s = time.perf_counter() - start
        generate, first_token = peer.generate, peer.first_token_seconds
        # (its KV cache: n_ctx positions of float16 K and V per layer)
        extra = {
            "system_info": peer.system_info,
            "version": peer.version,
            "kv_pool_mib": peer.llm.n_ctx() * kv_bytes_per_token(Path(model), 2) / 2**20,
        }
    else:
        from engine.llm import LLM

        weights = "float32" if args.side == "float32" else "file"
        llm = LLM(
            model=model,
            num_threads=args.threads,
            cpu_weights=weights,
            cpu_isa=args.isa,
            kv_cache_memory_gib=args.kv_gib,
        )
        load_s = time.perf_counter() - start
        if args.side == "ours":
            prompts = chat_prompts(llm, args.streams)
            prompts_file.write_text(
                json.dumps({"prompts": prompts, "long": long_prompt(llm, args.long_prompt)})
            )

        def generate(batch: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
            return run_ours(llm, batch, n)

        def first_token(prompt: list[int]) -> float:
            return run_ours(llm, [prompt], 1)[0]

        from kernels.cpu_native import resolve_isa

        extra = {
            "cpu_weights": weights,
            "cpu_isa": resolve_isa(llm.engine.config.cpu_isa),
            "kv_pool_mib": args.kv_gib * 1024,
        }
    given = json.loads(prompts_file.read_text())
    prompts, long = given["prompts"], given["long"]
    agreement = [generate([p], AGREEMENT_TOKENS)[1][0] for p in prompts]
    result: dict[str, Any] = {"load_s": load_s, "agreement_tokens": agreement, **extra}
    if args.side == "float32":
        result["partings"] = partings(llm, prompts, prompts_file.parent)
    if args.side != "float32":
        generate(prompts[:2], 4)  # warm-up: one-time costs outside the timing
        scenarios = {"1 stream": prompts[:1], f"{len(prompts)} streams": prompts}
        sides = {name: Side(len(batch), args.new_tokens) for name, batch in scenarios.items()}
        ttft = []
        for _ in range(args.repeats):
            for name, batch in scenarios.items():
                seconds, outputs = generate(batch, args.new_tokens)
                if {len(o) for o in outputs} != {args.new_tokens}:
                    raise RuntimeError(f"{args.side}, {name}: not {args.new_tokens} tokens each")
                sides[name].seconds.append(seconds)
            ttft.append(first_token(long))
        result["tok_s"] = {name: side.best_tok_s for name, side in sides.items()}
        result["ttft_long_s"] = min(ttft)
        result["long_tokens"] = len(long)
    return {**result, **memory()}


def partings(llm: Any, prompts: list[list[int]], work: Path) -> list[dict[str, Any]]:
    """Where ours and llama.cpp part on a prompt: the float32 model's log-probabilities of each one's token there
    (given the tokens both produced before it). A small gap is a near-tie that 4-bit weights may tip either way."""
    from engine.sampling_params import MAX_LOGPROBS, SamplingParams

    sides = {name: work / f"{name}.json" for name in ("ours", "llama.cpp")}
    if not all(path.is_file() for path in sides.values()):
        return []
    ours, theirs = (json.loads(path.read_text())["agreement_tokens"] for path in sides.values())
    found = []
    for i, (prompt, a, b) in enumerate(zip(prompts, ours, theirs)):
        at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if at is None:
            continue
        params = SamplingParams(temperature=0, max_tokens=1, logprobs=MAX_LOGPROBS)
        (top,) = llm.generate([prompt + a[:at]], params)[0].logprobs
        ranked = dict(top.top)
        floor = min(ranked.values())
        found.append(
            {
                "prompt": i,
                "position": at,
                "float32_top": top.token_id,
                "ours": a[at],
                "llama.cpp": b[at],
                # (below the top MAX_LOGPROBS: at most the last one's)
                "ours_logprob": ranked.get(a[at], floor),
                "llama.cpp_logprob": ranked.get(b[at], floor),
            }
        )
    return found


# the server's start ----------------------------------------------------------------------------------------


def time_to_healthy(
    model: Path | None,
    cache_dir: Path,
    args: argparse.Namespace,
    settle_s: float = 0.0,
    at_health: Callable[[str], dict[str, float]] | None = None,
) -> tuple[float, dict[str, float]]:
    """Seconds from ``pagedchat serve --model MODEL`` to ``GET /health`` answering 200, and the resident memory of
    the server's processes then (``tree_memory``); with ``settle_s``, also ``settle_s`` later (the same keys with
    ``settled_`` before them: what the grammar workers and the core build once healthy). ``at_health(base_url)``
    runs first once healthy; its numbers join the memory's. No ``model``: the server's
    default, or what ``args.server_args`` (added to the command, where given) says."""
    from tests.server_harness import free_port

    port = free_port()
    command = [
        sys.executable,
        "-m",
        "app",
        "serve",
        *(["--model", str(model)] if model is not None else []),
        *getattr(args, "server_args", []),
        "--port",
        str(port),
        "--cache-dir",
        str(cache_dir),
        "--num-threads",
        str(args.threads),
        "--cpu-isa",
        args.isa,
        "--kv-cache-memory-gib",
        "0.5",
        "--session-db-path",
        str(cache_dir / "sessions.sqlite3"),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("PAGEDCHAT_API_KEY", None)
    start = time.perf_counter()
    log_path = cache_dir / f"server-{port}.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=log)
    try:
        # (asked every 50 ms: every 0.5 s made each start's seconds a multiple of it, +- the first ask)
        wait_for_health(f"http://127.0.0.1:{port}", process, 600.0, str(log_path), poll_s=0.05)
        healthy_s = time.perf_counter() - start
        served = tree_memory(process.pid)
        if at_health is not None:
            served.update(at_health(f"http://127.0.0.1:{port}"))
        if settle_s:
            time.sleep(settle_s)
            served.update({f"settled_{k}": mib for k, mib in tree_memory(process.pid).items()})
        return healthy_s, served
    finally:
        stop_process(process, signal.SIGTERM, "server")


def tree_memory(pid: int) -> dict[str, float]:
    """MiB resident in process ``pid``'s tree by process name, their ``total``, and the tree's PSS (``pss_total``)."""
    memory = {name: b / 2**20 for name, b in resident_by_name(pid).items()}
    memory["total"] = sum(memory.values())
    memory["pss_total"] = sum(resident_by_name(pid, proportional=True).values()) / 2**20
    return memory


def starts_cache(work: Path) -> Path:
    """A cache directory under ``work`` that has seen no model, with this machine's built native kernels copied
    in (they are per machine, not per model)."""
    from engine.cache_dir import default_cache_dir

    cache_dir = work / "cache"
    built = Path(default_cache_dir()) / "native"
    if built.is_dir() and not (cache_dir / "native").exists():
        shutil.copytree(built, cache_dir / "native", symlinks=True)
    shutil.rmtree(cache_dir / "models", ignore_errors=True)
    cache_dir.mkdir(parents=True, exist_ok=True)  # (no native kernels to copy: a GPU machine)
    return cache_dir


def starts(model: Path, args: argparse.Namespace, work: Path) -> dict[str, float]:
    """First start on a cache that has not seen ``model`` (the built native kernels copied in), then again."""
    cache_dir = starts_cache(work)
    first, _ = time_to_healthy(model, cache_dir, args)
    second, served = time_to_healthy(model, cache_dir, args)
    return {"first_start_s": first, "second_start_s": second, "served_rss_mib": served}


# one file: every side, then the comparison -------------------------------------------------------------------


def side_in_process(side: str, model: Path, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    out = work / f"{side}.json"
    command = [
        sys.executable,
        "-m",
        "benchmarks.cpu.own_gguf",
        "--side",
        side,
        "--model",
        str(model),
        "--prompts",
        str(work / "prompts.json"),
        "--out",
        str(out),
        "--isa",
        args.isa,
        "--threads",
        str(args.threads),
        "--new-tokens",
        str(args.new_tokens),
        "--streams",
        str(args.streams),
        "--long-prompt",
        str(args.long_prompt),
        "--repeats",
        str(args.repeats),
        "--kv-gib",
        str(args.kv_gib),
    ]
    if args.llama_cpp_dir:
        command += ["--llama-cpp-dir", args.llama_cpp_dir]
    logger.info("%s on %s", side, model.name)
    subprocess.run(command, cwd=REPO_ROOT, check=True)
    return json.loads(out.read_text())


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """Prompts whose first AGREEMENT_TOKENS tokens are all equal, and the mean length of the equal prefix."""
    prefixes = [
        next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), len(s)) for s, t in zip(a, b)
    ]
    return {
        "identical": sum(p == AGREEMENT_TOKENS for p in prefixes),
        "prompts": len(prefixes),
        "mean_equal_prefix": sum(prefixes) / len(prefixes),
    }


def measure_file(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="own-gguf-") as tmp:
        work = Path(tmp)
        result: dict[str, Any] = {"file": model.name, "size_mib": model.stat().st_size / 2**20}
        result.update(starts(model, args, work))
        sides = [s for s in SIDES if args.llama_cpp or s != "llama.cpp"]
        result["sides"] = {side: side_in_process(side, model, args, work) for side in sides}
    tokens = {side: r.pop("agreement_tokens") for side, r in result["sides"].items()}
    pairs = [("ours", "float32"), ("llama.cpp", "float32"), ("ours", "llama.cpp")]
    result["agreement"] = {
        f"{a} vs {b}": agreement(tokens[a], tokens[b])
        for a, b in pairs
        if a in tokens and b in tokens
    }
    return result


def report(results: list[dict[str, Any]], env: dict[str, Any]) -> str:
    rows = [
        (
            "| file | MiB | engine | load s | 1-stream tok/s | 8-stream tok/s | TTFT ms | peak RSS MiB "
            "| peak RSS / (file + KV pool) |"
        ),
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        for side in ("ours", "llama.cpp"):
            s = r["sides"].get(side)
            if s is None:
                continue
            one, many = list(s["tok_s"].values())
            rows.append(
                f"| {r['file']} | {r['size_mib']:.0f} | {side} | {s['load_s']:.1f} | {one:.1f} | {many:.1f} | "
                f"{s['ttft_long_s'] * 1e3:.0f} | {s['peak_rss_mib']:.0f} | "
                f"{s['peak_rss_mib'] / (r['size_mib'] + s['kv_pool_mib']):.2f} |"
            )
    rows += [
        "",
        (
            f"| file | first start s | second start s | served RSS MiB (front + core + grammar processes); PSS "
            f"| {' | '.join(results[0]['agreement'])} "
            f"(all {AGREEMENT_TOKENS} tokens equal / prompts; mean equal prefix) |"
        ),
        "|---|---:|---:|---|" + "---|" * len(results[0]["agreement"]),
    ]
    for r in results:
        agree = " | ".join(
            f"{a['identical']}/{a['prompts']}; {a['mean_equal_prefix']:.1f}"
            for a in r["agreement"].values()
        )
        served = r["served_rss_mib"]
        parts = " + ".join(f"{v:.0f}" for k, v in served.items() if not k.endswith("total"))
        rows.append(
            f"| {r['file']} | {r['first_start_s']:.1f} | {r['second_start_s']:.1f} | "
            f"{served['total']:.0f} ({parts}); {served.get('pss_total', 0.0):.0f} | {agree} |"
        )
    long = results[0]["sides"]["ours"]["long_tokens"]
    for r in results:
        for part in r["sides"].get("float32", {}).get("partings", []):
            choice = {part["ours"]: "ours", part["llama.cpp"]: "llama.cpp"}
            rows.append(
                f"\n{r['file']}, prompt {part['prompt']}: parted at token {part['position']}; float32 "
                f"log-probabilities: ours' token {part['ours_logprob']:.3f}, llama.cpp's "
                f"{part['llama.cpp_logprob']:.3f} (float32 chose "
                f"{choice.get(part['float32_top'], 'neither')}'s)"
            )
    rows.append(f"\nTTFT: a {long}-token prompt; {record.environment_line(env)}")
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", nargs="+", required=True, metavar="FILE.gguf")
    parser.add_argument("--isa", default="auto", choices=CPU_ISA_CHOICES)
    parser.add_argument(
        "--llama-cpp-dir", metavar="DIR", help="llama-cpp-python from a pip --target build"
    )
    parser.add_argument("--no-llama-cpp", dest="llama_cpp", action="store_false")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--long-prompt", type=int, default=500)
    parser.add_argument(
        "--repeats", type=int, default=2, help="runs of each scenario; the best counts"
    )
    parser.add_argument(
        "--kv-gib",
        type=float,
        default=0.25,
        help="ours' KV pool (llama.cpp: a 2,048-token context)",
    )
    parser.add_argument("--json", metavar="PATH")
    # (one engine in its own process: what the parent runs)
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--prompts", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if (
        min(args.threads, args.new_tokens - 1, args.streams - 1, args.repeats) < 1
        or args.long_prompt < 16
    ):
        parser.error(
            "--threads, --repeats >= 1, --new-tokens and --streams >= 2, --long-prompt >= 16"
        )
    for model in args.model:
        if not Path(model).is_file() or not model.endswith(".gguf"):
            parser.error(f"--model: {model} is not a .gguf file")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.side:
        Path(args.out).write_text(json.dumps(run_side(args)))
        return
    load_before = record.load_average()
    results = [measure_file(Path(m).resolve(), args) for m in args.model]
    env = record.environment(
        __spec__.name, "cpu", load_before=load_before, threads=args.threads, isa=args.isa
    )
    env["llama_cpp"] = next(
        (r["sides"]["llama.cpp"]["version"] for r in results if "llama.cpp" in r["sides"]), None
    )
    print(report(results, env))
    record.write_json(args.json, {"environment": env, "files": results})


if __name__ == "__main__":
    main()
