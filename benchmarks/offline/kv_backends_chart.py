"""The KV backends' chart: nano output tok/s and useful KV share per model x backend, and (where the JSON has
them) the decode kernel's effective GB/s per shape, paged vs contiguous.

Reads the JSON of ``python -m benchmarks.offline.kv_backends --json PATH`` (run where the GPU is) and writes a PNG here
(matplotlib, Agg backend: no display needed).

    python -m benchmarks.offline.kv_backends_chart PATH [--out docs/kv_backends.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

COLORS = {"paged": "tab:green", "vattention": "tab:blue", "contiguous": "tab:blue"}


def grouped_bars(axis: Any, groups: list[str], series: dict[str, list[float]], fmt: str) -> None:
    """One cluster of bars per group, one bar per series (a failed run: a bar of 0)."""
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        offsets = [x + (i - (len(series) - 1) / 2) * width for x in range(len(groups))]
        bars = axis.bar(offsets, values, width, label=name, color=COLORS.get(name, "tab:gray"))
        axis.bar_label(bars, fmt=fmt, fontsize=7)
    axis.set_xticks(range(len(groups)), groups)
    axis.set_ylim(0, 1.15 * max((v for values in series.values() for v in values), default=1) or 1)
    axis.legend(fontsize=8)


def nano_series(
    rows: list[dict[str, Any]], key: str, scale: float = 1.0
) -> tuple[list[str], dict[str, list[float]]]:
    """Models (in their order) and, per backend, ``key`` of each model's row."""
    models = list(dict.fromkeys(r["model"] for r in rows))
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    value = {(r["model"], r["backend"]): scale * (r.get(key) or 0.0) for r in rows}
    return models, {b: [value.get((m, b), 0.0) for m in models] for b in backends}


def kernel_series(rows: list[dict[str, Any]]) -> tuple[list[str], dict[str, list[float]]]:
    shapes = [f"{r['batch']}x{r['context']}" for r in rows]
    return shapes, {
        layout: [r[f"{layout}_gbps"] for r in rows] for layout in ("paged", "contiguous")
    }


def render(data: dict[str, Any], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    panels = 3 if data.get("kernel") else 2
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4))
    grouped_bars(axes[0], *nano_series(data["nano"], "tok_s"), fmt="%.0f")
    axes[0].set(ylabel="output tokens / s", title="nano throughput")
    grouped_bars(axes[1], *nano_series(data["nano"], "useful", scale=100), fmt="%.1f%%")
    axes[1].set(
        ylabel="KV bytes holding tokens / reserved (%)", title="Useful KV memory (time average)"
    )
    # headroom: the legend stays clear of 100% bars
    axes[1].set(ylim=(0, 120), yticks=range(0, 101, 20))
    if panels == 3:
        grouped_bars(axes[2], *kernel_series(data["kernel"]), fmt="%.0f")
        axes[2].set(
            ylabel="K+V bytes / kernel time (GB/s)", xlabel="batch x context", title="Decode kernel"
        )
    fig.suptitle(caption(data), fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=150)
    plt.close(fig)


def caption(data: dict[str, Any]) -> str:
    workload, env = data["workload"], data["environment"]
    return (
        f"KV backends: {workload['num_requests']} nano requests, dummy weights, max_model_len "
        f"{workload['max_model_len']}; {env['device']}; {env['date'][:10]}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("json", help="output of benchmarks.offline.kv_backends --json")
    parser.add_argument("--out", default="docs/kv_backends.png")
    args = parser.parse_args(argv)
    render(json.loads(Path(args.json).read_text()), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
