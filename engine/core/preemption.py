"""Which way a preempted sequence comes back (``preemption_mode``): its KV swapped out to the host and back, or
dropped and computed again.

``auto``: a sample of a request with n > 1 (or best_of) or a beam is swapped, with all its request's running
sequences (the paper's rule: they share their history, and the host keeps one copy of each shared block);
otherwise the cheaper of the copy out and back over the host link and the recompute of its tokens, by rough
device rates. Where the host pool has no room, the scheduler recomputes the victim anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.sequence import Sequence

# rough rates: host link bytes/s and achievable FLOP/s, by device type
_RATES = {"cuda": (25e9, 4e14), "cpu": (5e9, 2e11)}


@dataclass(frozen=True, slots=True)
class SwapPolicy:
    mode: str  # recompute | swap | auto
    device_type: str
    bytes_per_block: int
    num_parameters: int

    def __call__(self, seq: Sequence) -> bool:
        """Swap (True) or recompute (False) this victim."""
        if self.mode == "recompute":
            return False
        if self.mode == "swap" or seq.params.num_sequences > 1 or seq.params.use_beam_search:
            return True
        link, flops = _RATES.get(self.device_type, _RATES["cpu"])
        copy_seconds = 2 * len(seq.block_table) * self.bytes_per_block / link
        recompute_seconds = 2 * self.num_parameters * seq.num_computed_tokens / flops
        return copy_seconds < recompute_seconds
