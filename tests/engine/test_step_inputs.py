"""The packed step buffer (engine/worker/step_inputs.py): a padded decode-only step lays out its head as the CUDA
graphs' static inputs read it, with padding rows that write nowhere; another rank's unpack gives the same
tensors."""

from __future__ import annotations

import torch

from engine.kv_backend.paged import PagedKV
from engine.sampling_params import SamplingParams
from engine.core.scheduled_batch import ScheduledBatch
from engine.sequence import Sequence
from engine.worker.step_inputs import PADDING_ROW, StepInputs

BLOCK = 4
# (its slot math only: no memory allocated)
PAGED = PagedKV(1, 1, 1, torch.float32, torch.device("cpu"), BLOCK)


def decoding(seq_id: int, tokens: list[int], blocks: list[int]) -> Sequence:
    """A sequence whose every token but the last has KV: its next step is one decode row."""
    seq = Sequence(
        seq_id=seq_id, request_id=f"r{seq_id}", token_ids=list(tokens), params=SamplingParams()
    )
    seq.num_computed_tokens = len(tokens) - 1
    seq.block_table = list(blocks)
    return seq


def test_a_padded_decode_step_is_the_static_view_with_padding_rows():
    inputs = StepInputs(
        torch.device("cpu"), BLOCK, max_tokens=16, max_seqs=8, max_blocks_per_seq=4, kv=PAGED
    )
    seqs = [decoding(0, [5, 6, 7, 8, 9], [3, 1]), decoding(1, [11, 12], [2])]
    step = inputs.build(ScheduledBatch(seqs=seqs, num_new_tokens=[1, 1]), {}, pad_to=4)
    view = inputs.decode_view(4)
    assert view.ids.tolist() == [9, 12, PADDING_ROW["ids"], PADDING_ROW["ids"]]
    assert view.positions.tolist() == [4, 1, 0, 0]
    # slot = block * block_size + offset: position 4 is block 1 of [3, 1] at offset 0; position 1: block 2, 1
    assert view.slots.tolist() == [1 * BLOCK + 0, 2 * BLOCK + 1, -1, -1]
    assert view.context_lens.tolist() == [5, 2, 1, 1]
    assert view.feed.tolist() == [-1] * 4 and view.cu_seqlens.tolist() == [0]
    assert torch.equal(step.metadata.slot_mapping, view.slots)
    # where the graph's first kernel finds the table rows it copies into the static table
    offset, rows, width = view.table_at.tolist()
    assert (rows, width) == tuple(step.metadata.block_tables.shape) == (2, 2)
    table = inputs.device_buffer[offset : offset + rows * width].view(rows, width)
    assert table.tolist() == [[3, 1], [2, 0]]  # (a short row padded with block 0)
    assert torch.equal(table, step.metadata.block_tables)
    view.fill_padding()
    assert view.slots.tolist() == [-1] * 4 and view.context_lens.tolist() == [1] * 4
    assert view.table_at.tolist() == [0, 0, 0]  # a capture copies no table rows


def test_decode_rows_are_ordered_longest_context_first():
    """The step's ``order``: its decode rows by context, longest first (ties in row order), then the rest of the
    rows in order (a prefill's, a graph's padding), which the decode kernel takes its programs through."""
    inputs = StepInputs(
        torch.device("cpu"), BLOCK, max_tokens=16, max_seqs=8, max_blocks_per_seq=4, kv=PAGED
    )
    seqs = [
        decoding(0, [1, 2], [1]),
        decoding(1, [3, 4, 5, 6, 7], [2, 3]),
        decoding(2, [8, 9, 10], [4]),
        decoding(3, [11, 12, 13], [5]),
    ]
    step = inputs.build(ScheduledBatch(seqs=seqs, num_new_tokens=[1] * 4), {}, pad_to=6)
    assert inputs.decode_view(6).order.tolist() == [1, 2, 3, 0, 4, 5]
    assert torch.equal(step.metadata.decode_order, inputs.decode_view(6).order)
    prefill = Sequence(
        seq_id=9, request_id="r9", token_ids=list(range(20, 34)), params=SamplingParams()
    )
    prefill.block_table = [6, 7, 8, 9]
    mixed = [decoding(0, [1, 2], [1]), decoding(2, [8, 9, 10], [4]), prefill]
    step = inputs.build(ScheduledBatch(seqs=mixed, num_new_tokens=[1, 1, 7]), {}, pad_to=None)
    assert step.metadata.decode_order.tolist() == [1, 0, 2]
    inputs.decode_view(6).fill_padding()
    assert inputs.decode_view(6).order.tolist() == list(range(6))


