"""Attention and cache kernels behind one dispatch.

Every kernel has a torch reference with the same signature (kernels/reference.py), which is the CPU path;
Triton kernels join here and are chosen on CUDA. ``PAGEDCHAT_KERNELS=reference`` forces the reference.
"""
from __future__ import annotations

import os

from kernels import reference

_CHOICE = os.environ.get("PAGEDCHAT_KERNELS", "auto")
if _CHOICE not in ("auto", "reference"):
    raise ValueError(f"PAGEDCHAT_KERNELS: must be auto or reference, not {_CHOICE!r}")

store_kv = reference.store_kv
paged_attention = reference.paged_attention
prefill_attention = reference.prefill_attention
copy_blocks = reference.copy_blocks
swap_blocks = reference.swap_blocks

__all__ = ["store_kv", "paged_attention", "prefill_attention", "copy_blocks", "swap_blocks"]
