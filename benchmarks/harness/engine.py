"""What the in-process benchmarks (offline/, and the in-process halves of online/) share: the engine options and
the dummy-weights engine, greedy sampling, a warm-up, freeing an engine, the throughput result of one run, and the
Triton variants compiled (a compile inside a timed run is ~1 s of it). Where and when a run happened:
harness/record.py."""

from __future__ import annotations

import argparse
import gc
import importlib
import pkgutil
from dataclasses import dataclass, field
from random import Random
from typing import Any

import torch

import kernels
from benchmarks.harness.workloads import VOCAB
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

WARM_UP_REQUESTS = 2
WARM_UP_TOKENS = 8


@dataclass(slots=True)
class Run:
    """One engine over (a prefix of) the workload."""

    engine: str
    requests: int
    requested_tokens: int
    output_tokens: int = 0
    seconds: float = 0.0
    # build: weights, KV cache, CUDA graph capture (peer: its own warm-up too)
    start_seconds: float = 0.0
    warmup_seconds: float = 0.0  # a small generate before the timed run
    error: str | None = None
    steps: int = 0  # engine steps of the timed run (ours)
    # host phases over the timed run (ours)
    phase_seconds: dict[str, float] = field(default_factory=dict)
    # Triton variants compiled during the timed run
    compiled: dict[str, int] = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0


def greedy(output_len: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)


# engines --------------------------------------------------------------------------------------------------


def add_engine_options(parser: argparse.ArgumentParser, model_config: str = "llama-3.2-1b") -> None:
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model-config", default=model_config, help="dummy architecture (llama-3.2-1b, qwen3-0.6b)"
    )
    group.add_argument("--device", default="auto", help="auto | cuda | cpu")
    group.add_argument(
        "--dtype",
        default="auto",
        help="auto (bfloat16 on GPU, float32 on CPU) | bfloat16 | float32",
    )
    group.add_argument("--max-num-seqs", type=int, default=None, help="default: the engine's")
    group.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="default: the engine's"
    )


def build_engine(args: argparse.Namespace, **options: Any) -> LLMEngine:
    """A dummy-weights engine from the engine options in ``args`` (the limits only where given) plus
    ``options`` (EngineConfig fields)."""
    limits = {
        name: getattr(args, name, None) for name in ("max_num_seqs", "max_num_batched_tokens")
    }
    config = EngineConfig(
        load_format="dummy",
        model_config=args.model_config,
        device=args.device,
        dtype=args.dtype,
        **{k: v for k, v in limits.items() if v is not None},
        **options,
    )
    return LLMEngine(config)


def warm_up(engine: LLMEngine, prompt_len: int) -> None:
    """A few short requests, so one-time costs (kernel compiles, allocator growth) fall outside timing."""
    rng = Random(-1)
    for i in range(WARM_UP_REQUESTS):
        ids = [rng.randrange(VOCAB) for _ in range(prompt_len)]
        engine.add_request(f"warm-up-{i}", ids, greedy(WARM_UP_TOKENS), cache_salt="warm-up")
    while engine.has_unfinished_requests():
        engine.step()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_memory(device: torch.device) -> None:
    """After the caller's ``del engine``: collect it and hand its cached device memory back."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def compiled_variants() -> dict[str, int]:
    """Compiled specializations per Triton kernel of the ``kernels`` package (launched ones only): a count
    that grows during a timed run means a compile (~1 s) inside it."""
    # (imported here: a CPU benchmark's process would otherwise hold Triton's ~70 MiB it never uses, and count it
    # as the engine's memory)
    import triton

    counts = {}
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"kernels.{info.name}")
        for name, value in vars(module).items():
            if (
                isinstance(value, triton.runtime.jit.JITFunction)
                and value.__module__ == module.__name__
            ):
                caches = getattr(value, "device_caches", {}) or {}
                total = sum(
                    len(entry[0]) if isinstance(entry, tuple) else len(entry)
                    for entry in caches.values()
                )
                if total:
                    counts[f"{info.name}.{name}"] = total
    return counts
