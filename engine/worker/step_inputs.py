"""One step's input tensors, built with numpy in persistent buffers and sent in one host->device copy.

Per step the engine needs, for T tokens of B sequences: token ids, positions, slot mapping, context lengths,
block tables and the rows to sample. Building them from Python lists costs milliseconds at B = 256, so:
- every live sequence owns a row of a persistent host block table, updated incrementally (only the entries
  its block table gained since the last step, plus its last entry, which copy-on-write may have replaced);
- the step's vectors are written into a pinned int32 staging buffer, packed back to back, and copied to the
  device in one asynchronous copy. Two staging buffers alternate: while the device may still be reading
  step N's, the host fills step N+1's; a buffer is filled again only once its last copy has run (steps that
  sample nothing never wait for the device: the host may be further ahead).

Packed layout (int32): ``ids[T] | feed[T] | positions[T] | slots[T] | context_lens[B] | order[B] |
cu_seqlens[P+1] | table_at[3] | sample_rows[R] | block_tables[B, W]`` (``PACKED`` names them), and with a window
group (a model whose sliding-window layers have blocks of their own: engine/core/window_blocks.py) each table row
is the block table then the window table (``W`` twice) and ``window_slots[T]`` follows. ``feed[t] = r >= 0`` marks
a token the host does not know yet (sampled by the step in flight): the device takes it from row ``r`` of the
previous step's sampled ids (kernels/prepare_inputs.py). ``order`` lists the decode rows longest context first,
then the other rows in order: the decode kernel's programs take the rows in that order (kernels/paged_attention.py,
``reads_in_order``), so a launch of a few waves does not end on a tail of long rows. ``table_at`` is (the block
tables' offset, B, W). For a decode-only step padded to a CUDA-graph size G, the first 6G + 4 entries are the
graph's static inputs: the graph's first kernel feeds the ids and copies the B real table rows into the graphs'
static block table (padding rows need none), reading where they lie from ``table_at``, so no copy runs between the
upload and the graph.

The KV backend (engine/kv_backend/base.py) owns the slot math: each token's slot, the packed tables' shape
and contents, and which row a new sequence takes. With a contiguous backend (vAttention) a sequence's table
row is also its request slot: its KV sits at ``slot * max_len + position``, the packed table is one slot id
per sequence (padding rows: the scratch slot), and a finished sequence's slot is reused only after the last
step that may still read it has finished on the device (then the backend unmaps its pages).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from engine.kv_backend.base import KVBackend
from engine.forward_context import AttentionMetadata
from engine.core.scheduled_batch import ScheduledBatch
from engine.sequence import PENDING_TOKEN, Sequence


@dataclass(slots=True)
class StepTensors:
    """Device views of one step's inputs (valid until the next step's copy overwrites the device buffer)."""

    input_ids: torch.Tensor  # [T]; PENDING_TOKEN where ``feed`` gives the id (``prepare_inputs``)
    feed: torch.Tensor  # [T]: row of the previous step's sampled ids, or -1
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata
    sample_rows: torch.Tensor  # [R] token rows whose logits are sampled
    num_tokens: int  # T, padding included
    num_real_seqs: int  # B before padding


# a padding row: token 0 at position 0 of a 1-token context, its KV written nowhere (slot -1), fed nothing
PADDING_ROW = {"ids": 0, "feed": -1, "positions": 0, "slots": -1, "context_lens": 1}


# the packed buffer's vectors, in order (the module docstring's layout; window_slots: with a window group only)
PACKED = tuple(
    "ids feed positions slots context_lens order cu_seqlens table_at sample_rows tables window_slots".split()
)
TABLES = PACKED.index("tables")  # (the vector table_at points to)


def longest_first(ends: np.ndarray, num_decodes: int, num_rows: int) -> np.ndarray:
    """The step's ``order``: the first ``num_decodes`` rows by ``ends`` (their context after the step), longest
    first (stable: ties in row order), then rows ``num_decodes .. num_rows - 1`` in order."""
    decodes = np.argsort(-ends[:num_decodes], kind="stable")
    return np.concatenate((decodes, np.arange(num_decodes, num_rows)))


@dataclass(slots=True)
class DecodeView:
    """The device buffer's head as a padded decode-only step of ``size`` rows lays it out (the packed order's
    first six vectors, the one-entry prefill offsets, then where the table lies): a CUDA graph's static
    inputs."""

    ids: torch.Tensor
    feed: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    context_lens: torch.Tensor
    order: torch.Tensor
    cu_seqlens: torch.Tensor
    table_at: torch.Tensor  # (offset, rows, width) of the block tables in the packed buffer

    def fill_padding(self) -> None:
        """Every row a padding row (a harmless batch for capture), in row order, and no table rows."""
        for name, value in PADDING_ROW.items():
            getattr(self, name).fill_(value)
        torch.arange(len(self.order), out=self.order)
        self.cu_seqlens.zero_()
        self.table_at.zero_()


@dataclass(slots=True)
class _StepVectors:
    """One step's values before packing: per token (ids, positions, slots) and per sequence (ends, rows)."""

    ids: list[int]
    positions: np.ndarray
    slots: np.ndarray
    ends: np.ndarray  # tokens with KV after this step
    prefill_cu: np.ndarray
    sample_rows: list[int]
    rows: np.ndarray  # each sequence's row of the persistent table
    width: int  # the longest block table


