"""``triton.jit`` options for arguments that change from one engine step to the next.

Triton compiles one variant of a kernel per specialization key: an integer is keyed on being 1 or a multiple
of 16, a pointer on 16-byte alignment. Row counts, table widths and partition sizes change every step, and the
step's metadata (positions, slots, context lengths, cu_seqlens, block tables) are slices of one packed buffer at
offsets that change with the batch, so their alignment changes too. Each new combination used to compile a
variant (~0.5-1 s) in the middle of serving: 8 of them inside one timed nano run on an H200
(``benchmarks.step_trace``). These arguments are loaded as scalars or short index vectors, where the
specialization buys nothing measurable.
"""

from __future__ import annotations

import inspect
from typing import Any

import triton


def per_step(*names: str) -> dict[str, Any]:
    """Options for ``@triton.jit(**per_step(...))``: neither value nor alignment specialization for ``names``."""
    options: dict[str, Any] = {"do_not_specialize": list(names)}
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        options["do_not_specialize_on_alignment"] = list(names)
    return options
