"""Where the host's time goes in a steady decode step at large batches (issue 54).

Per batch C (256 and 512 by default): C requests with ``--prompt-len``-token prompts are prefilled, then the
steady decode step is measured three ways over consecutive steps: its wall time and the engine's host phases
(``engine.counters``: schedule, prepare, launch, wait, output; the rest of the wall is "other": the output
processor and the loop), the GPU's busy time (torch.profiler; wall over busy is the host's overhead), and a py-spy
profile of this process over ``--spy-steps`` steps (sampled from outside, ``--rate`` Hz, idle samples kept,
``--native`` frames where py-spy can unwind them), summarised as self time per Python function in ms per step.
``--cprofile-steps`` adds a cProfile window (exact call counts per step; its times carry cProfile's overhead).

    python -m benchmarks.offline.host_profile --model-config llama-3.2-1b --batches 256 512 --out DIR

CUDA graphs are captured up to the largest batch (``max_graph_batch_size``), so each batch replays a graph.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import logging
import os
import pstats
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.harness import record
from benchmarks.harness.engine import add_engine_options, build_engine, synchronize
from benchmarks.offline.nano import PHASES, fill_decode_batch, profile_steps, time_steps
from engine.llm_engine import LLMEngine

logger = logging.getLogger("benchmarks.offline.host_profile")

# a frame of an engine step in py-spy's raw (collapsed) stacks: samples inside a step
STEP_FRAME = "step (engine/llm_engine.py"
TOP_FUNCTIONS = 25


def spy_steps(
    engine: LLMEngine, steps: int, args: argparse.Namespace, path: Path, scale_ms: float
) -> dict[str, Any]:
    """``steps`` decode steps under py-spy (attached to this process): the profile's summary in ms of a step of
    ``scale_ms`` (the wall measured without the profiler), and the steps' wall time under it."""
    proc, native = None, args.native
    for native in [True, False] if args.native else [False]:
        log = Path(tempfile.gettempdir()) / f"{path.stem}.log"
        with open(log, "w") as stderr:  # (a pipe left unread could fill and stall py-spy)
            proc = subprocess.Popen(spy_command(args, path, native), stderr=stderr)
        time.sleep(args.attach_s)  # (py-spy attaches, then samples)
        if proc.poll() is None:
            break
        logger.warning("py-spy (native=%s) exited: %s", native, log.read_text()[-2000:])
    if proc is None or proc.poll() is not None:
        return {"error": "py-spy did not run"}
    synchronize(engine.config.torch_device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    synchronize(engine.config.torch_device)
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    proc.send_signal(signal.SIGINT)  # (py-spy writes its profile on ^C)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
    if not path.exists():
        error = (Path(tempfile.gettempdir()) / f"{path.stem}.log").read_text()[-2000:]
        return {"error": f"no profile written: {error}", "wall_ms": wall_ms}
    # (shares of the samples, in ms of the step measured without the profiler)
    summary = summarize_raw(path.read_text(), scale_ms)
    return {"native": native, "steps": steps, "wall_ms": wall_ms, **summary}


def spy_command(args: argparse.Namespace, path: Path, native: bool) -> list[str]:
    command = [args.py_spy, "record", "--pid", str(os.getpid()), "--rate", str(args.rate)]
    command += ["--format", "raw", "--output", str(path), "--idle"]
    return command + (["--native"] if native else ["--nonblocking"])


def summarize_raw(text: str, wall_ms: float) -> dict[str, Any]:
    """py-spy's collapsed stacks (``frame;frame;... count``, root first) of the samples inside an engine step, as
    ms per step: self time by innermost Python function and by innermost frame (native too), and the
    inclusive time of each Python function. Samples are scaled to the measured wall time per step."""
    own_py: Counter[str] = Counter()
    own_leaf: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if STEP_FRAME not in stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        python = [strip_line(f) for f in frames if ".py" in f]
        own_leaf[strip_line(frames[-1])] += n
        own_py[python[-1] if python else strip_line(frames[-1])] += n
        for name in set(python):
            inclusive[name] += n
    scale = wall_ms / total if total else 0.0

    def top(counter: Counter[str]) -> dict[str, float]:
        return {name: n * scale for name, n in counter.most_common(TOP_FUNCTIONS)}

    return {
        "samples_in_steps": total,
        "self_ms_python": top(own_py),
        "self_ms_leaf": top(own_leaf),
        "inclusive_ms": top(inclusive),
    }


def strip_line(frame: str) -> str:
    """``name (path:line)`` -> ``name (path)``; long paths cut to the repository's or the library's tail."""
    frame = re.sub(r":\d+\)$", ")", frame.strip())
    return re.sub(r"\(.*?/(site-packages|dist-packages|lib/python3\.\d+)/", "(", frame)


def cprofile_steps(engine: LLMEngine, steps: int, path: Path) -> dict[str, Any]:
    """``steps`` steps under cProfile: its stats file, and the top functions by own time (with calls per step)."""
    profiler = cProfile.Profile()
    synchronize(engine.config.torch_device)
    profiler.enable()
    for _ in range(steps):
        engine.step()
    synchronize(engine.config.torch_device)
    profiler.disable()
    profiler.dump_stats(str(path))
    stats = pstats.Stats(profiler, stream=io.StringIO())
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:TOP_FUNCTIONS]
    return {
        f"{Path(file).name}:{line} {name}": {
            "calls_per_step": calls / steps,
            "own_ms_per_step": own * 1e3 / steps,
            "cumulative_ms_per_step": cumulative * 1e3 / steps,
        }
        for (file, line, name), (_, calls, own, cumulative, _) in rows
    }


