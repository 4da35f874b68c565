"""A CPU model's rotary tables hold the positions seen so far and grow by whole blocks as sequences reach further:
every row equals the row of a table built for all positions at once (bit for bit, whatever the order of growth),
a position past the first block rotates q and k as the full table does, the model's dtype is kept, and positions
beyond the model's are refused."""

from __future__ import annotations

import pytest
import torch

from engine.layers.rotary import CPU_POSITION_BLOCK, RotaryEmbedding

HEAD_DIM, MAX_POSITION = 64, 5 * CPU_POSITION_BLOCK + 100  # (the last block a partial one)
PARAMS = {"rope_theta": 10000.0, "rope_type": "default"}


def full_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """Every position's rows computed at once (as a GPU model's tables are)."""
    return RotaryEmbedding(HEAD_DIM, MAX_POSITION, PARAMS)._rows(0, MAX_POSITION)


def test_tables_start_with_one_block_and_grow_by_whole_blocks_at_least_doubling():
    rotary = RotaryEmbedding(HEAD_DIM, MAX_POSITION, PARAMS)
    assert rotary.cos_cache.shape == (CPU_POSITION_BLOCK, HEAD_DIM)
    rotary.cover(torch.tensor([3, CPU_POSITION_BLOCK - 1]))  # (already held)
    assert rotary.cos_cache.shape[0] == CPU_POSITION_BLOCK
    rotary.cover(torch.tensor([CPU_POSITION_BLOCK]))
    assert rotary.cos_cache.shape[0] == 2 * CPU_POSITION_BLOCK
    rotary.cover(torch.tensor([4 * CPU_POSITION_BLOCK + 1]))
    assert rotary.cos_cache.shape[0] == 5 * CPU_POSITION_BLOCK
    rotary.cover(torch.tensor([5 * CPU_POSITION_BLOCK]))  # never past the model's positions
    assert rotary.cos_cache.shape[0] == rotary.sin_cache.shape[0] == MAX_POSITION


@pytest.mark.parametrize("steps", [[MAX_POSITION - 1], [2100, 4500, 9000, MAX_POSITION - 1]])
def test_every_row_equals_the_full_tables_whatever_the_growth(steps: list[int]):
    cos, sin = full_tables()
    rotary = RotaryEmbedding(HEAD_DIM, MAX_POSITION, PARAMS)
    for position in steps:
        rotary.cover(torch.tensor([position]))
        rows = rotary.cos_cache.shape[0]
        assert torch.equal(rotary.cos_cache, cos[:rows]) and torch.equal(
            rotary.sin_cache, sin[:rows]
        )


def test_a_far_position_rotates_q_and_k_as_the_full_tables_do():
    cos, sin = full_tables()
    rotary = RotaryEmbedding(HEAD_DIM, MAX_POSITION, PARAMS)
    positions = torch.tensor([1, CPU_POSITION_BLOCK + 7, 3 * CPU_POSITION_BLOCK + 11])
    q, k = torch.randn(3, 4, HEAD_DIM), torch.randn(3, 2, HEAD_DIM)

    def rotated(x: torch.Tensor) -> torch.Tensor:
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        half = HEAD_DIM // 2
        return x * c + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * s

    expected_q, expected_k = rotated(q), rotated(k)
    out_q, out_k = rotary(positions, q.clone(), k.clone())
    torch.testing.assert_close(out_q, expected_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out_k, expected_k, rtol=1e-6, atol=1e-6)
    rotation = RotaryEmbedding(HEAD_DIM, MAX_POSITION, PARAMS).rotation(positions)
    assert (
        rotation.cos_cache.shape[0] > positions.max()
    )  # (the KV store's rotation covers them too)


def test_growth_keeps_the_models_dtype():
    rotary = RotaryEmbedding(HEAD_DIM, MAX_POSITION, PARAMS).to(torch.bfloat16)
    rotary.cover(torch.tensor([CPU_POSITION_BLOCK + 1]))
    assert rotary.cos_cache.dtype == rotary.sin_cache.dtype == torch.bfloat16
    cos, _ = full_tables()
    assert torch.equal(rotary.cos_cache, cos[: rotary.cos_cache.shape[0]].to(torch.bfloat16))


def test_a_position_beyond_the_model_is_an_index_error():
    rotary = RotaryEmbedding(HEAD_DIM, MAX_POSITION, PARAMS)
    with pytest.raises(IndexError):
        rotary(
            torch.tensor([MAX_POSITION]), torch.randn(1, 4, HEAD_DIM), torch.randn(1, 2, HEAD_DIM)
        )


def test_positions_on_another_device_grow_the_tables_to_every_position_unread():
    """A model built on the CPU and moved to a GPU takes all of its rows at its first pass, without reading the
    positions (here on the meta device, which holds no values)."""
    rotary = RotaryEmbedding(HEAD_DIM, MAX_POSITION, PARAMS)
    rotary.cover(torch.empty(3, dtype=torch.int64, device="meta"))
    cos, sin = full_tables()
    assert torch.equal(rotary.cos_cache, cos) and torch.equal(rotary.sin_cache, sin)