@dataclass(slots=True)
class StepLayout:
    """Where each vector of a packed step buffer lies, and the step's shape: what another tensor-parallel rank
    needs beside the buffer to unpack the same step (engine/worker/worker_group.py)."""

    offsets: list[int]
    num_decodes: int
    total: int  # token rows, padding included
    num_seqs: int
    width: int  # block-table columns
    max_context_len: int
    rows_share_sequences: bool = False  # (AttentionMetadata's)


class StepInputs:
    def __init__(
        self,
        device: torch.device,
        block_size: int,
        max_tokens: int,
        max_seqs: int,
        max_blocks_per_seq: int,
        kv: KVBackend,
    ) -> None:
        self.device = device
        self.kv = kv
        # (row, last step that may read it)
        self._cooling: deque[tuple[int, torch.cuda.Event | None]] = deque()
        self._launched: torch.cuda.Event | None = None
        self.rows = np.zeros(0, dtype=np.int64)  # the latest step's table rows, one per sequence
        self.block_size = block_size
        self.max_blocks = max_blocks_per_seq
        # persistent, one row per seq: its block table (then, with a window group, its window table)
        self.windowed = kv.window > 0
        columns = max_blocks_per_seq * (2 if self.windowed else 1)
        self.table = np.zeros((max_seqs, columns), dtype=np.int32)
        self._rows: dict[
            int, list[int]
        ] = {}  # seq_id -> [row, entries synced, window entries synced]
        self._free_rows = [row for row in range(max_seqs - 1, -1, -1) if row != kv.reserved_row]
        capacity = 5 * max_tokens + 4 * max_seqs + 4 + max_seqs * columns
        pinned = device.type == "cuda"
        self._staging = [
            torch.empty(capacity, dtype=torch.int32, pin_memory=pinned)
            for _ in range(2 if pinned else 1)
        ]
        # the inputs' home on the device (its head doubles as the CUDA graphs' static inputs)
        self.device_buffer = torch.empty(capacity, dtype=torch.int32, device=device)
        self._turn = 0
        # the latest step's, with ``packed``: its used host buffer
        self.layout: StepLayout | None = None
        self.packed = self._staging[0][:0]
        # per staging buffer, its last copy to the device (reused once that has run)
        self._copied: list[torch.cuda.Event | None] = [None] * len(self._staging)

    # block-table rows ---------------------------------------------------------------------------------

    def forget(self, seq: Sequence) -> None:
        """``seq`` finished or was preempted: its table row goes back to the free list."""
        entry = self._rows.pop(seq.seq_id, None)
        if entry is None:
            return
        if not self.kv.contiguous:
            self._free_rows.append(entry[0])
        else:
            self._cooling.append((entry[0], self._launched))

    def step_launched(self) -> None:
        """The runner launched a step (on CUDA): rows forgotten from now on wait for it."""
        if self.kv.contiguous and self.device.type == "cuda":
            self._launched = torch.cuda.Event()
            self._launched.record()

    def drain(self) -> None:
        """Nothing runs any more (the engine is idle): free every forgotten row now."""
        while self._cooling:
            self._release_cooled(wait=True)

    def _release_cooled(self, wait: bool) -> None:
        """Free the forgotten rows whose last step finished (``wait``: the oldest one at least)."""
        while self._cooling:
            row, event = self._cooling[0]
            if event is not None and not event.query():
                if not wait:
                    return
                event.synchronize()
            wait = False
            self._cooling.popleft()
            self.kv.release_row(row)
            self._free_rows.insert(0, row)  # reused last: its pages are unmapped in the background

    def _sync_row(self, seq: Sequence) -> int:
        entry = self._rows.get(seq.seq_id)
        if entry is not None and not self.windowed and len(seq.block_table) == entry[1]:
            # the common decode step: no new block; its last entry again (copy-on-write may have replaced it)
            row, last = entry[0], entry[1] - 1
            if last >= 0:
                self.table[row, last] = seq.block_table[last]
            return row
        if entry is None:
            if not self._free_rows and self._cooling:
                self._release_cooled(wait=True)
            if not self._free_rows:
                raise RuntimeError(f"step inputs: more than {len(self.table)} live sequences")
            entry = self._rows[seq.seq_id] = [self._take_row(seq), 0, 0]
        row = entry[0]
        entry[1] = self._sync(self.table[row, : self.max_blocks], seq.block_table, entry[1])
        if (
            self.windowed
        ):  # (released entries need no sync: nothing reads a table before its window)
            entry[2] = self._sync(self.table[row, self.max_blocks :], seq.window_table, entry[2])
        return row

    @staticmethod
    def _sync(out: np.ndarray, table: list[int], synced: int) -> int:
        """The entries ``table`` gained since ``synced`` into ``out``, and its last synced entry again
        (copy-on-write may have replaced it); the new count."""
        n = len(table)
        start = max(0, min(synced, n) - 1)
        if n - start == 1:
            out[start] = table[start]
        elif n > start:
            out[start:n] = table[start:n]
        return n

    def _take_row(self, seq: Sequence) -> int:
        row = self.kv.choose_slot(seq.block_table[0]) if seq.block_table else None
        if row is not None and row in self._free_rows:
            self._free_rows.remove(row)
        else:
            row = self._free_rows.pop()
        self.kv.claim_slot(row)
        return row

    # packing ------------------------------------------------------------------------------------------

    def build(
        self, batch: ScheduledBatch, feed_rows: dict[int, int], pad_to: int | None
    ) -> StepTensors:
        """Pack ``batch``'s inputs; ``feed_rows`` maps seq_id -> row of the in-flight step's sampled ids for
        sequences whose last token is still pending. ``pad_to``: a decode-only batch padded to a graph size
        (padding rows: slot -1, context 1, their outputs ignored)."""
        for seq in batch.preempted:
            self.forget(seq)
        if self._cooling:
            self._release_cooled(wait=False)
        vectors = self._vectors(batch)
        turn, host = self._next_staging()
        self.layout = self._pack(host.numpy(), vectors, batch, feed_rows, pad_to)
        self.packed = host[: self.layout.offsets[-1]]
        return self._to_device(turn, host, self.layout)

    def _vectors(self, batch: ScheduledBatch) -> _StepVectors:
        """The step's per-token and per-sequence values (numpy), before packing."""
        # (a drafted entry is 1 + k decode rows of one sequence: ScheduledBatch.rows)
        seqs, offsets, counts = batch.rows()
        num_seqs = len(seqs)
        rows = self.rows = np.fromiter(
            (self._sync_row(seq) for seq in seqs), dtype=np.int64, count=num_seqs
        )
        starts = np.fromiter(
            (seq.num_computed_tokens for seq in seqs), dtype=np.int64, count=num_seqs
        )
        if batch.drafts:
            starts += np.asarray(offsets, dtype=np.int64)
        lens = np.asarray(counts, dtype=np.int64)
        ids: list[int] = []
        for seq, start, n in zip(seqs, starts.tolist(), counts):
            ids.extend(seq.token_ids[start : start + n])
        self.widths = np.fromiter(
            (len(seq.block_table) for seq in seqs), dtype=np.int64, count=num_seqs
        )
        cu_tokens = np.cumsum(lens) - lens  # first token row of each sequence
        positions = np.arange(len(ids), dtype=np.int64) - np.repeat(cu_tokens - starts, lens)
        seq_of_token = np.repeat(np.arange(num_seqs), lens)
        slots = self.kv.slot_mapping(self.table, rows[seq_of_token], positions)
        self.window_slots = (
            self.kv.slot_mapping(self.table[:, self.max_blocks :], rows[seq_of_token], positions)
            if self.windowed
            else None
        )
        ends = self.ends = starts + lens  # (tokens with KV after this step, per sequence)
        drafts = batch.drafts
        sample_rows = [
            int(cu) + n - 1
            for seq, cu, n, end in zip(seqs, cu_tokens.tolist(), counts, ends.tolist())
            if end == seq.num_tokens and (not drafts or seq not in drafts)
        ]
        if batch.forks:  # each forked sample is drawn from its parent's row
            row_of = {seq.seq_id: row for seq, row in zip(batch.sampling_seqs, sample_rows)}
            sample_rows += [row_of[parent.seq_id] for parent, _ in batch.forks]
        if drafts:  # every row of a drafted entry, after those (ScheduledBatch.sampling_seqs)
            first = {}
            for row, seq in enumerate(seqs):
                first.setdefault(seq, int(cu_tokens[row]))
            for seq, k in drafts.items():
                sample_rows += range(first[seq], first[seq] + k + 1)
        prefill_cu = np.concatenate(([0], np.cumsum(lens[batch.num_decode_rows :])))
        return _StepVectors(
            ids, positions, slots, ends, prefill_cu, sample_rows, rows, int(self.widths.max())
        )

    def _pack(
        self,
        flat: np.ndarray,
        v: _StepVectors,
        batch: ScheduledBatch,
        feed_rows: dict[int, int],
        pad_to: int | None,
    ) -> StepLayout:
        """Write the vectors into ``flat`` in the packed order (module docstring); the layout they took."""
        num_tokens, num_seqs = len(v.ids), len(v.rows)
        total, total_seqs = pad_to or num_tokens, pad_to or num_seqs
        table_rows, width = self.kv.table_shape(num_seqs, total_seqs, v.width)
        sizes = [total] * 4 + [total_seqs] * 2 + [len(v.prefill_cu), 3, len(v.sample_rows)]
        sizes += [table_rows * width] + ([total] if self.windowed else [])
        offsets = np.cumsum([0] + sizes).tolist()
        out = dict(zip(PACKED, (flat[offsets[i] : offsets[i + 1]] for i in range(len(sizes)))))
        if self.windowed:
            window = out["window_slots"]
            window[:num_tokens], window[num_tokens:] = self.window_slots, -1
        out["ids"][:num_tokens] = v.ids
        feed = out["feed"]
        feed.fill(-1)
        # a pending token is always a decode row's input (drafted rows follow: none pending)
        for i, seq in enumerate(batch.seqs[: batch.num_decodes]):
            if v.ids[i] == PENDING_TOKEN:
                feed[i] = feed_rows[seq.seq_id]
        out["positions"][:num_tokens], out["slots"][:num_tokens] = v.positions, v.slots
        out["context_lens"][:num_seqs] = v.ends
        out["order"][:] = longest_first(v.ends, batch.num_decode_rows, total_seqs)
        out["cu_seqlens"][:], out["sample_rows"][:] = v.prefill_cu, v.sample_rows
        out["table_at"][:] = (offsets[TABLES], table_rows, width)
        self.kv.pack_tables(out["tables"].reshape(table_rows, width), self.table, v.rows)
        if total > num_tokens:  # graph padding rows (feed: -1 already)
            for name in ("ids", "positions", "slots"):
                out[name][num_tokens:] = PADDING_ROW[name]
            out["context_lens"][num_seqs:] = PADDING_ROW["context_lens"]
        return StepLayout(
            offsets,
            total_seqs if pad_to else batch.num_decode_rows,
            total,
            num_seqs,
            width,
            int(v.ends.max()),
            bool(batch.drafts),
        )

    def decode_view(self, size: int) -> DecodeView:
        """The static inputs of a decode-only step padded to ``size`` rows (``build`` packs such a step so)."""
        head = self.device_buffer
        return DecodeView(
            *(head[i * size : (i + 1) * size] for i in range(6)),
            head[6 * size : 6 * size + 1],
            head[6 * size + 1 : 6 * size + 4],
        )

    def unpack(self, payload: memoryview, layout: StepLayout) -> StepTensors:
        """Another rank's packed step (``build``'s ``packed`` and ``layout`` there) as this device's tensors."""
        turn, host = self._next_staging()
        values = np.frombuffer(payload, dtype=np.int32)
        host.numpy()[: len(values)] = values
        return self._to_device(turn, host, layout)

    def _next_staging(self) -> tuple[int, torch.Tensor]:
        """The staging buffer to fill next, once its last copy to the device has run. Steps that sample nothing
        (a long prompt's chunks) never wait for the device, so the host may run more than a step ahead: without
        the wait, a third step would overwrite the inputs of a first whose copy had not run yet."""
        turn = self._turn % len(self._staging)
        self._turn += 1
        if (copied := self._copied[turn]) is not None:
            copied.synchronize()
        return turn, self._staging[turn]

    def _to_device(self, turn: int, host: torch.Tensor, layout: StepLayout) -> StepTensors:
        offsets = layout.offsets
        used = offsets[-1]
        buffer = self.device_buffer
        buffer[:used].copy_(host[:used], non_blocking=True)
        if self.device.type == "cuda":
            self._copied[turn] = torch.cuda.Event()
            self._copied[turn].record()
        parts = [buffer[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]
        ids, feed, positions, slots, ctx, order, cu, _, rows, table, *window_slots = parts
        tables = table.view(-1, layout.width)
        width = layout.width // 2 if self.windowed else layout.width
        metadata = AttentionMetadata(
            slot_mapping=slots,
            block_tables=tables[:, :width],
            context_lens=ctx,
            num_decodes=layout.num_decodes,
            prefill_cu_seqlens_q=cu,
            slot_ids=self.kv.slot_ids(tables),
            max_context_len=layout.max_context_len,
            window_slot_mapping=window_slots[0] if window_slots else None,
            window_block_tables=tables[:, width:] if window_slots else None,
            rows_share_sequences=layout.rows_share_sequences,
            decode_order=order,
        )
        return StepTensors(ids, feed, positions, metadata, rows, layout.total, layout.num_seqs)
