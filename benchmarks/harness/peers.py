"""The peers a benchmark runs beside ours, in the same command (WORKLOADS.md: ratios then hold on a noisy
machine). Their failure is a result to report, never fatal to the benchmark that runs them.

- transformers continuous batching on the engine's dummy weights (the nano workload's peer, GPU):
  ``continuous_batching_context_manager(...)`` (or init + start + stop on older 5.x), ``add_request(ids,
  request_id=..., max_new_tokens=n)`` per request, ``get_result()`` until all finish (``run_peer``: a ``Run``
  with ``error`` set when it fails).
- transformers ``generate`` on an HF directory (single prompt; a left-padded batch): ``TransformersPeer``.
- llama.cpp (llama-cpp-python) on a GGUF file, one sequence at a time with its KV cleared before each, optionally
  from a ``pip install --target DIR`` build for one instruction-set level: ``LlamaCppPeer``.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import logging
import sys
import time
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from tqdm import tqdm

from benchmarks.harness.engine import Run, synchronize
from benchmarks.harness.workloads import Request, capped, nano_workload
from engine.worker.dummy_model import dummy_hf_config, dummy_weights

logger = logging.getLogger(__name__)


# transformers continuous batching (nano) -------------------------------------------------------------------


def build_peer(
    name: str, device: torch.device, dtype: torch.dtype, seed: int, attn: str | None
) -> Any:
    """transformers' model of ``name`` holding the engine's dummy weights (the same seeded tensors)."""
    from transformers import AutoModelForCausalLM

    config = dummy_hf_config(name)
    extra = {"attn_implementation": attn} if attn else {}
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **extra)
    state = model.state_dict()
    with torch.no_grad():
        # one at a time: low peak
        for weight_name, tensor in dummy_weights(config, seed=seed, device=device):
            state[weight_name].copy_(tensor)
    return model.eval()


def _accepted(fn: Any, **kwargs: Any) -> dict[str, Any]:
    """The keyword arguments ``fn`` takes (transformers 5.x releases differ in these)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params and v is not None}


def _cb_config(attn: str | None) -> Any:
    if not attn:
        return None
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:
        return None
    return ContinuousBatchingConfig(auto_switch_to_flash=False)  # keep the attention asked for


@contextlib.contextmanager
def peer_manager(
    model: Any, gen_config: Any, requests: list[Request], attn: str | None
) -> Iterator[Any]:
    """A started ContinuousBatchingManager (context manager API, or init + start + stop on older 5.x)."""
    hints = None
    with contextlib.suppress(ImportError):
        from transformers.generation.continuous_batching.utils import WorkloadHints

        hints = WorkloadHints(
            max_prompt_length=max(len(r.prompt) for r in requests),
            max_generated_length=max(r.output_len for r in requests),
            num_requests=len(requests),
        )
    if hasattr(model, "continuous_batching_context_manager"):
        cm = model.continuous_batching_context_manager
        with cm(
            **_accepted(
                cm,
                generation_config=gen_config,
                block=True,
                timeout=30,
                workload_hints=hints,
                continuous_batching_config=_cb_config(attn),
            )
        ) as manager:
            yield manager
        return
    init = model.init_continuous_batching
    manager = init(
        **_accepted(
            init,
            generation_config=gen_config,
            workload_hints=hints,
            continuous_batching_config=_cb_config(attn),
        )
    )
    manager.start()
    try:
        yield manager
    finally:
        manager.stop(block=True, timeout=30)


def peer_generate(
    manager: Any, requests: list[Request], prefix: str, deadline: float, progress: bool = False
) -> dict[str, int]:
    """Submit all, collect every finished result; request id -> generated tokens."""
    eos = (
        {"eos_token_id": -1}
        if "eos_token_id" in inspect.signature(manager.add_request).parameters
        else {}
    )
    for i, request in enumerate(requests):
        manager.add_request(
            request.prompt, request_id=f"{prefix}-{i}", max_new_tokens=request.output_len, **eos
        )
    produced: dict[str, int] = {}
    with tqdm(
        total=sum(r.output_len for r in requests), unit="tok", desc=prefix, disable=not progress
    ) as bar:
        while len(produced) < len(requests):
            if time.perf_counter() > deadline:
                raise TimeoutError(
                    f"{prefix}: {len(produced)} of {len(requests)} requests finished in time"
                )
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError(f"{prefix}: the generation thread stopped")
                continue
            if getattr(result, "error", None):
                raise RuntimeError(f"{prefix}: request {result.request_id} failed: {result.error}")
            if result.is_finished():
                produced[result.request_id] = len(result.generated_tokens)
                bar.update(len(result.generated_tokens))
    return produced


