"""A step's input preparation kernel (kernels/prepare_inputs.py) against its torch reference: pending ids fed from
the last sampled ids (random feeds, none fed, all fed, more tokens than one program takes); table rows copied
from where ``table_at`` says they lie into a wider static table, the rest untouched; the same launch arguments
with another table shape (as a CUDA graph replays it); and bad arguments refused. Interpreter on the CPU;
compiled on a GPU."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

from kernels import reference  # noqa: E402
from kernels.prepare_inputs import BLOCK_T, BLOCK_W, prepare_inputs  # noqa: E402

DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")


def _feed(tokens: int, fed_share: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50_000, (tokens,), generator=g, dtype=torch.int32)
    last = torch.randint(0, 50_000, (64,), generator=g, dtype=torch.int32)
    feed = torch.randint(0, 64, (tokens,), generator=g, dtype=torch.int32)
    feed[torch.rand(tokens, generator=g) >= fed_share] = -1
    ids[feed >= 0] = -1  # PENDING_TOKEN where the device supplies the id
    return ids, feed, last


@pytest.mark.parametrize(
    "tokens,fed_share", [(1, 1.0), (16, 0.5), (BLOCK_T + 37, 0.3), (3 * BLOCK_T, 0.0)]
)
def test_feeds_pending_ids_like_the_reference(tokens, fed_share):
    ids, feed, last = _feed(tokens, fed_share, seed=tokens)
    want = ids.clone()
    reference.prepare_inputs(want, feed, last, None, None, None)
    got = ids.to(DEVICE)
    prepare_inputs(got, feed.to(DEVICE), last.to(DEVICE), None, None, None)
    assert torch.equal(got.cpu(), want)
    fed = feed >= 0
    assert torch.equal(want[fed], last[feed[fed].long()])  # the reference does what it says
    assert torch.equal(want[~fed], ids[~fed])


def _packed_table(rows: int, width: int, offset: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    packed = torch.full((offset + rows * width + 5,), -3, dtype=torch.int32)
    packed[offset : offset + rows * width] = torch.randint(
        0, 10_000, (rows * width,), generator=g, dtype=torch.int32
    )
    return packed


@pytest.mark.parametrize("rows,width", [(1, 3), (5, BLOCK_W + 9), (9, 2 * BLOCK_W), (0, 4)])
def test_copies_table_rows_into_the_static_table(rows, width):
    tokens, offset = 16, 37  # fewer programs feed ids (1) than copy rows (up to 16)
    ids, feed, last = _feed(tokens, 0.5, seed=rows)
    packed = _packed_table(rows, width, offset, seed=width)
    table_at = torch.tensor([offset, rows, width], dtype=torch.int32)
    static = torch.full((16, 2 * BLOCK_W + 5), -7, dtype=torch.int32)
    want_ids, want_static = ids.clone(), static.clone()
    reference.prepare_inputs(want_ids, feed, last, packed, table_at, want_static)
    got_ids, got_static = ids.to(DEVICE), static.to(DEVICE)
    prepare_inputs(
        got_ids,
        feed.to(DEVICE),
        last.to(DEVICE),
        packed.to(DEVICE),
        table_at.to(DEVICE),
        got_static,
    )
    assert torch.equal(got_static.cpu(), want_static)
    assert torch.equal(got_ids.cpu(), want_ids)
    table = packed[offset : offset + rows * width].view(rows, width)
    assert torch.equal(want_static[:rows, :width], table)
    assert (want_static[rows:] == -7).all() and (want_static[:, width:] == -7).all()


def test_the_table_shape_is_read_on_the_device():
    """One set of launch arguments (a CUDA graph's), two steps' tables of different shapes and places."""
    ids, feed, last = (t.to(DEVICE) for t in _feed(8, 0.5, seed=3))
    packed = torch.zeros(600, dtype=torch.int32, device=DEVICE)
    table_at = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    static = torch.full((8, 300), -7, dtype=torch.int32, device=DEVICE)
    for rows, width, offset in ((3, 40, 100), (7, 70, 20)):
        source = _packed_table(rows, width, offset, seed=rows)
        packed[: source.numel()] = source.to(DEVICE)
        table_at.copy_(torch.tensor([offset, rows, width], dtype=torch.int32))
        prepare_inputs(ids, feed, last, packed, table_at, static)
        want = source[offset : offset + rows * width].view(rows, width)
        assert torch.equal(static[:rows, :width].cpu(), want)


def test_bad_arguments_are_refused():
    ids, feed, last = (t.to(DEVICE) for t in _feed(4, 0.5, seed=1))
    packed = torch.zeros(10, dtype=torch.int32, device=DEVICE)
    table_at = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    static = torch.zeros(2, 4, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="ids and feed"):
        prepare_inputs(ids, feed[:3], last, None, None, None)
    with pytest.raises(ValueError, match="int32"):
        prepare_inputs(ids, feed, last.long(), None, None, None)
    with pytest.raises(ValueError, match="go together"):
        prepare_inputs(ids, feed, last, packed, None, static)
    with pytest.raises(ValueError, match="3 values"):
        prepare_inputs(ids, feed, last, packed, table_at[:2], static)
