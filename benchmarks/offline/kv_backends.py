"""The two KV backends side by side: ``paged`` (block tables over a block pool) and ``vattention`` (each request
slot contiguous in virtual memory, 2 MiB driver pages mapped on demand; CUDA only).

Per (model, backend), the ``nano`` workload (shared WORKLOADS.md; dummy weights; ``max_model_len`` 4096 by
default, since vattention reserves virtual space for every slot x max_model_len), one engine at a time, each
freed before the next starts:
- start seconds (weights, KV memory, CUDA graphs) and output tok/s, measured by benchmarks.offline.nano's run_ours;
- then the same run again (prefix cache reset) for the memory numbers, so sampling never slows the timed run:
  KV memory, sampled after every ``--sample-every``-th step (benchmarks.offline.waste's sampling, each
  sample weighted by the wall time since the previous one): *reserved* = blocks referenced x bytes per block,
  *used* = tokens holding KV x bytes per token per layer x 2 (K, V) x layers; their time-averaged ratio is the
  useful share (internal fragmentation: the tail of a request's last block, 16 tokens when paged, one 2 MiB page
  per layer with vattention); the peak blocks in use (every step), the mean running requests, preemptions;
- vattention only, the allocation latency over the timed run: page-group maps and unmaps (one KV block into
  one request slot = 2 x layers driver calls, each cuMemMap + cuMemSetAccess, or cuMemUnmap), mean us per
  group and per driver call.

``--kernel`` (CUDA): the decode-kernel workload's shapes (32x8K, 64x8K, 128x1K, 32x2K; 32 query / 8 KV heads,
head 128, bf16) on the same K/V laid out twice: paged (blocks of 16, randomly permuted in the pool) and
contiguous (each sequence in a slot of ``context`` tokens, slots randomly permuted among 2 x batch), the latter
also copied into memory held as the vattention backend holds it (2 MiB driver handles, each mapped on its own:
a TLB entry per page). Median ms
of ``triton.testing.do_bench`` (L2 flushed), effective GB/s = K + V bytes read / time.

    python -m benchmarks.offline.kv_backends [--model-configs llama-3.2-1b qwen3-0.6b] [--backends paged vattention]
        [--num-requests 256] [--max-model-len 4096] [--sample-every 4] [--kernel/--no-kernel] [--json PATH]
    python -m benchmarks.offline.kv_backends_chart PATH [--out docs/kv_backends.png]
    smoke test on the CPU: --device cpu --backends paged --model-configs qwen3-0.6b --num-requests 2
        --max-prompt-len 8 --max-output-len 4 --no-kernel
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

import torch

from benchmarks.harness import record
from benchmarks.harness.engine import Run, build_engine, release_memory, synchronize
from benchmarks.harness.workloads import Request, capped, nano_workload
from benchmarks.kernel.decode_attention import (
    DTYPE,
    HEAD_DIM,
    KV_HEADS,
    SHAPES,
    bench,
    paged_inputs,
)
from benchmarks.kernel.decode_attention import run_ours as run_paged_kernel
from benchmarks.offline.nano import run_ours
from benchmarks.offline.waste import ModeResult, account, sample
from engine.config import KV_BACKENDS, EngineConfig
from engine.device_defaults import resolve_device
from engine.llm_engine import LLMEngine
from engine.worker.dummy_model import DUMMY_ARCHITECTURES
from kernels.contiguous_attention import contiguous_decode_attention

logger = logging.getLogger("benchmarks.offline.kv_backends")

MODELS = ("llama-3.2-1b", "qwen3-0.6b")
PAGED_KERNEL_BLOCK = 16
GIB = 2**30


# nano: sampling the KV memory ----------------------------------------------------------------------------


class KVSampler:
    """Stands in for ``engine.step`` (so run_ours drives it unchanged) and samples the block manager after
    every ``every``-th step. A run (steps from idle to idle) restarts the tally, so once run_ours returns it
    holds its timed run, not its warm-up."""

    def __init__(self, engine: LLMEngine, every: int) -> None:
        self.engine, self.every, self.idle = engine, every, True
        self.step = engine.step
        engine.step = self  # an instance attribute over the method; detach() removes it

    def restart(self) -> None:
        engine = self.engine
        self.result, self.steps, self.peak_blocks = ModeResult(engine.config.kv_backend), 0, 0
        self.preemptions, self.kv_stats = (
            engine.core.scheduler.num_preemptions,
            engine.runner.kv.stats(),
        )
        self.last = time.perf_counter()

    def __call__(self, finals_only: bool = False) -> Any:
        if self.idle:
            self.restart()
        outputs = self.step(finals_only)
        blocks = self.engine.block_manager
        self.peak_blocks = max(self.peak_blocks, blocks.num_blocks - blocks.num_free_blocks)
        if self.steps % self.every == 0:
            taken = sample(self.engine)
            account(self.result, taken, taken.time - self.last)
            self.last = taken.time
            self.result.sample_seconds += time.perf_counter() - taken.time
        self.steps += 1
        self.idle = not self.engine.has_unfinished_requests()
        return outputs

    def detach(self) -> None:
        del self.engine.step


def allocation(
    before: dict[str, float], after: dict[str, float], num_layers: int
) -> dict[str, float] | None:
    """The vattention map/unmap counts and latency between two ``kv.stats()``; None for a backend with none."""
    if not after:
        return None
    delta = {
        key: after[key] - before[key] for key in ("maps", "unmaps", "map_seconds", "unmap_seconds")
    }
    calls = 2 * num_layers  # driver calls of one page group: K and V of every layer
    for op in ("map", "unmap"):
        count = delta[f"{op}s"]
        delta[f"{op}_us"] = 1e6 * delta[f"{op}_seconds"] / count if count else None
        delta[f"{op}_call_us"] = delta[f"{op}_us"] / calls if count else None
    return delta


def memory(engine: LLMEngine, result: ModeResult) -> dict[str, float]:
    """Time-averaged reserved and used KV bytes, from the sampled slot-seconds."""
    args, kv, block_size = engine.runner.model.args, engine.runner.kv, engine.config.block_size
    # one token, one layer
    token_bytes = args.num_kv_heads * args.head_dim * engine.config.torch_dtype.itemsize
    used = result.used_slot_s / result.sampled_s * token_bytes * 2 * args.num_layers
    reserved = result.reserved_slot_s / result.sampled_s / block_size * kv.bytes_per_block
    return {
        "token_bytes_per_layer": token_bytes,
        "mean_used_gib": used / GIB,
        "mean_reserved_gib": reserved / GIB,
        "useful": used / reserved if reserved else 0.0,
    }


def nano_row(engine: LLMEngine, run: Run, sampler: KVSampler) -> dict[str, Any]:
    config, kv, result = engine.config, engine.runner.kv, sampler.result
    return {
        "model": config.model_config,
        "backend": config.kv_backend,
        "error": None,
        "block_size": config.block_size,
        "bytes_per_block": kv.bytes_per_block,
        "page_bytes": getattr(kv, "page_bytes", None),
        "num_blocks": engine.core.block_manager.num_blocks,
        "start_seconds": run.start_seconds,
        "warmup_seconds": run.warmup_seconds,
        "seconds": run.seconds,
        "output_tokens": run.output_tokens,
        "tok_s": run.tok_s,
        "steps": run.steps,
        **memory(engine, result),
        "peak_blocks": sampler.peak_blocks,
        "mean_running": result.mean_running,
        "max_running": result.max_running,
        "samples": result.samples,
        "sample_seconds": result.sample_seconds,
        "preemptions": engine.core.scheduler.num_preemptions - sampler.preemptions,
        "allocation": allocation(sampler.kv_stats, kv.stats(), engine.runner.model.args.num_layers),
    }


# nano: one engine per (model, backend) -------------------------------------------------------------------


def run_backend(
    args: argparse.Namespace, model: str, backend: str, requests: list[Request]
) -> dict[str, Any]:
    engine_args = argparse.Namespace(**vars(args), model_config=model)
    start = time.perf_counter()
    engine = build_engine(
        engine_args,
        kv_backend=backend,
        seed=args.seed,
        max_model_len=args.max_model_len,
        enforce_eager=args.enforce_eager,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    start_seconds = time.perf_counter() - start
    sampler = None
    try:
        run = run_ours(engine, requests, start_seconds)  # throughput: nothing else on the host
        engine.core.block_manager.reset_prefix_cache()
        sampler = KVSampler(engine, args.sample_every)  # memory: the same run again, sampled
        run_ours(engine, requests, start_seconds)
        return nano_row(engine, run, sampler)
    finally:
        if sampler is not None:
            sampler.detach()
        synchronize(engine.config.torch_device)
        # vattention's driver pages are not torch memory: collecting the engine frees none
        engine.runner.kv.free()


def run_nano(
    args: argparse.Namespace, requests: list[Request], device: torch.device, result: dict[str, Any]
) -> None:
    """Every (model, backend), one engine at a time; a failed run is reported in its row, the others go on."""
    for model in args.model_configs:
        for backend in args.backends:
            logger.info("nano: %s, %s", model, backend)
            try:
                row = run_backend(args, model, backend, requests)
            except Exception as err:  # one backend failing must not lose the other rows
                logger.exception("nano: %s, %s failed", model, backend)
                row = {"model": model, "backend": backend, "error": f"{type(err).__name__}: {err}"}
            release_memory(device)
            result["nano"].append(row)
            record.write_json(args.json, result)


def check_backends(args: argparse.Namespace) -> None:
    """EngineConfig's own ValueError (e.g. vattention without CUDA) before the first engine starts."""
    for backend in args.backends:
        EngineConfig(
            load_format="dummy",
            model_config=args.model_configs[0],
            device=args.device,
            dtype=args.dtype,
            kv_backend=backend,
        ).resolve()


