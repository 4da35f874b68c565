"""Programmatic dependent launch (PDL) for the decode step's chain of small kernels, on Hopper and later.

A decode step of a small batch is ~150 kernels of 2-25 us each, one after the other on one stream: each boundary
costs a launch, the first loads' latency and the previous kernel's tail, a few microseconds in all, in which the
memory system idles. With PDL (``launch_pdl=True``, compute capability 9.0+) a kernel may start while the one
before it is still running:

- ``wait_for_previous`` (``griddepcontrol.wait``) blocks until the previous kernel has completed and its writes
  are visible. A kernel launched with PDL calls it before it reads anything an earlier kernel wrote and before it
  writes anything (a write could race with the previous kernel's reads). What comes before the wait reads only
  memory no kernel of the step writes: the weights (``prefetch_l2``). Completion is transitive: a kernel
  completes only after its own wait, so waiting for the previous kernel waits for every earlier one.
- ``release_next`` (``griddepcontrol.launch_dependents``) lets the next kernel launch once every program of this
  one has called it or exited. It is called right after the wait, so at most two kernels share the SMs and the
  next one's programs only ever wait for a running kernel.

Both instructions are no-ops for a kernel launched without PDL, and a kernel without them (cuBLAS, torch's ops)
simply runs in stream order. Whether a launch uses PDL: kernels/device_features.py ``use_pdl`` (Hopper and
later, unless ``PAGEDCHAT_PDL=off``; never the interpreter). CUDA graphs keep the launches' programmatic edges.
Decode attention (kernels/paged_attention.py) is launched without it: a long-context step was 5% faster so.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Block until the previous kernel has completed and its writes are visible (PDL launches only)."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def release_next(PDL: tl.constexpr):
    """Let the next kernel launch once every program of this one has called this or exited."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs, PDL: tl.constexpr):
    """Ask L2 for the 128-byte lines at ``ptrs`` (kept with evict_last priority), no registers filled: a
    kernel's first weight tiles, fetched while the previous kernel finishes."""
    if PDL:
        tl.inline_asm_elementwise(
            "prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;",
            "=r,l",
            [ptrs],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
