"""DRAM and L2 counters of one persistent decode launch (kernels/persistent_decode.py) per variant, from Nsight
Compute: whether the lines the kernel asks of L2 ahead of use (the gate/up rows while attention runs, the
attention tasks' K and V while qkv runs) are hits when they are read, or were evicted and read twice.

llama-3.2-1b's shapes as in benchmarks/kernel/persistent_decode.py (its stack, batch and rotary tables). For each
variant the parent runs ``ncu`` on a child of itself (``--child``), which launches the kernel twice: the first
compiles and warms, the second is the one counted (caches flushed before it, ncu's default). The table gives
the bytes read from DRAM, the read sectors L2 looked up and their hit rate.

    python -m benchmarks.kernel.persistent_l2 [--rows 1] [--sweep bubble_gate_up_k=0,1024 ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import csv
import io
import itertools
import json
import shutil
import subprocess
import sys
from dataclasses import replace

import torch

from benchmarks.harness import record
from benchmarks.kernel.persistent_decode import (
    BLOCK_SIZE,
    HEAD_DIM,
    HIDDEN,
    make_batch,
    make_stack,
    parse_sweep,
    rotary,
)
from kernels.persistent_decode import PersistentConfig, persistent_decode

# (metric, label); a metric the device's ncu does not know is left out (``available``)
METRICS = (
    ("gpu__time_duration.sum", "launch ns"),
    ("dram__bytes_read.sum", "DRAM read B"),
    ("dram__bytes_write.sum", "DRAM write B"),
    ("lts__t_sectors_op_read.sum", "L2 read sectors"),
    ("lts__t_sectors_op_read_lookup_hit.sum", "L2 read hits"),
    ("lts__t_sectors_op_read_lookup_miss.sum", "L2 read misses"),
)


def available(wanted: tuple[tuple[str, str], ...], query_output: str) -> list[tuple[str, str]]:
    """The metrics of ``wanted`` whose base name (before the roll-up suffix) ``ncu --query-metrics``
    lists."""
    known = {line.split()[0] for line in query_output.splitlines() if line.strip()}
    return [(metric, label) for metric, label in wanted if metric.rsplit(".", 1)[0] in known]


def parse_metrics(csv_text: str) -> dict[str, float]:
    """Metric name -> value from ``ncu --csv --print-units base`` (one profiled launch); values may carry
    thousands separators."""
    start = csv_text.find('"ID"')
    if start < 0:
        raise ValueError("ncu: no CSV table in its output")
    values = {}
    for row in csv.DictReader(io.StringIO(csv_text[start:])):
        text = row["Metric Value"].replace(",", "")
        try:
            values[row["Metric Name"]] = float(text)
        except ValueError:
            continue  # a metric ncu could not collect ("n/a")
    return values


def variants(items: list[str]) -> list[dict[str, int]]:
    """``FIELD=V1,V2`` items (any PersistentConfig field; benchmarks/kernel/persistent_decode.py's ``parse_sweep``):
    their cartesian product."""
    sweep = parse_sweep(items, own=())
    return [dict(zip(sweep, combo)) for combo in itertools.product(*sweep.values())]


def child(rows: int, context: int, table_tokens: int, fields: dict[str, int]) -> None:
    """Two launches of the kernel with ``fields`` set (ncu counts the second)."""
    device = torch.device("cuda")
    stack, _ = make_stack(device, rows * -(-context // BLOCK_SIZE) + 1)
    meta = make_batch(rows, context, table_tokens, device)
    cos, sin = rotary(device, table_tokens)
    h = torch.randn(rows, HIDDEN, device=device).to(torch.bfloat16)
    config = replace(PersistentConfig(), **fields)
    for _ in range(2):
        stream = h.clone()
        persistent_decode(stream, stack, meta["positions"], meta["slot_mapping"],
                          meta["block_tables"], meta["context_lens"], cos, sin, HEAD_DIM**-0.5,
                          config)  # fmt: skip
    torch.cuda.synchronize()


def profile(ncu: str, metrics: list[tuple[str, str]], args: argparse.Namespace, rows: int,
            fields: dict[str, int]) -> dict[str, float]:  # fmt: skip
    command = [
        ncu, "--csv", "--print-units", "base", "--kernel-name", "regex:_persistent_decode_kernel",
        "--launch-skip", "1", "--launch-count", "1",
        "--metrics", ",".join(metric for metric, _ in metrics),
        sys.executable, "-m", "benchmarks.kernel.persistent_l2", "--child", "--rows", str(rows),
        "--context", str(args.context), "--table-tokens", str(args.table_tokens),
        "--fields", json.dumps(fields),
    ]  # fmt: skip
    done = subprocess.run(
        command, check=False, capture_output=True, text=True, timeout=args.timeout
    )
    if done.returncode != 0:
        raise RuntimeError(f"ncu failed ({done.returncode}): {(done.stdout + done.stderr)[-2000:]}")
    return parse_metrics(done.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--context", type=int, default=700)
    parser.add_argument("--table-tokens", type=int, default=4096)
    parser.add_argument("--sweep", nargs="+", default=[], metavar="FIELD=V1,V2",
                        help="PersistentConfig fields to vary (integers), e.g. bubble_gate_up_k=0,1024")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for one ncu run")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fields", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.rows[0], args.context, args.table_tokens, json.loads(args.fields))
        return 0
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    if not torch.cuda.is_available() or not shutil.which(ncu):
        print("persistent_l2: needs a CUDA device and Nsight Compute (ncu)", file=sys.stderr)
        return 2
    query = subprocess.run(
        [ncu, "--query-metrics"], check=False, capture_output=True, text=True, timeout=120
    )
    metrics = available(METRICS, query.stdout) or list(
        METRICS
    )  # (a listing it cannot read: ask all)
    print(f"# {torch.cuda.get_device_name()}, llama-3.2-1b shapes, context {args.context}; metrics: "
          f"{', '.join(m for m, _ in metrics)}")  # fmt: skip
    print("| M | variant | " + " | ".join(label for _, label in metrics) + " | L2 read hit rate |")
    print("|---|---|" + "---:|" * (len(metrics) + 1))
    results = []
    for rows in args.rows:
        for fields in variants(args.sweep):
            values = profile(ncu, metrics, args, rows, fields)
            label = ", ".join(f"{k} {v}" for k, v in fields.items()) or "defaults"
            cells = [f"{values.get(metric, float('nan')):,.0f}" for metric, _ in metrics]
            hits = values.get("lts__t_sectors_op_read_lookup_hit.sum")
            total = values.get("lts__t_sectors_op_read.sum")
            rate = f"{hits / total:.1%}" if hits is not None and total else ""
            print(f"| {rows} | {label} | " + " | ".join(cells) + f" | {rate} |")
            results.append(dict(rows=rows, fields=fields, metrics=values))
    env = record.environment(__spec__.name, "cuda", context=args.context)
    print(f"# {record.environment_line(env)}")
    record.write_json(args.json, dict(environment=env, rows=results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
