"""ScheduledBatch: what one forward pass computes, as the scheduler (scheduler.py) decided it.

Its entries: each sequence with the number of its tokens the pass computes, decode rows (one token each) first,
then prefill chunks; the block moves that run before the pass (swap-outs, swap-ins, copy-on-write, in that
order on one stream); the sequences preempted to make room; and the samples forked from a parent whose prompt
the pass completes. ``sampling_seqs`` is fixed here, before the pass advances ``num_computed_tokens``.

Speculative decoding (engine/speculative/): an entry with drafts is a decode of its last known token followed by
``k`` draft tokens (its ``1 + k`` tokens, drafts included in its ``token_ids``). The pass runs it as ``1 + k``
decode rows of the same sequence, row ``i`` at position ``start + i`` with a context of ``start + i + 1``: every
row's K and V are written before any row attends, so each row computes exactly what a plain decode step at that
position would. Every row is sampled; its sampler row is a stand-in for the sequence as it will be at that row
(its history up to the row: penalties, min_tokens and seeds see what plain decoding would). Those rows come after
the plain sampled rows and the forks, in ``drafts``' order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from engine.sequence import Sequence


def verify_rows(seq: Sequence, num_drafts: int) -> list[Sequence]:
    """The sampler's rows of a sequence verifying ``num_drafts`` drafts: row ``i`` is the sequence with its
    tokens up to the one row ``i`` predicts (its drafts are the last ``num_drafts`` of ``token_ids``)."""
    base = len(seq.token_ids) - num_drafts
    return [
        Sequence(
            seq_id=seq.seq_id,
            request_id=seq.request_id,
            token_ids=seq.token_ids[: base + i],
            params=seq.params,
            num_prompt_tokens=seq.num_prompt_tokens,
            index=seq.index,
        )
        for i in range(num_drafts + 1)
    ]


@dataclass(slots=True)
class ScheduledBatch:
    """What one forward pass computes. Single-token (decode-shaped) entries come first."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    # copy-on-write (src, dst) before the pass, and in the sliding-window layers' own pool
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    window_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # (device, host) blocks copied out first
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    # (host, device) blocks copied in after the swap-outs, before copy-on-write
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # parallel sampling: (parent, child) for each sample forked from a parent whose prompt this pass completes;
    # the child is sampled from its parent's logits row and shares its blocks from ``Scheduler.advance`` on
    forks: list[tuple[Sequence, Sequence]] = field(default_factory=list)
    # entries whose chunk reaches their last token, so the pass samples a new token for them (in order),
    # then the forked children; fixed at scheduling, before the pass advances num_computed_tokens
    sampling_seqs: list[Sequence] = field(init=False)
    # speculative decoding: entry -> its draft tokens (the last of its token_ids), verified by this pass; such
    # entries come right after the plain decode rows
    drafts: dict[Sequence, int] = field(default_factory=dict)
    # a drafted entry under a grammar: its verify rows' grammars (masks fixed before the pass), as its stand-ins hold
    draft_grammars: dict[Sequence, list[Any]] = field(default_factory=dict)
    # the sampled rows before the drafts' verify rows (plain entries and forks)
    num_plain_samples: int = field(init=False)

    def __post_init__(self) -> None:
        # (len(token_ids): num_tokens without a property call, per row per step)
        drafts = self.drafts
        self.sampling_seqs = [
            seq
            for seq, n in zip(self.seqs, self.num_new_tokens)
            if seq.num_computed_tokens + n == len(seq.token_ids)
            and (not drafts or seq not in drafts)
        ]
        self.sampling_seqs += [child for _, child in self.forks]
        self.num_plain_samples = len(self.sampling_seqs)
        for seq, num_drafts in drafts.items():
            rows = verify_rows(seq, num_drafts)
            for row, grammar in zip(rows, self.draft_grammars.get(seq, ())):
                row.grammar = grammar
            self.sampling_seqs += rows

    def without_finished(self) -> ScheduledBatch:
        """The batch less the entries that finished after it was scheduled (async scheduling: the step in flight,
        read before this one launched, ended them; their blocks are free, and cached ones may be hit: nothing
        may write them), and less the forks of those."""
        if not any(seq.is_finished for seq in self.seqs):
            return self
        kept = [(seq, n) for seq, n in zip(self.seqs, self.num_new_tokens) if not seq.is_finished]
        return dataclasses.replace(
            self,
            seqs=[seq for seq, _ in kept],
            num_new_tokens=[n for _, n in kept],
            forks=[(parent, child) for parent, child in self.forks if not parent.is_finished],
        )

    @property
    def plain_samples(self) -> list[Sequence]:
        """The sampled sequences of the plain entries and forks (one row each, before the drafts' rows)."""
        return self.sampling_seqs[: self.num_plain_samples] if self.drafts else self.sampling_seqs

    def plain_entries(self) -> list[tuple[Sequence, int]]:
        """After the pass: the entries not finished and without drafts, each with the tokens it computed (a
        drafted entry advances by what its verification keeps)."""
        drafts = self.drafts
        return [
            (seq, n)
            for seq, n in zip(self.seqs, self.num_new_tokens)
            if not seq.is_finished and not (drafts and seq in drafts)
        ]

    @property
    def num_decodes(self) -> int:
        """Leading single-token entries (plain decodes)."""
        count = 0
        for n in self.num_new_tokens:
            if n != 1:
                break
            count += 1
        return count

    @property
    def num_decode_rows(self) -> int:
        """The pass's decode-shaped rows: the plain decodes, then each drafted entry's ``1 + k`` rows."""
        return self.num_decodes + sum(n + 1 for n in self.drafts.values())

    @property
    def num_rows(self) -> int:
        """The pass's rows (a prefill chunk is one): decode rows, then the prefill chunks."""
        return len(self.seqs) + sum(self.drafts.values())

    def rows(self) -> tuple[list[Sequence], list[int], list[int]]:
        """Each row's sequence, its first token's offset past the sequence's computed tokens, and its tokens: the
        entries as they are, a drafted entry as ``1 + k`` single-token rows."""
        if not self.drafts:
            return self.seqs, [0] * len(self.seqs), self.num_new_tokens
        seqs: list[Sequence] = []
        offsets: list[int] = []
        counts: list[int] = []
        drafts = self.drafts
        for seq, n in zip(self.seqs, self.num_new_tokens):
            if seq in drafts:
                seqs += [seq] * n
                offsets += range(n)
                counts += [1] * n
            else:
                seqs.append(seq)
                offsets.append(0)
                counts.append(n)
        return seqs, offsets, counts
