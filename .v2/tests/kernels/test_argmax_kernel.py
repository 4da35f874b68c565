"""Greedy sampling's argmax kernel (kernels/argmax.py) against torch's argmax (kernels/reference.py): random rows,
ties (the lowest index wins), NaN (the first wins), rows of -inf, vocabularies that are not a multiple of the
kernel's chunk, one row and many, bfloat16 and float32. Interpreter on the CPU; compiled on a GPU."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

from kernels import reference  # noqa: E402
from kernels.argmax import BLOCK as CHUNK  # noqa: E402
from kernels.argmax import greedy_argmax  # noqa: E402

DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(1, 128256), (5, 3 * CHUNK + 17), (16, 1000), (3, 1)])
def test_matches_torch_on_random_rows(rows, vocab, dtype):
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)).to(dtype)
    logits = logits.to(DEVICE)
    got = greedy_argmax(logits)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got, reference.greedy_argmax(logits))


def test_ties_take_the_lowest_index_across_lanes_and_chunks():
    vocab = 2 * CHUNK + 100
    logits = torch.randn(4, vocab) - 10
    logits[0, [5, CHUNK + 5, 2 * CHUNK + 3]] = 7.0  # same lane in two chunks, and another lane
    logits[1, [CHUNK + 9, 2 * CHUNK + 1]] = (
        7.0  # the earlier chunk's lane has the higher lane number
    )
    logits[2] = 1.5  # all equal
    logits[3, [vocab - 1, vocab - 2]] = 9.0
    got = greedy_argmax(logits.to(DEVICE)).cpu().tolist()
    assert got == [5, CHUNK + 9, 0, vocab - 2]
    assert got == reference.greedy_argmax(logits).tolist()


def test_nan_wins_and_negative_infinity_rows_give_zero():
    logits = torch.randn(3, CHUNK + 50)
    logits[0, [40, CHUNK + 3]] = float("nan")
    logits[0, 10] = 1e30
    logits[1] = float("-inf")
    logits[2, : CHUNK + 49] = float("-inf")  # only the last column is finite
    got = greedy_argmax(logits.to(DEVICE)).cpu().tolist()
    assert got == [40, 0, CHUNK + 49]
    assert got == reference.greedy_argmax(logits).tolist()


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="rows, vocab"):
        greedy_argmax(torch.randn(5, device=DEVICE))
    with pytest.raises(ValueError, match="rows, vocab"):
        greedy_argmax(torch.randn(2, 0, device=DEVICE))
    assert greedy_argmax(torch.randn(0, 9, device=DEVICE)).shape == (0,)


def test_counters_are_left_zero_for_the_next_launch():
    from kernels.counters import zeroed_counters

    for rows, vocab in [(3, 5 * CHUNK), (7, CHUNK + 1)]:
        logits = torch.randn(rows, vocab, device=DEVICE)
        assert torch.equal(greedy_argmax(logits), reference.greedy_argmax(logits))
        assert not zeroed_counters("argmax", logits.device, rows).any()