def test_another_rank_unpacks_the_same_step():
    driver = StepInputs(
        torch.device("cpu"), BLOCK, max_tokens=16, max_seqs=8, max_blocks_per_seq=4, kv=PAGED
    )
    follower = StepInputs(
        torch.device("cpu"), BLOCK, max_tokens=16, max_seqs=8, max_blocks_per_seq=4, kv=PAGED
    )
    prefill = Sequence(
        seq_id=2, request_id="r2", token_ids=list(range(20, 27)), params=SamplingParams()
    )
    prefill.block_table = [4, 5]
    seqs = [decoding(0, [5, 6, 7], [3]), prefill]
    step = driver.build(ScheduledBatch(seqs=seqs, num_new_tokens=[1, 7]), {}, pad_to=None)
    copy = follower.unpack(memoryview(driver.packed.numpy()), driver.layout)
    for name in ("input_ids", "feed", "positions", "sample_rows"):
        assert torch.equal(getattr(copy, name), getattr(step, name)), name
    for name in (
        "slot_mapping",
        "block_tables",
        "context_lens",
        "prefill_cu_seqlens_q",
        "decode_order",
    ):
        assert torch.equal(getattr(copy.metadata, name), getattr(step.metadata, name)), name
    assert copy.metadata.num_decodes == 1 and copy.metadata.max_context_len == 7


def test_a_padded_window_step_gives_padding_rows_the_scratch_block():
    """A model with a window group (Gemma 3): the graphs' window tables come from the packed step, which holds
    the real rows only; padding rows read one position through their window table, so theirs must name the
    scratch block, not whatever the packed buffer holds past the real rows (there: the window slots, then
    stale values; on an H200 such a row's read faulted the decode kernel once the pool's neighbour was unmapped)."""
    from engine.worker.cuda_graphs import window_group

    kv = PagedKV(2, 1, 1, torch.float32, torch.device("cpu"), BLOCK, layer_windows=(8, 0))
    inputs = StepInputs(
        torch.device("cpu"), BLOCK, max_tokens=16, max_seqs=8, max_blocks_per_seq=4, kv=kv
    )
    seqs = [decoding(0, [5, 6, 7, 8, 9], [3, 1]), decoding(1, [11, 12], [2])]
    seqs[0].window_table, seqs[1].window_table = [7, 6], [5]
    inputs.build(ScheduledBatch(seqs=seqs, num_new_tokens=[1, 1]), {}, pad_to=4)
    view = inputs.decode_view(4)
    offset, rows, width = view.table_at.tolist()
    assert (rows, width) == (2, 4)  # each packed row: block table, then window table
    after = offset + rows * width
    assert inputs.device_buffer[after : after + 4].tolist() == [6 * BLOCK, 5 * BLOCK + 1, -1, -1]
    inputs.device_buffer[after + 4 :] = 999  # stale values: no window pool has such a block
    # the graphs' static table: 4 rows of max_blocks_per_seq columns twice
    static_shape = torch.Size((4, 2 * 4))
    tables, slots = window_group(
        inputs.device_buffer,
        view.table_at,
        static_shape,
        view.positions,
        view.slots,
        BLOCK,
        kv.scratch_slot,
    )
    assert tables.shape == static_shape
    assert tables[0, :2].tolist() == [7, 6] and tables[1, :1].tolist() == [5]
    assert (tables[2:] == kv.scratch_slot).all()  # the padding rows
    assert (tables[:, 2:] == kv.scratch_slot).all()  # past the packed window half
    # window slot = window block of the position * block_size + offset; padding rows store nothing
    assert slots.tolist() == [6 * BLOCK + 0, 5 * BLOCK + 1, -1, -1]