# decode kernel -------------------------------------------------------------------------------------------


def contiguous_inputs(paged: dict[str, torch.Tensor], context: int) -> dict[str, torch.Tensor]:
    """The paged K/V, each sequence's ``context`` tokens in a slot of its own; slots drawn at random among
    2 x batch (the unused ones are never read)."""
    tables = paged["block_tables"].long()
    batch = tables.shape[0]
    slot_ids = torch.randperm(2 * batch, device=tables.device)[:batch]
    slots = {}
    for name in ("k", "v"):
        cache = paged[f"{name}_cache"]
        slots[name] = cache.new_empty(2 * batch, context, KV_HEADS, HEAD_DIM)
        slots[name][slot_ids] = cache[tables].view(batch, context, KV_HEADS, HEAD_DIM)
    return {
        "query": paged["query"],
        "k_slots": slots["k"],
        "v_slots": slots["v"],
        "slot_ids": slot_ids.to(torch.int32),
        "context_lens": paged["context_lens"],
    }


def run_contiguous_kernel(inputs: dict[str, torch.Tensor]) -> tuple[float, torch.Tensor]:
    out = torch.empty_like(inputs["query"])
    # host-known in the engine: read once, outside the timing
    max_context = int(inputs["context_lens"].max())

    def call() -> None:
        contiguous_decode_attention(
            out,
            inputs["query"],
            inputs["k_slots"],
            inputs["v_slots"],
            inputs["slot_ids"],
            inputs["context_lens"],
            HEAD_DIM**-0.5,
            max_context,
        )

    return bench(call), out


