"""ScheduledBatch: what one forward pass computes, as the scheduler (scheduler.py) decided it.

Its entries: each sequence with the number of its tokens the pass computes, decode rows (one token each) first,
then prefill chunks; the block moves that run before the pass (swap-outs, copy-on-write, swap-ins, in that
order on one stream); the sequences preempted to make room; and the samples forked from a parent whose prompt
the pass completes. ``sampling_seqs`` is fixed here, before the pass advances ``num_computed_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sequence import Sequence


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
    # (host, device) blocks copied in after CoW
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # parallel sampling: (parent, child) for each sample forked from a parent whose prompt this pass completes;
    # the child is sampled from its parent's logits row and shares its blocks from ``Scheduler.advance`` on
    forks: list[tuple[Sequence, Sequence]] = field(default_factory=list)
    # entries whose chunk reaches their last token, so the pass samples a new token for them (in order),
    # then the forked children; fixed at scheduling, before the pass advances num_computed_tokens
    sampling_seqs: list[Sequence] = field(init=False)

    def __post_init__(self) -> None:
        # (len(token_ids): num_tokens without a property call, per row per step)
        self.sampling_seqs = [
            seq
            for seq, n in zip(self.seqs, self.num_new_tokens)
            if seq.num_computed_tokens + n == len(seq.token_ids)
        ]
        self.sampling_seqs += [child for _, child in self.forks]

    @property
    def num_decodes(self) -> int:
        count = 0
        for n in self.num_new_tokens:
            if n != 1:
                break
            count += 1
        return count
