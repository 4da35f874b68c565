"""RunQueues: where each of the scheduler's sequences is (waiting, running, swapped out), the seats they hold, and
the moves a step makes between those places.

The moves: admit a waiting request with its prefix hit (``start``); give a running sequence the slots of its next
chunk, preempting when blocks run out (``schedule_running``, ``victim``, ``preempt``: swapped out with its request's
other sequences, or dropped and recomputed later); bring swapped-out requests back (``swap_in``); release forked
samples into the batch; commit a pass's KV (``advance``); end a sequence wherever it is (``finish``). Which moves a
step makes is the scheduler's choice (scheduler.py: one tenant's step in order; shared_step.py: a step shared among
tenants); which blocks a sequence holds is the block manager's. The queues also hold the limits both ways of
filling a step obey (seats, tokens per step) and the step's cost model, with the token budget of a step of one
tenant (``solo_budget``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable

from engine.core.block_manager import BlockManager
from engine.core.step_cost import StepCostModel
from engine.core.tier_blocks import TierBlocks
from engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


class RunQueues:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefer_swap: Callable[[Sequence], bool] | None = None,
        max_seqs_per_tenant: int | None = None,
        step_time_target_s: float = 0.0,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_seqs_per_tenant = max_seqs_per_tenant or max_num_seqs
        # any step's measured time, within reason (0: none)
        self.step_time_target_s = step_time_target_s
        self.step_cost = StepCostModel()  # fed by the engine with each step's shape and time
        # tenant -> its unfinished sequences here (unforked samples too)
        self.tenants: Counter[str] = Counter()
        self.num_steps = 0
        # per victim: swap its blocks to the host pool (True) or drop them and recompute (False)
        self.prefer_swap = prefer_swap or (lambda seq: False)
        # swapped out, in order: they come back before new requests
        self.swapped: deque[Sequence] = deque()
        self.num_swap_outs = 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last one is the newest
        self.num_preemptions = 0
        # tokens of the prefill chunks scheduled (prompts, recomputes): the prompt tok/s the engine achieves
        self.num_prefill_tokens = 0
        # samples of running parents, not forked yet: they hold places in the batch
        self.num_unforked = 0
        # the KV tiers below the host (disk, Redis): None when off
        self.tiers: TierBlocks | None = None

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self.tenants[seq.tenant] += 1 + len(seq.unforked)
        if self.tiers is not None and self.block_manager.enable_prefix_caching:
            # (its prompt's blocks that a lower tier holds start coming back while it waits)
            self.block_manager.update_block_hashes(seq)
            self.tiers.fetch(
                seq.block_hashes, (seq.num_tokens - 1) // self.block_manager.block_size
            )

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def solo_budget(self) -> int:
        """Tokens of a step of one tenant: the step's token budget, cut to ``step_time_target_s`` of measured time
        only while a stream decodes beside the prefill (its next token waits for the step); the cut never takes
        a prefill chunk below the efficient chunk (step_cost.py), and every decode row still runs. A prompt with
        no stream beside it prefills at the machine's speed: a request already waiting gains nothing from
        shorter steps (it is admitted after the prompts ahead of it, or with its tenant's share of this step)."""
        if not self.step_time_target_s or (prices := self.step_cost.prices()) is None:
            return self.max_num_batched_tokens
        decodes = sum(seq.num_uncomputed_tokens == 1 for seq in self.running)
        if not decodes:
            return self.max_num_batched_tokens
        tokens = max(
            prices.tokens_within(self.step_time_target_s, prefill=True),
            decodes + prices.efficient_chunk(self.block_manager.block_size),
        )
        return min(self.max_num_batched_tokens, tokens)

    def victim(self) -> Sequence:
        """Who gives up its blocks when they run out: the newest running sequence (of the tenant with the most
        running sequences, when several have work)."""
        if len(self.tenants) <= 1:
            return self.running[-1]
        counts = Counter(seq.tenant for seq in self.running)
        holder = max(counts.items(), key=lambda item: item[1])[0]
        return next(seq for seq in reversed(self.running) if seq.tenant == holder)

    def swap_in(self, budget: int, chosen: dict[Sequence, int], preempted: list[Sequence]) -> int:
        """Swapped-out requests come back first, in order, each with all its swapped sequences (sharing their
        blocks again), once their blocks (and one more per sequence) fit."""
        manager = self.block_manager
        while self.swapped and budget > 0:
            group = [s for s in self.swapped if s.request_id == self.swapped[0].request_id]
            unforked = sum(len(seq.unforked) for seq in group)
            if len(self.running) + self.num_unforked + len(group) + unforked > self.max_num_seqs:
                break
            # (a block to spare for each next token)
            if not manager.can_swap_in(*group, spare=len(group)):
                if self.running:
                    break
                if manager.pins:  # nothing else runs: pins give way, as for a waiting request
                    released = manager.unpin_all()
                    logger.warning(
                        "released %d pinned preset blocks under memory pressure (for %s)",
                        released,
                        group[0].request_id,
                    )
                    continue
                if not manager.can_swap_in(*group):
                    break
            manager.swap_in(*group)
            for seq in group:
                self.swapped.remove(seq)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                self.num_unforked += len(seq.unforked)
            for seq in group:
                if seq.status is SequenceStatus.RUNNING and not (
                    seq.awaiting_last_token or seq.awaiting_beam_step
                ):
                    budget = self.schedule_running(seq, budget, chosen, preempted)
            if preempted:
                break
        return budget

    def _forks(self, entries: list[tuple[Sequence, int]]) -> list[tuple[Sequence, Sequence]]:
        """Parents whose prompt this pass completes release their samples into the running batch."""
        forks = []
        for seq, n in entries:
            if (
                seq.unforked
                and not seq.params.use_beam_search
                and seq.num_computed_tokens + n == seq.num_tokens
            ):
                for child in seq.unforked:
                    child.status = SequenceStatus.RUNNING
                    child.first_scheduled_time = seq.first_scheduled_time
                    self.running.append(child)
                    forks.append((seq, child))
                self.num_unforked -= len(seq.unforked)
                seq.unforked = []
        return forks

    def schedule_running(
        self,
        seq: Sequence,
        budget: int,
        chosen: dict[Sequence, int],
        preempted: list[Sequence],
        limit: int | None = None,
    ) -> int:
        num_new = min(seq.num_uncomputed_tokens, budget, limit or budget)
        if num_new == 0:
            # (the step's budget is spent: it runs next step; an entry of 0 tokens is no row)
            return budget
        while not self.block_manager.allocate(seq, num_new):
            for victim in self.preempt(self.victim()):
                budget += chosen.pop(victim, 0)
                preempted.append(victim)
            # preempted itself (or with its request's others)
            if seq.status is not SequenceStatus.RUNNING:
                return budget
        chosen[seq] = num_new
        return budget - num_new

    def blocks_in_progress(self) -> set[bytes]:
        """Hashes of the full blocks that running sequences still have to compute (prefix caching only), and those
        coming back from a lower KV tier."""
        size = self.block_manager.block_size
        computing = {
            h
            for seq in self.running
            if seq.num_uncomputed_tokens > 1
            for h in seq.block_hashes[seq.num_computed_tokens // size :]
        }
        return computing | self.tiers.loading.keys() if self.tiers is not None else computing

    def start(
        self,
        seq: Sequence,
        num_new: int,
        num_hits: int,
        chosen: dict[Sequence, int],
        in_progress: set[bytes],
    ) -> None:
        """An admitted request joins the running batch with ``num_new`` tokens this step."""
        if seq.num_cached_tokens < 0:
            seq.num_cached_tokens = seq.num_computed_tokens
            seq.first_scheduled_time = time.monotonic()
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self.num_unforked += len(seq.unforked)
        chosen[seq] = num_new
        in_progress.update(seq.block_hashes[num_hits:])

    def start_beams(self, parent: Sequence) -> None:
        """Beam search: after the prompt's step, the request's other beams (held as ``parent.unforked``) run."""
        for beam in parent.unforked:
            beam.status = SequenceStatus.RUNNING
            beam.first_scheduled_time = parent.first_scheduled_time
            self.running.append(beam)
        self.num_unforked -= len(parent.unforked)
        parent.unforked = []

    def preempt(self, seq: Sequence, allow_swap: bool = True) -> list[Sequence]:
        """Preempt ``seq``: swapped out together with its request's other running sequences (samples or beams
        sharing blocks: the paper's rule, all or nothing), or recomputed later alone. Returns the preempted."""
        if allow_swap and self.prefer_swap(seq):
            group = [s for s in self.running if s.request_id == seq.request_id]
            # (a request holding every running sequence would come back to the same shortage: one recomputes)
            if len(group) < len(self.running) and self.block_manager.can_swap_out(*group):
                for victim in group:
                    self.running.remove(victim)
                    self.num_unforked -= len(victim.unforked)  # they wait with their parent
                    victim.num_preemptions += 1
                    victim.status = SequenceStatus.SWAPPED
                    self.swapped.append(victim)
                self.block_manager.swap_out(*group)
                self.num_preemptions += len(group)
                self.num_swap_outs += len(group)
                logger.info(
                    "preempted %s (%d sequences swapped out, %d host blocks; %d free)",
                    seq.request_id,
                    len(group),
                    len({b for v in group for b in v.host_blocks}),
                    self.block_manager.num_free_blocks,
                )
                return group
        self.running.remove(seq)
        self.num_unforked -= len(seq.unforked)  # they wait with their parent
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.awaiting_beam_step = False  # (a beam recomputes its logits once admitted again)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        logger.info(
            "preempted %s (recompute of %d tokens; %d free blocks)",
            seq.request_id,
            seq.num_tokens,
            self.block_manager.num_free_blocks,
        )
        return [seq]

    def advance(
        self, entries: list[tuple[Sequence, int]], forks: list[tuple[Sequence, Sequence]] = ()
    ) -> None:
        """After the forward pass: each entry's ``n`` tokens now have KV; register newly full blocks; forked
        samples share their parent's blocks (the partly filled last one is copied on their first write)."""
        for seq, n in entries:
            seq.num_computed_tokens += n
            self.block_manager.commit(seq)
        for parent, child in forks:
            if not child.is_finished:
                self.block_manager.fork(parent, child)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End ``seq`` (stopped, length or aborted) wherever it is, and free its blocks."""
        if not seq.is_finished:
            self.tenants[seq.tenant] -= 1
            if self.tenants[seq.tenant] <= 0:
                del self.tenants[seq.tenant]
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.num_unforked -= len(seq.unforked)
        # (else: a sample never forked)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            self.block_manager.drop_host_blocks(seq)
        if seq.retain and self.tiers is not None:
            self.tiers.save(seq)
        self.block_manager.free(seq)
        seq.status = status
