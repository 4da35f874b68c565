"""Continuous batching: each step picks work within a token budget.

Order of a step: running sequences that decode (one token each), then running sequences still in prefill
(chunked), then waiting sequences in arrival order (FCFS: a waiting request that does not fit blocks the
ones behind it; one whose next prefix block another running request is computing waits for that block). When
blocks run out, the newest running sequence is preempted by recompute: its blocks are freed and it goes back to
the head of the waiting queue; on resumption its full blocks usually still hit the prefix cache.

While several tenants have work (``Sequence.tenant``: who sent it), a step is shared fairly instead
(shared_step.py, fair_share.py): each tenant, least recently served first, spends its max-min share of a
step-time budget on its own decodes, prefill chunks and waiting requests (by ``priority``, then arrival); a heavy
tenant's rows take turns across steps; seats are shared too (a tenant over its share of ``max_num_seqs`` admits
nothing more, and gives seats back, newest first, to a tenant under its share); the victim of a block shortage is
the newest sequence of the tenant running the most.

The scheduler decides which work a step takes; where each sequence is and the moves between waiting, running and
swapped out are its queues' (run_queues.py, the class it extends).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from engine.core.block_manager import BlockManager
from engine.core.run_queues import RunQueues
from engine.core.scheduled_batch import ScheduledBatch
from engine.core.shared_step import SharedStep
from engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


# waiting requests passed over per step for sharing a prefix in progress
MAX_DEFERRED_PER_STEP = 256


class Scheduler(RunQueues):
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefer_swap: Callable[[Sequence], bool] | None = None,
        max_seqs_per_tenant: int | None = None,
        shared_step_time_factor: float = 0.0,
        step_time_target_s: float = 0.0,
    ) -> None:
        super().__init__(
            block_manager,
            max_num_seqs,
            max_num_batched_tokens,
            prefer_swap,
            max_seqs_per_tenant,
            step_time_target_s,
        )
        # while several tenants have work: a step's time budget, as a multiple of a one-row step (0: tokens)
        self.shared_step = SharedStep(shared_step_time_factor)

    def schedule(self) -> ScheduledBatch:
        chosen: dict[Sequence, int] = {}  # insertion-ordered
        preempted: list[Sequence] = []
        self.num_steps += 1
        if self.tiers is not None:
            self.tiers.poll()
        if len(self.tenants) > 1:
            self.shared_step.schedule(self, chosen, preempted)
        else:
            self._schedule_in_order(chosen, preempted)
        # decode rows first, each part in the order chosen (a stable partition, without a key call per row)
        decodes = [entry for entry in chosen.items() if entry[1] == 1]
        entries = decodes + [entry for entry in chosen.items() if entry[1] != 1]
        self.num_prefill_tokens += sum(n for _, n in entries if n > 1)
        swap_out, swap_in = self.block_manager.take_pending_swaps()
        return ScheduledBatch(
            seqs=[seq for seq, _ in entries],
            num_new_tokens=[n for _, n in entries],
            block_copies=self.block_manager.take_pending_copies(),
            window_copies=window.take_pending_copies()
            if (window := self.block_manager.window)
            else [],
            preempted=preempted,
            swap_out=swap_out,
            swap_in=swap_in,
            forks=self._forks(entries),
        )

    def defer_moves(self, batch: ScheduledBatch) -> None:
        """A scheduled batch that will not run (every entry of it ended first): its block moves run before the
        next one's, in their order."""
        blocks = self.block_manager
        blocks.pending_swap_out[:0] = batch.swap_out
        blocks.pending_copies[:0] = batch.block_copies
        blocks.pending_swap_in[:0] = batch.swap_in
        if blocks.window is not None:
            blocks.window.pending_copies[:0] = batch.window_copies

    def _schedule_in_order(self, chosen: dict[Sequence, int], preempted: list[Sequence]) -> None:
        """One tenant (or none): decodes, then prefill chunks, then swapped-in and waiting requests in order."""
        budget = self.solo_budget()
        # decodes (one uncomputed token, or none) first, each part in admission order
        running = [(s, len(s.token_ids) - s.num_computed_tokens > 1) for s in self.running]
        ordered = [s for s, prefill in running if not prefill] + [s for s, p in running if p]
        for seq in ordered:
            if budget == 0:
                break
            if (
                seq.status is not SequenceStatus.RUNNING
                or seq.awaiting_last_token
                or seq.awaiting_beam_step
            ):
                continue  # preempted as a victim earlier in this loop, or done computing
            budget = self.schedule_running(seq, budget, chosen, preempted)
        if not preempted:
            budget = self.swap_in(budget, chosen, preempted)
            if not self.swapped and not preempted:
                self._admit_waiting(budget, chosen)

    def _admit_waiting(self, budget: int, chosen: dict[Sequence, int]) -> None:
        """First come, first served, except that a request whose next uncached block is being computed by a
        running request (admitted in this step or earlier, its prompt not done yet) waits for it: admitted
        together, both would compute the shared prefix (the ``shared-prefix`` workload's burst: 16 requests
        per system prompt). It keeps its place at the head of the queue and is admitted, with the hit, once
        that block is cached; a preempted or finished owner no longer holds it back."""
        if not self.waiting:
            return  # (the common decode step: nothing to admit, no scan of the running batch)
        in_progress = self.blocks_in_progress()
        deferred: list[Sequence] = []
        try:
            self._admit_in_order(budget, chosen, in_progress, deferred)
        finally:
            self.waiting.extendleft(reversed(deferred))

    def _admit_in_order(
        self,
        budget: int,
        chosen: dict[Sequence, int],
        in_progress: set[bytes],
        deferred: list[Sequence],
    ) -> None:
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if len(self.running) + self.num_unforked + 1 + len(seq.unforked) > self.max_num_seqs:
                break  # (a request with n samples needs n places)
            if len(self.running) + self.num_unforked >= self.max_seqs_per_tenant:
                break  # (one tenant here: every running sequence is its own)
            hits = self.block_manager.match_prefix(seq)
            if len(hits) < len(seq.block_hashes) and seq.block_hashes[len(hits)] in in_progress:
                if len(deferred) >= MAX_DEFERRED_PER_STEP:
                    break
                deferred.append(self.waiting.popleft())
                continue
            num_new = min(seq.num_tokens - len(hits) * self.block_manager.block_size, budget)
            if not self.block_manager.allocate(seq, num_new, hits):
                if self.running or not self.block_manager.pins:
                    break
                # nothing runs and pinned presets hold the blocks it needs: they become ordinary cached blocks
                # (evictable, still hittable) rather than stall the engine for good
                released = self.block_manager.unpin_all()
                logger.warning(
                    "released %d pinned preset blocks under memory pressure (for %s)",
                    released,
                    seq.request_id,
                )
                continue
            self.waiting.popleft()
            self.start(seq, num_new, len(hits), chosen, in_progress)
            budget -= num_new