class DriverPages:
    """Copies of tensors in memory the way the vattention backend holds it: one 2 MiB driver handle per page,
    each mapped on its own (a TLB entry per page, where torch's allocator may map a large tensor with larger
    pages)."""

    def __init__(self) -> None:
        from engine.kv_backend.cuda_vmm import CudaDriver

        self.driver = CudaDriver(torch.device("cuda", torch.cuda.current_device()))
        self._mapped: list[tuple[int, int, list]] = []

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        page = self.driver.granularity
        size = -(-tensor.nbytes // page) * page
        base = self.driver.reserve(size)
        handles = [self.driver.create(page) for _ in range(size // page)]
        for i, handle in enumerate(handles):
            self.driver.map(base + i * page, page, handle, 0)
        self._mapped.append((base, size, handles))
        out = self.driver.tensor(base, tuple(tensor.shape), tensor.dtype)
        out.copy_(tensor)
        return out

    def free(self) -> None:
        torch.cuda.synchronize()
        page = self.driver.granularity
        for base, size, handles in self._mapped:
            for i, handle in enumerate(handles):
                self.driver.unmap(base + i * page, page)
                self.driver.release(handle)
            self.driver.free_address(base, size)
        self._mapped.clear()


def kernel_row(batch: int, context: int) -> dict[str, Any]:
    paged = paged_inputs(batch, context, PAGED_KERNEL_BLOCK)
    contiguous = contiguous_inputs(paged, context)
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * DTYPE.itemsize
    paged_ms, paged_out = run_paged_kernel(paged)
    contiguous_ms, contiguous_out = run_contiguous_kernel(contiguous)
    pages = DriverPages()
    try:
        on_pages = {
            **contiguous,
            "k_slots": pages.copy(contiguous["k_slots"]),
            "v_slots": pages.copy(contiguous["v_slots"]),
        }
        driver_ms, driver_out = run_contiguous_kernel(on_pages)
    finally:
        pages.free()
    # the same K/V and queries: the two layouts must give the same attention
    rel_diff = float((contiguous_out.float() - paged_out.float()).norm() / paged_out.float().norm())
    assert torch.equal(driver_out, contiguous_out)
    return {
        "batch": batch,
        "context": context,
        "kv_gb": kv_bytes / 1e9,
        "paged_block_size": PAGED_KERNEL_BLOCK,
        "paged_ms": paged_ms,
        "paged_gbps": kv_bytes / paged_ms / 1e6,
        "contiguous_ms": contiguous_ms,
        "contiguous_gbps": kv_bytes / contiguous_ms / 1e6,
        "driver_pages_ms": driver_ms,
        "driver_pages_gbps": kv_bytes / driver_ms / 1e6,
        "rel_diff": rel_diff,
    }


def run_kernels(args: argparse.Namespace, result: dict[str, Any]) -> None:
    for batch, context in SHAPES:
        logger.info("decode kernel: %d x %d", batch, context)
        result["kernel"].append(kernel_row(batch, context))
        torch.cuda.empty_cache()
        record.write_json(args.json, result)


# report --------------------------------------------------------------------------------------------------


def nano_table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| model | backend | block (tokens) | start s | out tok/s | useful KV % | used / reserved GiB | "
        "peak blocks (pool) | mean running | preemptions |"
    )
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["error"]:
            lines.append(
                f"| {r['model']} | {r['backend']} | failed: {r['error'][:100]} |" + " - |" * 7
            )
            continue
        lines.append(
            f"| {r['model']} | {r['backend']} | {r['block_size']} | {r['start_seconds']:.1f} | "
            f"{r['tok_s']:.0f} | {r['useful']:.1%} | {r['mean_used_gib']:.2f} / {r['mean_reserved_gib']:.2f} | "
            f"{r['peak_blocks']} ({r['num_blocks']}) | {r['mean_running']:.1f} | {r['preemptions']} |"
        )
    return "\n".join(lines)


def allocation_table(rows: list[dict[str, Any]]) -> str:
    def us(value: float | None) -> str:
        return f"{value:.1f}" if value is not None else "-"

    head = (
        "| model | backend | page-group maps | unmaps | us / group map | us / group unmap | us / driver map | "
        "us / driver unmap |"
    )
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if a := r.get("allocation"):
            lines.append(
                f"| {r['model']} | {r['backend']} | {a['maps']} | {a['unmaps']} | {us(a['map_us'])} | "
                f"{us(a['unmap_us'])} | {us(a['map_call_us'])} | {us(a['unmap_call_us'])} |"
            )
    return "\n".join(lines) if len(lines) > 2 else ""


def kernel_table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| batch x context | K+V GB | paged ms | paged GB/s | contiguous ms | contiguous GB/s | contiguous / paged "
        "| on 2 MiB driver pages GB/s | rel diff |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [
        f"| {r['batch']}x{r['context']} | {r['kv_gb']:.2f} | {r['paged_ms']:.3f} | {r['paged_gbps']:.0f} | "
        f"{r['contiguous_ms']:.3f} | {r['contiguous_gbps']:.0f} | {r['contiguous_gbps'] / r['paged_gbps']:.2f} | "
        f"{r.get('driver_pages_gbps', float('nan')):.0f} | {r['rel_diff']:.1e} |"
        for r in rows
    ]
    return "\n".join(lines)


def print_report(result: dict[str, Any]) -> None:
    env, workload = result["environment"], result["workload"]
    print(
        f"\n## kv backends: nano, {workload['num_requests']} requests, dummy weights, max_model_len "
        f"{workload['max_model_len']}; {env['device']}"
    )
    print(record.environment_line(env) + "\n")
    print(nano_table(result["nano"]))
    if table := allocation_table(result["nano"]):
        print(
            "\nvattention allocation over the timed run (a page group: one KV block into one request slot)\n"
        )
        print(table)
    if result["kernel"]:
        print(
            f"\n## decode kernel: paged (block {PAGED_KERNEL_BLOCK}, permuted) vs contiguous slots (permuted "
            "among 2 x batch); 32 q / 8 KV heads, head 128, bf16\n"
        )
        print(kernel_table(result["kernel"]))


# main ----------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model-configs", nargs="+", default=list(MODELS), choices=sorted(DUMMY_ARCHITECTURES)
    )
    parser.add_argument("--backends", nargs="+", default=list(KV_BACKENDS), choices=KV_BACKENDS)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument(
        "--sample-every", type=int, default=4, help="sample the KV memory every k steps"
    )
    parser.add_argument(
        "--kernel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also the decode-kernel shapes, paged vs contiguous (CUDA)",
    )
    parser.add_argument(
        "--json", metavar="PATH", help="also write the numbers here (input of kv_backends_chart)"
    )
    engine = parser.add_argument_group("engine")
    engine.add_argument("--device", default="auto", help="auto | cuda | cpu (paged only)")
    engine.add_argument("--dtype", default="auto", help="auto = bfloat16 on GPU, float32 on CPU")
    engine.add_argument("--seed", type=int, default=0, help="workload and dummy weights")
    engine.add_argument("--enforce-eager", action="store_true")
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    smoke = parser.add_argument_group("smoke tests only")
    smoke.add_argument(
        "--max-prompt-len", type=int, help="clip the prompt lengths (the draws stay the same)"
    )
    smoke.add_argument("--max-output-len", type=int, help="clip the output lengths")
    args = parser.parse_args(argv)
    if min(args.num_requests, args.sample_every) < 1:
        parser.error("--num-requests and --sample-every must be >= 1")
    if args.kernel and (args.device == "cpu" or not torch.cuda.is_available()):
        parser.error("--kernel needs a CUDA device (pass --no-kernel)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    check_backends(args)
    load_before = record.load_average()
    requests = nano_workload(
        args.num_requests, args.seed, capped(args.max_prompt_len), capped(args.max_output_len)
    )
    workload = {
        "num_requests": args.num_requests,
        "seed": args.seed,
        "max_model_len": args.max_model_len,
        "sample_every": args.sample_every,
        "prompt_tokens": sum(len(r.prompt) for r in requests),
        "output_tokens": sum(r.output_len for r in requests),
    }
    result: dict[str, Any] = {"workload": workload, "nano": [], "kernel": []}
    device = resolve_device(args.device)
    result["environment"] = record.environment(__spec__.name, device, load_before)
    run_nano(args, requests, device, result)
    if args.kernel:
        run_kernels(args, result)
    result["environment"] = record.environment(__spec__.name, device, load_before)
    record.write_json(args.json, result)
    print_report(result)


if __name__ == "__main__":
    main()
