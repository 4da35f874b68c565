"""The ``waste`` workload's chart: useful KV share and mean running requests per allocation mode.

Reads the JSON of ``python -m benchmarks.offline.waste --json PATH`` (run where the GPU is) and writes a PNG here
(matplotlib, Agg backend: no display needed).

    python -m benchmarks.offline.waste_chart PATH [--out docs/waste.png]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

PAPER_EARLIER_SYSTEMS = (0.20, 0.40)  # the paper's share of KV memory actually used before paging


def render(data: dict[str, Any], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    modes = [m["mode"] for m in data["modes"]]
    useful = [100 * m["useful"] for m in data["modes"]]
    running = [m["mean_running"] for m in data["modes"]]
    colors = ["tab:green" if mode == "paged" else "tab:gray" for mode in modes]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    low, high = PAPER_EARLIER_SYSTEMS
    left.axhspan(
        100 * low, 100 * high, color="tab:orange", alpha=0.15, label="paper: earlier systems"
    )
    bars = left.bar(modes, useful, color=colors)
    left.bar_label(bars, fmt="%.1f%%")
    left.set(
        ylim=(0, 105), ylabel="KV slots holding tokens / reserved (%)", title="Useful KV memory"
    )
    left.legend(loc="upper right", fontsize=8)
    bars = right.bar(modes, running, color=colors)
    right.bar_label(bars, fmt="%.1f")
    right.set(
        ylim=(0, 1.15 * max(running, default=1)),
        ylabel="requests (time average)",
        title="Mean running requests",
    )
    for axis in (left, right):
        axis.tick_params(axis="x", labelrotation=15)
    fig.suptitle(caption(data), fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=150)
    plt.close(fig)


def caption(data: dict[str, Any]) -> str:
    workload, engine, env = data["workload"], data["engine"], data["environment"]
    return (
        f"waste workload: {workload['num_requests']} nano requests, {workload['model_config']} dummy, "
        f"{env['device']}; KV pool {engine['pool_slots']} slots, max_model_len {engine['max_model_len']}; "
        f"{env['date'][:10]}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("json", help="output of benchmarks.offline.waste --json")
    parser.add_argument("--out", default="docs/waste.png")
    args = parser.parse_args(argv)
    with open(args.json) as f:
        data = json.load(f)
    render(data, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
