"""CUDA graphs for decode-only steps.

A decode step of a small model launches hundreds of small kernels; launching them from Python costs more
host time than the GPU needs to run them. Each graph records one decode pass (input feed, forward, logits)
for a fixed padded batch size over static input buffers; a step copies its inputs into those buffers and
replays the graph of the smallest size that holds its batch. Sizes: 1, 2, 4, 8, then every 8 up to the
largest. Graphs are captured largest first into one memory pool, so the smaller ones reuse its memory.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)


def graph_sizes(max_size: int) -> list[int]:
    """The ladder of captured batch sizes up to ``max_size`` (always included)."""
    sizes = [s for s in (1, 2, 4) if s < max_size] + list(range(8, max_size, 8))
    return sorted(set(sizes + [max_size]))


def padded_size(sizes: list[int], batch_size: int) -> int | None:
    """Smallest captured size that holds ``batch_size`` rows; None when the batch is larger than all."""
    for size in sizes:
        if size >= batch_size:
            return size
    return None


class DecodeGraphs:
    def __init__(self, decode_pass: Callable[[int], torch.Tensor], sizes: list[int], device: torch.device,
                 prepare_inputs: Callable[[int], None]) -> None:
        """``decode_pass(size)`` runs one padded decode pass over the static inputs and returns its static
        output; ``prepare_inputs(size)`` fills the static inputs with a harmless batch for capture."""
        self.sizes = sorted(sizes)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.num_replays = 0
        pool = torch.cuda.graph_pool_handle()
        free_before = torch.cuda.mem_get_info(device)[0]
        start = time.perf_counter()
        for size in tqdm(sorted(sizes, reverse=True), desc="capturing CUDA graphs", leave=False):
            prepare_inputs(size)
            decode_pass(size)  # warm-up outside the graph: Triton compiles, lazy buffers get allocated
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[size] = decode_pass(size)
            self._graphs[size] = graph
        torch.cuda.synchronize(device)
        self.memory_bytes = free_before - torch.cuda.mem_get_info(device)[0]
        logger.info("CUDA graphs: %d decode batch sizes (%d..%d) captured in %.1f s, %.0f MiB", len(sizes),
                    self.sizes[0], self.sizes[-1], time.perf_counter() - start, self.memory_bytes / 2**20)

    def replay(self, size: int) -> torch.Tensor:
        self._graphs[size].replay()
        self.num_replays += 1
        return self._outputs[size]