def run_peer(
    args: argparse.Namespace, requests: list[Request], device: torch.device, dtype: torch.dtype
) -> Run:
    from transformers import GenerationConfig

    run = Run("transformers CB", len(requests), sum(r.output_len for r in requests))
    try:
        start = time.perf_counter()
        model = build_peer(args.model_config, device, dtype, args.seed, args.peer_attn)
        gen_config = GenerationConfig(
            do_sample=False,
            max_new_tokens=max(r.output_len for r in requests),
            eos_token_id=None,
            pad_token_id=0,
        )
        model.generation_config = gen_config
        deadline = time.perf_counter() + args.peer_timeout
        with peer_manager(model, gen_config, requests, args.peer_attn) as manager:
            run.start_seconds = time.perf_counter() - start
            start = time.perf_counter()
            peer_generate(
                manager,
                nano_workload(2, 1_000_003, capped(64), capped(16)),
                "peer-warm-up",
                deadline,
            )
            synchronize(device)
            run.warmup_seconds = time.perf_counter() - start
            start = time.perf_counter()
            produced = peer_generate(manager, requests, "peer", deadline, progress=True)
            synchronize(device)
            run.seconds = time.perf_counter() - start
        run.output_tokens = sum(produced.values())
        if run.output_tokens != run.requested_tokens:
            run.error = f"produced {run.output_tokens} tokens, {run.requested_tokens} requested"
    except Exception as exc:  # the peer's failure is a result to report, not a reason to lose ours
        logger.exception("transformers continuous batching failed")
        run.error = f"{type(exc).__name__}: {exc}"[:500]
    return run


# the CPU peers: transformers generate and llama.cpp --------------------------------------------------------


class Peer(Protocol):
    """A peer of the cpu workload: greedy tokens for a batch of prompts, and one prompt's first token."""

    name: str

    def generate(
        self, prompts: list[list[int]], new_tokens: int
    ) -> tuple[float, list[list[int]]]: ...

    def first_token_seconds(self, prompt: list[int]) -> float: ...


class TransformersPeer:
    """transformers ``generate`` in float32 on an HF directory (for a GGUF model: its float32 export,
    tests/hf_export.py)."""

    name = "transformers"

    def __init__(self, model_path: str, pad_id: int) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.pad_id = pad_id

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
        ids, mask = left_pad(prompts, self.pad_id)
        start = time.perf_counter()
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=self.pad_id,
        )
        seconds = time.perf_counter() - start
        return seconds, out[:, ids.shape[1] :].tolist()

    def first_token_seconds(self, prompt: list[int]) -> float:
        return self.generate([prompt], 1)[0]


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left padding keeps every prompt's last token in the last column, where generation continues."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def check_level(system_info: str, level: str) -> None:
    """Refuse a llama.cpp build whose instruction sets are not those of our ``level`` (a resolved cpu_isa): an AVX2
    comparison against an AVX-512 build, or the reverse, would measure the build, not the engines. (pip reuses its
    cached wheel of the same version whatever CMAKE_ARGS say: build each level with ``--no-cache-dir``.)"""
    avx512 = "AVX512 = 1" in system_info
    vnni = "AVX512_VNNI = 1" in system_info
    # (our avx512 level runs against either build: none without VNNI is made)
    wider = level in ("generic", "avx2") and avx512
    narrower = level == "avx512_vnni" and not (avx512 and vnni)
    if wider or narrower:
        raise SystemExit(
            f"the llama.cpp build does not match the level {level}: its system info says {system_info!r} "
            "(build one per level with pip --no-cache-dir: docs/benchmarks/cpu.md)"
        )


class LlamaCppPeer:
    """llama-cpp-python on a GGUF file (greedy: its own sampler chain at temperature 0). It serves one sequence at
    a time, so N streams are N sequential generations; its KV cache is cleared before each. ``import_dir`` takes
    llama-cpp-python from a ``pip install --target DIR`` build (one per instruction-set level; the CMAKE_ARGS are
    in docs/benchmarks/cpu.md), so that it runs at the level ours runs at."""

    name = "llama.cpp"

    def __init__(
        self,
        gguf_file: str,
        threads: int,
        import_dir: str | None = None,
        level: str | None = None,
    ) -> None:
        if import_dir:
            sys.path.insert(0, import_dir)
        try:
            import llama_cpp
        except ImportError as exc:
            raise SystemExit(
                "the llama.cpp peer needs llama-cpp-python (a benchmark-only dependency): see "
                "docs/benchmarks/cpu.md for the build flags that work here, e.g. CMAKE_ARGS=... "
                "pip install llama-cpp-python==0.3.36"
            ) from exc

        self.version = llama_cpp.__version__
        # (the instruction sets it uses)
        self.system_info = llama_cpp.llama_print_system_info().decode().strip()
        if level is not None:
            check_level(self.system_info, level)
        self.llm = llama_cpp.Llama(
            model_path=gguf_file,
            n_threads=threads,
            n_threads_batch=threads,
            n_ctx=2048,
            n_batch=512,
            verbose=False,
        )

    def _one(self, prompt: list[int], new_tokens: int) -> list[int]:
        # (the next eval drops every cached position: no prefix reuse between runs)
        self.llm.reset()
        tokens = []
        for token in self.llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            tokens.append(int(token))
            if len(tokens) == new_tokens:
                break
        return tokens

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        outputs = [self._one(prompt, new_tokens) for prompt in prompts]
        return time.perf_counter() - start, outputs

    def first_token_seconds(self, prompt: list[int]) -> float:
        start = time.perf_counter()
        self._one(prompt, 1)
        return time.perf_counter() - start
