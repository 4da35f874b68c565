"""The lean CPU decode path (kernels/cpu.py) against the reference kernels, bit for bit: the float32 engine's
token-exactness with transformers rests on it computing the reference's arithmetic."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu, reference

BLOCK, HEADS, KV_HEADS, DIM = 16, 9, 3, 64


def random_cache(num_blocks: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, BLOCK, KV_HEADS, DIM)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


@pytest.mark.parametrize("context_lens", [[37], [1, 16, 17, 90], [64, 3]])
def test_decode_attention_with_a_per_pass_plan_equals_the_reference(
    context_lens: list[int],
) -> None:
    gen = torch.Generator().manual_seed(len(context_lens))
    k_cache, v_cache = random_cache(40, gen)
    ctx = torch.tensor(context_lens, dtype=torch.int32)
    tables = torch.randperm(40, generator=gen)[: len(ctx) * 8].view(len(ctx), 8).int()
    query = torch.randn(len(ctx), HEADS, DIM, generator=gen)
    expected, got = torch.full_like(query, float("nan")), torch.full_like(query, float("nan"))
    reference.paged_attention(expected, query, k_cache, v_cache, tables, ctx, 0.125)
    plan = cpu.decode_plan(tables, ctx, BLOCK)
    cpu.paged_decode_attention(got, query, k_cache, v_cache, plan, 0.125)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("padding", [False, True])
def test_store_kv_with_a_plan_equals_the_reference(padding: bool) -> None:
    gen = torch.Generator().manual_seed(int(padding))
    slots = torch.randperm(10 * BLOCK, generator=gen)[:12]
    if padding:
        slots[[2, 7]] = -1
    key, value = (
        torch.randn(12, KV_HEADS, DIM, generator=gen),
        torch.randn(12, KV_HEADS, DIM, generator=gen),
    )
    caches = [random_cache(10, torch.Generator().manual_seed(5)) for _ in range(2)]
    reference.store_kv(key, value, *caches[0], slots)
    cpu.store_kv(key, value, *caches[1], cpu.store_plan(slots))
    assert all(torch.equal(a, b) for a, b in zip(caches[0], caches[1]))


@pytest.mark.parametrize("adjacent", [True, False])
def test_rotary_with_a_plan_equals_the_reference(adjacent: bool) -> None:
    """Adjacent: q and k are views of one QKV output (rotated as one tensor); else separate tensors."""
    gen = torch.Generator().manual_seed(3)
    angles = torch.rand(128, DIM // 2, generator=gen) * 6
    cos_cache, sin_cache = (
        torch.cat((angles, angles), -1).cos(),
        torch.cat((angles, angles), -1).sin(),
    )
    positions = torch.randint(0, 128, (5,), generator=gen)
    qkv = torch.randn(5, (HEADS + 2 * KV_HEADS) * DIM, generator=gen)
    q, k, _ = qkv.split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=-1)
    q, k = q.view(5, HEADS, DIM), k.view(5, KV_HEADS, DIM)
    if not adjacent:
        q, k = q.clone(), k.clone()
    assert (cpu._adjacent(q, k) is not None) == adjacent
    q_ref, k_ref = q.clone(), k.clone()
    reference.rotary_embedding(positions, q_ref, k_ref, cos_cache, sin_cache)
    cpu.rotary_embedding(q, k, cpu.rotary_plan(positions, cos_cache, sin_cache))
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)


def test_torch_rms_norm_is_the_references_arithmetic() -> None:
    """The lean path's RMSNorm is torch's fused op: it must round exactly as the reference does."""
    gen = torch.Generator().manual_seed(4)
    for rows, scale in [(1, 1.0), (3, 40.0), (8, 0.01), (17, 3.0)]:
        x = torch.randn(rows, 576, generator=gen) * scale
        weight = torch.rand(576, generator=gen) + 0.5
        assert torch.equal(
            F.rms_norm(x, weight.shape, weight, 1e-5), reference.rms_norm(x, weight, 1e-5)
        )
