"""The tensor-parallel all-reduce, NCCL against the symmetric-memory sums (engine/distributed/peer_memory.py's
``PeerAllReduce``: our Triton kernel's one-barrier one shot (the engine's, from 1 to 8 MiB), two shot and
two-barrier one shot, kernels/all_reduce.py, and PyTorch's own two-shot and one-shot ops), at the sizes a decode
or prefill step adds: ``rows`` x ``--hidden`` values of ``--dtype``. The one-barrier sums go round the three
exchanges call after call, so a graph's replays may follow each other only where ``--calls`` is not 1 more
than a multiple of 3 (a replay must not start on the exchange the last one ended on).

N processes (one per GPU, cuda:0 .. N-1) join one group through ``parallel_state.init_tensor_parallel``. For each
size and path, ``--calls`` all-reduces of distinct random inputs are captured in one CUDA graph (as the engine's
decode graphs hold them) and the graph is replayed ``--repeats`` times, timed with CUDA events on rank 0: the
median replay over ``--calls`` is one all-reduce's time. Before timing, the symmetric-memory results are checked
against NCCL's on the same inputs, then again after new inputs are copied in and the graph replayed (a stale
or raced read of the shared buffer would differ).

    python -m benchmarks.kernel.all_reduce [--ranks 2] [--hidden 4096] [--rows 1 8 32 ... 4096] [--json PATH]

Columns: rows, MiB (the message), NCCL us, then us for each ``PeerAllReduce`` method (with its copy in; blank
above the peer buffer's size) and the best method's time over NCCL's. Every method is measured at every size up to
the buffer, also where the engine uses NCCL.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.harness.record import environment, environment_line, require_cuda, write_json
from engine.distributed import parallel_state, peer_memory

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def captured(
    fn: Any, inputs: list[torch.Tensor]
) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor]]:
    """One graph of ``fn`` over every input (after one eager warm-up call each); the outputs it writes."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for x in inputs:
            fn(x.clone())
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = [fn(x) for x in inputs]
    return graph, outputs


def nccl(x: torch.Tensor) -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(out)
    return out


def replay_us(graph: torch.cuda.CUDAGraph, calls: int, repeats: int) -> float:
    """Median replay time over ``calls``, in microseconds."""
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def fill(inputs: list[torch.Tensor], seed: int) -> None:
    generator = torch.Generator(device=inputs[0].device).manual_seed(seed)
    for x in inputs:
        x.copy_(torch.randn(x.shape, generator=generator, device=x.device, dtype=torch.float32))


def measure(rank: int, args: argparse.Namespace, rows: int) -> dict[str, Any]:
    device = torch.device("cuda", rank)
    dtype = DTYPES[args.dtype]
    inputs = [torch.empty(rows, args.hidden, dtype=dtype, device=device) for _ in range(args.calls)]
    fill(inputs, seed=1000 * rank + rows)
    nccl_graph, nccl_out = captured(nccl, inputs)
    result: dict[str, Any] = {
        "rows": rows,
        "mib": inputs[0].nbytes / 2**20,
        "nccl_us": replay_us(nccl_graph, args.calls, args.repeats),
    }
    peer = parallel_state.peer_all_reduce()
    if peer is not None and inputs[0].nbytes <= peer.max_bytes:
        mismatches = 0
        for method in peer_memory.PEER_METHODS:
            graph, outputs = captured(lambda x, method=method: peer.sum(x, method), inputs)
            for seed in (1, 2):  # the second round: new inputs through the same captured graphs
                fill(inputs, seed=seed * 7919 + 1000 * rank + rows)
                nccl_graph.replay()
                graph.replay()
                torch.cuda.synchronize()
                mismatches += sum(int(not torch.equal(a, b)) for a, b in zip(nccl_out, outputs))
            result[f"{method}_us"] = replay_us(graph, args.calls, args.repeats)
            del graph
        result["mismatches"] = mismatches
    del nccl_graph
    return result


def run_rank(rank: int, args: argparse.Namespace, rendezvous: str) -> None:
    device = torch.device("cuda", rank)
    parallel_state.init_tensor_parallel(rank, args.ranks, device, rendezvous, all_reduce="auto")
    peer = parallel_state.peer_all_reduce()
    if args.programs and peer is not None:
        channels = 2 + peer_memory.EXCHANGES
        if channels * args.programs * args.ranks > peer.pad.numel():
            raise SystemExit(
                f"--programs: at most {peer.pad.numel() // (channels * args.ranks)} (the signal pad's slots)"
            )
        peer.programs = args.programs
    results = [measure(rank, args, rows) for rows in args.rows]
    mismatches = torch.tensor([sum(r.get("mismatches", 0) for r in results)], device=device)
    dist.all_reduce(mismatches)
    if rank == 0:
        report = {
            "environment": environment(
                __spec__.name,
                device,
                ranks=args.ranks,
                peer_buffer_mib=peer_memory.PEER_ALL_REDUCE_BYTES / 2**20,
                symmetric_memory=parallel_state.peer_all_reduce_active(),
                programs=peer.programs if peer is not None else None,
            ),
            "dtype": args.dtype,
            "hidden": args.hidden,
            "mismatches_all_ranks": int(mismatches.item()),
            "sizes": results,
        }
        print_report(report)
        write_json(args.json, report)
    dist.barrier()
    parallel_state.destroy_tensor_parallel()


def print_report(report: dict[str, Any]) -> None:
    env = report["environment"]
    print(
        f"## all-reduce: {env['ranks']} x {env['device']}, {report['dtype']} x {report['hidden']}"
    )
    print(environment_line(env))
    print(
        f"symmetric memory active: {env['symmetric_memory']} (our kernel's programs: {env['programs']}); "
        f"results differing from NCCL's on any rank: {report['mismatches_all_ranks']}\n"
    )
    methods = peer_memory.PEER_METHODS
    print("| rows | MiB | NCCL us | " + " | ".join(f"{m} us" for m in methods) + " | best / NCCL |")
    print("|---:" * (len(methods) + 4) + "|")
    for r in report["sizes"]:
        times = [r.get(f"{m}_us") for m in methods]
        cells = [f"{t:.1f}" if t else "-" for t in times]
        best = min((t for t in times if t), default=None)
        ratio = f"{best / r['nccl_us']:.2f}" if best else "-"
        print(
            f"| {r['rows']} | {r['mib']:.3f} | {r['nccl_us']:.1f} | {' | '.join(cells)} | {ratio} |",
            flush=True,
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument(
        "--rows", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    )
    parser.add_argument("--calls", type=int, default=20, help="all-reduces in one captured graph")
    parser.add_argument("--repeats", type=int, default=20, help="timed replays")
    parser.add_argument(
        "--programs",
        type=int,
        help="our kernel's programs per rank (default: one per SM, as "
        "many as the signal pad holds)",
    )
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    require_cuda(__spec__.name, args.ranks)
    if min(args.ranks, args.hidden, args.calls, args.repeats, *args.rows) < 1 or args.ranks < 2:
        parser.error("--ranks must be >= 2; --hidden, --rows, --calls and --repeats >= 1")
    if args.calls % peer_memory.EXCHANGES == 1:
        parser.error(
            f"--calls: not 1 more than a multiple of {peer_memory.EXCHANGES} (the docstring says why)"
        )
    os.environ.update(parallel_state.NCCL_SAFETY_ENV)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(run_rank, args=(args, f"file://{tmp}/rendezvous"), nprocs=args.ranks)


if __name__ == "__main__":
    main()
