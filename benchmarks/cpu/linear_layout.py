"""Why the engine keeps linear weights column-major on the CPU: the same matmul, three memory layouts.

40 distinct [3072, 576] float32 weights (280 MB, far beyond L3, as in a real decode step) applied to an
input of M rows (M = sequences decoding together). Effective bandwidth = weight bytes / time.

    python -m benchmarks.cpu.linear_layout [--threads 2] [--rows 1 8 32]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.harness import record

NUM_WEIGHTS, OUT_FEATURES, IN_FEATURES = 40, 3072, 576


def timed(fn: Callable[[torch.Tensor, int], torch.Tensor], rows: int, repeats: int = 5) -> float:
    x = torch.randn(rows, IN_FEATURES)
    for i in range(4):
        fn(x, i)
    start = time.perf_counter()
    for _ in range(repeats):
        for i in range(NUM_WEIGHTS):
            fn(x, i)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = record.load_average()
    row_major = [torch.randn(OUT_FEATURES, IN_FEATURES) for _ in range(NUM_WEIGHTS)]
    # same [out, in] values, [in, out] memory
    column_major = [w.t().contiguous().t() for w in row_major]
    layouts = {
        "row-major (nn.Linear default)": lambda x, i: F.linear(x, row_major[i]),
        "column-major (ours on CPU)": lambda x, i: F.linear(x, column_major[i]),
    }
    weight_bytes = NUM_WEIGHTS * OUT_FEATURES * IN_FEATURES * 4
    print(f"| layout | {' | '.join(f'M={m} GB/s' for m in args.rows)} |")
    print(f"|---|{'---:|' * len(args.rows)}")
    for name, fn in layouts.items():
        rates = [weight_bytes / timed(fn, m) / 1e9 for m in args.rows]
        print(f"| {name} | {' | '.join(f'{r:.1f}' for r in rates)} |")
    env = record.environment(__spec__.name, "cpu", load_before=load_before, threads=args.threads)
    print(f"\n{args.threads} threads; {record.environment_line(env)}")


if __name__ == "__main__":
    main()
