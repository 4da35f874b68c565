"""Attention, cache and fused layer kernels behind one dispatch.

Every kernel has a torch reference with the same signature (kernels/reference.py), which is the CPU path;
the Triton kernels (paged_attention.py, prefill_attention.py, contiguous_attention.py, cache_ops.py, and the
fused layer kernels rms_norm.py, rotary.py, activation.py, the decode matmul skinny_gemm.py, greedy sampling's
argmax.py, a step's inputs, prepare_inputs.py, and the mixture-of-experts MLP fused_moe.py) run when a tensor
argument is on CUDA.
``PAGEDCHAT_KERNELS``: ``auto`` (default), ``reference`` (always the reference) or ``triton`` (always Triton;
with CPU tensors on a machine without CUDA that is Triton's interpreter: slow, for tests). Triton is imported
on first use, so a CPU-only install runs without it and ``TRITON_INTERPRET`` is set before it loads.

The dispatchers live in ``kernels.ops`` (``kernels.ops.paged_attention(...)``), not as package attributes:
importing the submodule ``kernels.paged_attention`` rebinds the package attribute of that name to the module.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import SimpleNamespace
from typing import Callable

import torch

from kernels import reference

_CHOICE = os.environ.get("PAGEDCHAT_KERNELS", "auto")
if _CHOICE not in ("auto", "reference", "triton"):
    raise ValueError(f"PAGEDCHAT_KERNELS: must be auto, reference or triton, not {_CHOICE!r}")

_TRITON_MODULE = {
    "store_kv": "cache_ops",
    "copy_blocks": "cache_ops",
    "swap_blocks": "cache_ops",
    "paged_attention": "paged_attention",
    "prefill_attention": "prefill_attention",
    "contiguous_decode_attention": "contiguous_attention",
    "contiguous_prefill_attention": "contiguous_attention",
    "rms_norm": "rms_norm",
    "rotary_embedding": "rotary",
    "rotary_store_kv": "rotary",
    "silu_and_mul": "activation",
    "skinny_gemm": "skinny_gemm",
    "skinny_gemm_silu_and_mul": "skinny_gemm",
    "greedy_argmax": "argmax",
    "persistent_decode": "persistent_decode",
    "prepare_inputs": "prepare_inputs",
    "fused_moe": "fused_moe",
}


@functools.cache
def _triton_kernel(name: str) -> Callable:
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede triton's first import
    return getattr(importlib.import_module(f"kernels.{_TRITON_MODULE[name]}"), name)


def _dispatch(name: str) -> Callable:
    ref = getattr(reference, name)
    if _CHOICE == "reference":
        return ref

    @functools.wraps(ref)
    def kernel(*args: object) -> object:  # positional only: call sites pass every argument in order
        on_cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
        return (_triton_kernel(name) if _CHOICE == "triton" or on_cuda else ref)(*args)

    return kernel


ops = SimpleNamespace(**{name: _dispatch(name) for name in _TRITON_MODULE})


def lean_cpu(tensor: torch.Tensor) -> bool:
    """Whether a layer takes the lean CPU decode path (kernels/cpu.py) for this tensor (``auto`` on the CPU)."""
    return _CHOICE == "auto" and not tensor.is_cuda


__all__ = ["lean_cpu", "ops"]
