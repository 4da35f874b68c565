"""Does a persistent kernel stream a decode step's weights faster than one launch per matmul? (issue 26)

The experiment behind the "persistent decode kernel" lever of docs/KERNELS_NOTES.md. The weight-bound part of a
small-batch decode step of llama-3.2-1b is a chain of skinny matmuls, four a layer: qkv -> o -> gate/up + SiLU ->
down. The engine launches each one (kernels/skinny_gemm.py, under PDL, in a CUDA graph). This script times the
same chain two ways, on the same random weights (never zeros), both replayed from a CUDA graph:

- ``launches``: the engine's kernels, one launch per matmul (64 for 16 layers).
- ``persistent``: ONE launch for the whole chain (``_chain_kernel`` below), one program per SM, all resident.
  - A phase is one matmul. Its tasks (column block, K split) go round-robin over the programs. Split-K merges as
    the skinny kernel does: the last split of a column block to finish adds the fp32 partials in split order and
    writes the rounded block, so the next phase reads one tile a step.
  - Phases are separated by a grid-wide barrier: an arrival counter and a spin on it.
  - Before a program arrives at a barrier it asks L2 for the first ``prefetch_k`` elements of the weight rows of
    its next task (weights never depend on activations), so HBM keeps streaming while the barrier waits.
  - Also timed: the barriers alone (``WORK`` off), their share of the chain.

Left out, as the launches baseline leaves them out: attention (the o projection reads the q columns of the qkv
output in its place), the norms and the residual adds. It measures the weight stream only: whether one launch with
barriers beats one launch per matmul, and by how much.

    python -m benchmarks.kernel.persistent_chain [--layers 16] [--rows 1 16] [--prefetch-k 0 256] [--splits 2,4,1,4]
                                          [--block-k 128] [--warps 4] [--stages 5] [--programs-per-sm 1]
                                          [--json PATH]

Each list option is a sweep (every combination is a variant). Prints, per M and variant, the median time of a
graph replay of the chain (CUDA events, 30 replays), the weights' bytes over it in TB/s, and that as a fraction of
a 1 GiB read (a sum) measured in the same run. Each variant is first checked against ``reference_chain`` (relative
error < 2e-2); results in docs/benchmarks/chat-latency.md (eighth session).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from benchmarks.harness import record
from kernels.paged_attention import dot_precision
from kernels.persistent_decode import PersistentConfig, grid_barrier, matmul_task, prefetch_task
from kernels.skinny_gemm import store_out

# llama-3.2-1b: hidden, q width (heads x head dim), qkv width, MLP intermediate
HIDDEN, Q_WIDTH, QKV_WIDTH, INTERMEDIATE = 2048, 2048, 3072, 8192


@triton.jit
def _phase(
    x_ptr,
    stride_x,
    w_ptr,
    part_ptr,
    counter_ptr,
    out_ptr,
    M,
    n_cols,
    K,
    pid,
    programs,
    SPLITS: tl.constexpr,
    GATE_UP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Tasks (column block, split) ``pid, pid + programs, ...`` of ``out = x @ w.T`` (with GATE_UP
    ``silu(x @ Wg.T) * (x @ Wu.T)``, gate rows first in ``w``), out ``[M, n_cols]`` in the weights' dtype: the
    persistent decode kernel's own task (``matmul_task``: split-K merged by the last split of a column block),
    whose writer stores the block."""
    rows = tl.arange(0, BLOCK_M)
    for task in range(pid, (n_cols // BLOCK_N) * SPLITS, programs):
        block = task // SPLITS
        gate, up, writer = matmul_task(x_ptr, stride_x, w_ptr, K, n_cols, block, task % SPLITS, M,
                                    part_ptr, counter_ptr, SPLITS, GATE_UP, BLOCK_M, BLOCK_N,
                                    BLOCK_K, DOT_PRECISION)  # fmt: skip
        if writer:
            cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
            store_out(out_ptr, gate, up, rows, cols, M, n_cols, n_cols, GATE_UP)


@triton.jit
def _chain_kernel(
    wqkv_ptr,
    wo_ptr,
    wgu_ptr,
    wd_ptr,
    part_ptr,
    counter_ptr,
    h_ptr,
    qkv_ptr,
    o_ptr,
    act_ptr,
    M,
    layers,
    S_QKV: tl.constexpr,
    S_O: tl.constexpr,
    S_GU: tl.constexpr,
    S_D: tl.constexpr,
    H: tl.constexpr,
    Q_N: tl.constexpr,
    QKV_N: tl.constexpr,
    I: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREFETCH_K: tl.constexpr,
    LINE: tl.constexpr,
    WORK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``layers`` x (qkv, o, gate/up + SiLU, down), from ``h`` ``[M, H]`` back into it. Counters: [0] the
    barrier's arrivals, [1] exits (the last program out re-arms both), then one per column block of each
    phase. ``part``: fp32 split-K partials, shared by the phases (a barrier lies between two uses). Without
    WORK only the barriers run (their cost)."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    qkv_counters = counter_ptr + 2
    o_counters = qkv_counters + QKV_N // BLOCK_N
    gu_counters = o_counters + H // BLOCK_N
    d_counters = gu_counters + I // BLOCK_N
    arrived = pid * 0
    for layer in range(layers):
        wqkv = wqkv_ptr + layer * QKV_N * H
        wo = wo_ptr + layer * H * Q_N
        wgu = wgu_ptr + layer * 2 * I * H
        wd = wd_ptr + layer * H * I
        if WORK:
            _phase(h_ptr, H, wqkv, part_ptr, qkv_counters, qkv_ptr, M, QKV_N, H, pid, programs,
                   S_QKV, False, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)  # fmt: skip
        prefetch_task(wo, Q_N, H, pid, S_O, False, BLOCK_N, PREFETCH_K, LINE, True)
        arrived += programs
        grid_barrier(counter_ptr, arrived)
        # (attention left out: o reads the q columns)
        if WORK:
            _phase(qkv_ptr, QKV_N, wo, part_ptr, o_counters, o_ptr, M, H, Q_N, pid, programs,
                   S_O, False, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)  # fmt: skip
        prefetch_task(wgu, H, I, pid, S_GU, True, BLOCK_N, PREFETCH_K, LINE, True)
        arrived += programs
        grid_barrier(counter_ptr, arrived)
        if WORK:
            _phase(o_ptr, H, wgu, part_ptr, gu_counters, act_ptr, M, I, H, pid, programs,
                   S_GU, True, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)  # fmt: skip
        prefetch_task(wd, I, H, pid, S_D, False, BLOCK_N, PREFETCH_K, LINE, True)
        arrived += programs
        grid_barrier(counter_ptr, arrived)
        if WORK:
            _phase(act_ptr, I, wd, part_ptr, d_counters, h_ptr, M, H, I, pid, programs,
                   S_D, False, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)  # fmt: skip
        if layer + 1 < layers:
            prefetch_task(
                wqkv + QKV_N * H, H, QKV_N, pid, S_QKV, False, BLOCK_N, PREFETCH_K, LINE, True
            )
        arrived += programs
        grid_barrier(counter_ptr, arrived)
    if tl.atomic_add(counter_ptr + 1, 1, sem="acq_rel", scope="gpu") == programs - 1:
        tl.store(counter_ptr, 0)
        tl.store(counter_ptr + 1, 0)


@dataclass(slots=True)
class Chain:
    """Stacked weights of the chain's decoder layers (nn.Linear's layout)."""

    wqkv: torch.Tensor  # [layers, qkv width, hidden]
    wo: torch.Tensor  # [layers, hidden, q width]
    wgu: torch.Tensor  # [layers, 2 x intermediate, hidden], gate rows first
    wd: torch.Tensor  # [layers, hidden, intermediate]

    @property
    def layers(self) -> int:
        return self.wqkv.shape[0]

    @property
    def hidden(self) -> int:
        return self.wqkv.shape[2]

    @property
    def q_width(self) -> int:
        return self.wo.shape[2]

    @property
    def qkv_width(self) -> int:
        return self.wqkv.shape[1]

    @property
    def intermediate(self) -> int:
        return self.wd.shape[2]

    @property
    def weight_bytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in (self.wqkv, self.wo, self.wgu, self.wd))

    @classmethod
    def random(
        cls,
        layers: int,
        device: torch.device,
        dims: tuple[int, int, int, int] = (HIDDEN, Q_WIDTH, QKV_WIDTH, INTERMEDIATE),
        dtype: torch.dtype = torch.bfloat16,
        seed: int = 0,
    ) -> Chain:
        """Random weights (std 1/sqrt(K): activations keep their scale down the chain); ``dims``: hidden,
        q width, qkv width, intermediate."""
        hidden, q_width, qkv_width, intermediate = dims
        if q_width > qkv_width:
            raise ValueError(f"dims: q width {q_width} exceeds the qkv width {qkv_width}")
        gen = torch.Generator(device=device).manual_seed(seed)

        def weight(n: int, k: int) -> torch.Tensor:
            return (torch.randn(layers, n, k, generator=gen, device=device) / k**0.5).to(dtype)

        return cls(
            weight(qkv_width, hidden),
            weight(hidden, q_width),
            weight(2 * intermediate, hidden),
            weight(hidden, intermediate),
        )


def _check_config(chain: Chain, config: PersistentConfig) -> None:
    """Every phase's K must split into whole tiles and its columns into whole blocks."""
    phases = {
        "qkv_splits": (config.qkv_splits, chain.hidden, chain.qkv_width),
        "o_splits": (config.o_splits, chain.q_width, chain.hidden),
        "gate_up_splits": (config.gate_up_splits, chain.hidden, chain.intermediate),
        "down_splits": (config.down_splits, chain.intermediate, chain.hidden),
    }
    for name, (splits, k, n) in phases.items():
        if splits < 1 or k % (splits * config.block_k) or n % config.block_n:
            raise ValueError(
                f"PersistentConfig.{name}: {splits} splits of K {k} into tiles of {config.block_k}, "
                f"{n} columns into blocks of {config.block_n}: not whole"
            )


class PersistentChain:
    """The persistent kernel's buffers for one chain and row count; ``run(x)`` launches it once."""

    def __init__(
        self, chain: Chain, rows: int, config: PersistentConfig, work: bool = True
    ) -> None:
        """``config``: the persistent decode kernel's launch parameters (its attention fields unused); without
        ``work`` only the barriers run."""
        _check_config(chain, config)
        if chain.layers * 2 * chain.intermediate * chain.hidden >= 2**31:
            raise ValueError(
                "Chain: a stacked weight past 2**31 elements (the kernel's offsets are int32)"
            )
        if not 1 <= rows <= 16:
            raise ValueError(f"rows: 1..16, not {rows}")
        self.chain, self.rows, self.config, self.work = chain, rows, config, work
        device, dtype = chain.wqkv.device, chain.wqkv.dtype
        widths = (chain.qkv_width, chain.hidden, 2 * chain.intermediate, chain.hidden)
        splits = (config.qkv_splits, config.o_splits, config.gate_up_splits, config.down_splits)
        self.part = torch.empty(max(s * w for s, w in zip(splits, widths)) * rows, dtype=torch.float32,
                                device=device)  # fmt: skip
        blocks = (chain.qkv_width + 2 * chain.hidden + chain.intermediate) // config.block_n
        self.counter = torch.zeros(2 + blocks, dtype=torch.int32, device=device)
        self.h = torch.empty(rows, chain.hidden, dtype=dtype, device=device)
        self.qkv = torch.empty(rows, chain.qkv_width, dtype=dtype, device=device)
        self.o = torch.empty(rows, chain.hidden, dtype=dtype, device=device)
        self.act = torch.empty(rows, chain.intermediate, dtype=dtype, device=device)
        sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else 1
        )
        self.programs = config.programs or sms

    def load(self, x: torch.Tensor) -> None:
        """The chain's input ``[rows, hidden]``."""
        self.h.copy_(x)

    def run(self) -> None:
        c, config = self.chain, self.config
        _chain_kernel[(self.programs,)](
            c.wqkv, c.wo, c.wgu, c.wd, self.part, self.counter, self.h, self.qkv, self.o, self.act,
            self.rows, c.layers,
            config.qkv_splits, config.o_splits, config.gate_up_splits, config.down_splits,
            H=c.hidden, Q_N=c.q_width, QKV_N=c.qkv_width, I=c.intermediate,
            BLOCK_M=16, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            PREFETCH_K=config.prefetch_k if c.wqkv.is_cuda else 0, LINE=64, WORK=self.work,
            DOT_PRECISION=dot_precision(c.wqkv.dtype),
            num_warps=config.num_warps, num_stages=config.num_stages,
        )  # fmt: skip

    def output(self) -> torch.Tensor:
        return self.h.clone()


def reference_chain(chain: Chain, x: torch.Tensor) -> torch.Tensor:
    """The chain in torch: fp32 products, the weights' dtype between matmuls, SiLU-and-mul rounded as the
    kernels round it."""
    dtype = chain.wd.dtype
    h = x.to(dtype)
    for layer in range(chain.layers):
        qkv = (h.float() @ chain.wqkv[layer].float().T).to(dtype)
        o = (qkv[:, : chain.q_width].float() @ chain.wo[layer].float().T).to(dtype)
        gu = (o.float() @ chain.wgu[layer].float().T).to(dtype).float()
        gate, up = gu[:, : chain.intermediate], gu[:, chain.intermediate :]
        act = (torch.nn.functional.silu(gate).to(dtype).float() * up).to(dtype)
        h = (act.float() @ chain.wd[layer].float().T).to(dtype)
    return h


def launch_chain(chain: Chain, x: torch.Tensor) -> torch.Tensor:
    """The engine's path: one skinny-matmul launch per projection (PDL on Hopper)."""
    from kernels.skinny_gemm import skinny_gemm, skinny_gemm_silu_and_mul

    h = x
    for layer in range(chain.layers):
        qkv = skinny_gemm(h, chain.wqkv[layer])
        o = skinny_gemm(qkv[:, : chain.q_width], chain.wo[layer])
        act = skinny_gemm_silu_and_mul(o, chain.wgu[layer])
        h = skinny_gemm(act, chain.wd[layer])
    return h


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def graph_ms(fn, repeats: int) -> tuple[float, object]:
    """Median ms of a CUDA-graph replay of ``fn`` (CUDA events, warm replays first), and the graph's output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), out


def _memory_tb_s(device: torch.device) -> tuple[float, float]:
    """The anchors, TB/s over 1 GiB: a device-to-device copy (bytes read + written) and a read (a sum)."""
    src = torch.randn(2**28, device=device)
    dst, total = torch.empty_like(src), torch.empty((), device=device)
    copy_ms, _ = graph_ms(lambda: dst.copy_(src), 20)
    read_ms, _ = graph_ms(lambda: torch.sum(src, dim=0, out=total), 20)
    return 2 * src.numel() * 4 / copy_ms / 1e9, src.numel() * 4 / read_ms / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prefetch-k", type=int, nargs="+", default=[0, 256])
    parser.add_argument("--splits", nargs="+", default=["2,4,1,4"],
                        help="qkv,o,gate_up,down split-K of the persistent kernel (each a variant)")  # fmt: skip
    parser.add_argument("--block-n", type=int, nargs="+", default=[64],
                        help="weight rows per task (the persistent kernel's qkv block is a head: 64 there)")  # fmt: skip
    parser.add_argument("--block-k", type=int, nargs="+", default=[128])
    parser.add_argument("--programs-per-sm", type=int, nargs="+", default=[1],
                        help="more than 1 only where that many programs fit an SM (else the barrier hangs)")  # fmt: skip
    parser.add_argument("--warps", type=int, nargs="+", default=[4])
    parser.add_argument("--stages", type=int, nargs="+", default=[5])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", help="write every row here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("persistent_chain: needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    chain = Chain.random(args.layers, device)
    copy, read = _memory_tb_s(device)
    gb = chain.weight_bytes / 1e9
    print(f"# {torch.cuda.get_device_name(device)}, {args.layers} layers, {gb:.3f} GB of weights, "
          f"copy {copy:.2f} TB/s, read {read:.2f} TB/s")  # fmt: skip
    print(
        "| M | variant | ms | weights TB/s | of read | rel. error |\n|---|---|---:|---:|---:|---:|"
    )
    rows_out = []
    for m in args.rows:
        x = torch.randn(m, HIDDEN, device=device).to(torch.bfloat16)
        want = reference_chain(chain, x)
        variants = {"launches": (lambda: launch_chain(chain, x), lambda: launch_chain(chain, x))}
        for splits, pf, block_n, block_k, warps, stages, per_sm in itertools.product(
            args.splits,
            args.prefetch_k,
            args.block_n,
            args.block_k,
            args.warps,
            args.stages,
            args.programs_per_sm,
        ):
            config = PersistentConfig(
                *(int(v) for v in splits.split(",")),
                block_n=block_n,
                block_k=block_k,
                num_warps=warps,
                num_stages=stages,
                prefetch_k=pf,
                programs=per_sm * torch.cuda.get_device_properties(device).multi_processor_count,
            )
            name = (
                f"persistent splits={splits} prefetch_k={pf} block_n={block_n} block_k={block_k} "
                f"warps={warps} stages={stages} programs/SM={per_sm}"
            )
            try:
                run = PersistentChain(chain, m, config)
            except ValueError as e:
                print(f"| {m} | {name} | - | - | - | {e} |")
                continue
            variants[name] = (run.run, lambda run=run: (run.load(x), run.run(), run.output())[2])
        bare = PersistentChain(chain, m, PersistentConfig(prefetch_k=0), work=False)
        variants[f"barriers alone ({4 * args.layers})"] = (bare.run, None)
        for name, (timed, checked) in variants.items():
            try:
                error = _relative_error(checked(), want) if checked else float("nan")
            except triton.runtime.errors.OutOfResources as e:
                print(f"| {m} | {name} | - | - | - | {e} |")
                continue
            if error > 2e-2:  # (NaN: not checked)
                print(f"| {m} | {name} | - | - | - | {error:.2e} (wrong) |")
                continue
            ms, _ = graph_ms(timed, args.repeats)
            row = dict(
                m=m, variant=name, ms=ms, tb_s=gb / ms, copy_tb_s=copy, read_tb_s=read, error=error
            )
            rows_out.append(row)
            print(
                f"| {m} | {name} | {ms:.4f} | {gb / ms:.2f} | {gb / ms / read:.0%} | {error:.1e} |"
            )
    env = record.environment(__spec__.name, device, layers=args.layers)
    print(f"# {record.environment_line(env)}")
    record.write_json(args.json, dict(environment=env, rows=rows_out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
