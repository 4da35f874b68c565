"""A layer that hands its KV backend the rotary embedding (``rotation``) gets what it got when it rotated q and k
itself before ``attend``: the same output and the same cache, for decode rows and a prefill chunk after them; with
Qwen3's q/k norm handed over too (``QKNorm``), what it got when it normed q and k itself first.

The paged backend and its lean CPU subclass are checked, each with the kernels the CPU dispatches to (the torch
references) and with the Triton kernels in the interpreter (``rotary_store_kv``, ``store_kv``, decode and prefill
attention swapped into ``kernels.ops``), so rotation is applied once, before the store and before both kernels.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

from engine.kv_backend.base import QKNorm, Rotation  # noqa: E402
from engine.kv_backend.paged import LeanCpuPagedKV, PagedKV  # noqa: E402
from engine.forward_context import AttentionMetadata  # noqa: E402
from kernels import ops as kernel_ops  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 32, 16
DECODE_CONTEXTS = [5, 21]  # two decode rows with that many tokens of context (the new one included)
PREFILL = (7, 12)  # a prefill chunk of 12 tokens after 7 cached ones
TRITON_NAMES = (
    "store_kv",
    "rotary_store_kv",
    "rotary_embedding",
    "rms_norm",
    "paged_attention",
    "prefill_attention",
)


@pytest.fixture(params=["reference", "triton"])
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "triton":
        import importlib

        from kernels import _TRITON_MODULE

        for name in TRITON_NAMES:
            module = importlib.import_module(f"kernels.{_TRITON_MODULE[name]}")
            monkeypatch.setattr(kernel_ops, name, getattr(module, name))
    return request.param


def metadata() -> tuple[AttentionMetadata, torch.Tensor]:
    """Blocks handed out in order; -> the metadata and each token's position."""
    contexts = [*DECODE_CONTEXTS, sum(PREFILL)]
    blocks_each = [-(-c // BLOCK) for c in contexts]
    tables = torch.zeros(len(contexts), max(blocks_each), dtype=torch.int32)
    first = 0
    for row, count in enumerate(blocks_each):
        tables[row, :count] = torch.arange(first, first + count)
        first += count
    positions = [c - 1 for c in DECODE_CONTEXTS] + list(range(PREFILL[0], sum(PREFILL)))
    rows = [0, 1] + [2] * PREFILL[1]
    slots = [int(tables[r, p // BLOCK]) * BLOCK + p % BLOCK for r, p in zip(rows, positions)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=tables,
        context_lens=torch.tensor(contexts, dtype=torch.int32),
        num_decodes=len(DECODE_CONTEXTS),
        prefill_cu_seqlens_q=torch.tensor([0, PREFILL[1]], dtype=torch.int32),
    )
    return meta, torch.tensor(positions)


def filled_backend(cls: type[PagedKV], seed: int) -> PagedKV:
    kv = cls(1, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"), BLOCK)
    kv.allocate(8)
    gen = torch.Generator().manual_seed(seed)
    kv.k_caches.copy_(torch.randn(kv.k_caches.shape, generator=gen))
    kv.v_caches.copy_(torch.randn(kv.v_caches.shape, generator=gen))
    return kv


def rotary_tables() -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.rand(64, HEAD_DIM // 2, generator=torch.Generator().manual_seed(1)) * 30
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("normed", [False, True], ids=["rotation", "qk-norm+rotation"])
@pytest.mark.parametrize("backend", [PagedKV, LeanCpuPagedKV], ids=lambda c: c.__name__)
def test_rotation_handed_to_the_backend_equals_rotating_before(
    backend: type[PagedKV], kernels: str, normed: bool
) -> None:
    meta, positions = metadata()
    cos, sin = rotary_tables()
    tokens = positions.shape[0]
    gen = torch.Generator().manual_seed(9)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen) * 2
    norm = QKNorm(*(torch.rand(2, HEAD_DIM, generator=gen) + 0.5), 1e-6) if normed else None
    outs, caches = [], []
    for hand_over in (True, False):
        kv = filled_backend(backend, seed=5)
        q, k, v = qkv.clone().split(
            [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1
        )
        q, k = q.view(tokens, HEADS, HEAD_DIM), k.view(tokens, KV_HEADS, HEAD_DIM)
        v = v.view(tokens, KV_HEADS, HEAD_DIM)
        k_cache, v_cache = kv.layer_caches(0)
        if hand_over:
            rotation = Rotation(positions, cos, sin, norm)
        else:
            if norm is not None:
                q = kernel_ops.rms_norm(q, norm.q_weight, norm.eps)
                k = kernel_ops.rms_norm(k, norm.k_weight, norm.eps)
            kernel_ops.rotary_embedding(positions, q, k, cos, sin)
            rotation = None
        outs.append(kv.attend(q, k, v, k_cache, v_cache, meta, HEAD_DIM**-0.5, 1.0, 1.0, rotation))
        caches.append((kv.k_caches.clone(), kv.v_caches.clone()))
    # bit for bit, but for the fused norm's sum of squares, which Triton adds as two halves (fp32 rounding)
    exact = norm is None or kernels == "reference" or backend is LeanCpuPagedKV
    tol = 0 if exact else 1e-5
    torch.testing.assert_close(outs[0], outs[1], rtol=tol, atol=tol)
    for handed, rotated in zip(*caches):
        torch.testing.assert_close(handed, rotated, rtol=tol, atol=tol)
    # and the rotation did something: the stored keys are not the unrotated ones
    k_new = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(
        tokens, KV_HEADS, HEAD_DIM
    )
    stored = caches[0][0].view(-1, KV_HEADS, HEAD_DIM)[meta.slot_mapping]
    assert not torch.allclose(stored, k_new)