def measure_batch(engine: LLMEngine, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    rids = fill_decode_batch(engine, batch, args.prompt_len, args.seed + batch)
    for _ in range(args.warmup_steps):
        engine.step()
    result: dict[str, Any] = {"batch": batch, "running": engine.stats().num_running}
    result |= time_steps(engine, args.steps)
    result["other_ms"] = result["wall_ms_mean"] - sum(result["host_ms"].values())
    if engine.config.torch_device.type == "cuda":
        gpu = profile_steps(engine, args.steps)
        result |= {k: gpu[k] for k in ("gpu_busy_ms", "gpu_kernel_ms", "kernels_per_step")}
        result["wall_over_gpu"] = result["wall_ms_mean"] / gpu["gpu_busy_ms"]
    out = Path(args.out)
    if args.spy_steps and args.py_spy:
        result["py_spy"] = spy_steps(
            engine, args.spy_steps, args, out / f"py-spy-b{batch}.txt", result["wall_ms_mean"]
        )
    if args.cprofile_steps:
        path = out / f"cprofile-b{batch}.prof"
        result["cprofile"] = cprofile_steps(engine, args.cprofile_steps, path)
    for rid in rids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return result


def report(result: dict[str, Any]) -> str:
    """One batch's numbers as a short markdown table and the profile's top functions."""
    phases = " / ".join(f"{result['host_ms'][p]:.3f}" for p in PHASES)
    lines = [
        f"\n### decode batch {result['batch']} ({result['running']} running)",
        (
            f"wall {result['wall_ms_mean']:.3f} ms/step (median {result['wall_ms_median']:.3f}); "
            f"GPU busy {result.get('gpu_busy_ms', float('nan')):.3f}; "
            f"wall/GPU {result.get('wall_over_gpu', 0):.2f}x"
        ),
        f"host ms/step {' / '.join(PHASES)}: {phases}; other (wall - phases) {result['other_ms']:.3f}",
    ]
    spy = result.get("py_spy", {})
    if "self_ms_python" in spy:
        lines.append(
            f"py-spy (native={spy['native']}): {spy['samples_in_steps']} samples in {spy['steps']} steps, "
            f"wall {spy['wall_ms']:.3f} ms/step under it"
        )
        for title, key in (
            ("self, by Python function", "self_ms_python"),
            ("self, leaf", "self_ms_leaf"),
            ("inclusive", "inclusive_ms"),
        ):
            lines.append(f"| {title} | ms/step |\n|---|---:|")
            lines += [f"| {name[:100]} | {ms:.3f} |" for name, ms in list(spy[key].items())[:16]]
    elif spy:
        lines.append(f"py-spy: {spy.get('error')}")
    for name, row in list(result.get("cprofile", {}).items())[:12]:
        lines.append(
            f"cprofile {name[:90]}: {row['calls_per_step']:.0f} calls, own {row['own_ms_per_step']:.3f} ms"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_engine_options(parser)
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--prompt-len", type=int, default=640)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--spy-steps", type=int, default=400)
    parser.add_argument("--cprofile-steps", type=int, default=50)
    parser.add_argument("--py-spy", default=shutil.which("py-spy"))
    parser.add_argument("--rate", type=int, default=500)
    parser.add_argument("--native", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--attach-s", type=float, default=2.0)
    parser.add_argument("--out", default=".")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    load_before = record.load_average()
    largest = max(args.batches)
    args.max_num_seqs = max(args.max_num_seqs or 0, largest)
    engine = build_engine(args, seed=args.seed, max_graph_batch_size=largest)
    results = []
    for batch in args.batches:
        results.append(measure_batch(engine, batch, args))
        print(report(results[-1]), flush=True)
    env = record.environment(__spec__.name, engine.config.torch_device, load_before)
    record.write_json(
        str(Path(args.out) / "host-profile.json"),
        {"environment": env, "model": args.model_config, "batches": results},
    )
    print(record.environment_line(env))


if __name__ == "__main__":
    main()
