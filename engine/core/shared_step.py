"""The shared step: how the scheduler (scheduler.py) fills a step while several tenants have work.

Each tenant, least recently served first, spends its max-min share (fair_share.py) of the step's tokens on its
decode rows (by priority, then those that waited longest: a heavy tenant's rows take turns across steps), its
prefill chunks, then its waiting requests (by priority, then arrival). The step's tokens come from a time budget
once the step's cost is measured (step_cost.py): steps take on average at most ``shared_step_time_factor`` x a
one-token step (while prompts wait, at least a row per tenant plus an eighth of a step with prefill); a step with
prefill, dearer, runs once enough credit is saved. Seats are shared too: a tenant at or
over its equal share of ``max_num_seqs`` admits nothing more, and gives seats back (its newest sequences,
recomputed later) to a tenant under its share.

The scheduler (scheduler.py) holds one ``SharedStep`` and hands it its run queues (run_queues.py) for each shared
step: the queues' moves (admit, schedule a chunk, swap in, preempt) are theirs; what is the shared step's own is its
state across steps, the tenants' recent service and the time credit.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from engine.core.fair_share import TenantService, max_min_shares
from engine.core.run_queues import RunQueues
from engine.core.step_cost import StepPrices
from engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class _TenantWork:
    """One tenant's runnable work in a shared step, and the seats it holds."""

    # running, to decode or to prefill (a chunk)
    runnable: list[Sequence] = field(default_factory=list)
    waiting: list[Sequence] = field(default_factory=list)
    seats: int = 0

    def demand(self, prefill: bool) -> int:
        """Tokens all of it would compute (a decode row is one; prefill only where the step takes it)."""
        if not prefill:
            return sum(seq.num_uncomputed_tokens == 1 for seq in self.runnable)
        tokens = sum(seq.num_uncomputed_tokens for seq in self.runnable)
        return tokens + sum(seq.num_tokens - seq.num_computed_tokens for seq in self.waiting)


def num_tokens_for_prefill(num_tenants: int, prices: StepPrices, queues: RunQueues) -> int:
    """A shared step computes prefill only with room for a row per tenant and an efficient chunk of prompt
    (step_cost.py: never a block whose step is nearly all fixed cost), within the step's token budget."""
    chunk = prices.efficient_chunk(queues.block_manager.block_size)
    return min(num_tenants + chunk, max(queues.max_num_batched_tokens, num_tenants + 1))


# a shared step may save up this many paces of time (for a dearer step with prefill)
MAX_CREDIT_STEPS = 8


class SharedStep:
    """How a step is filled while several tenants have work (the module docstring), and what that needs to remember
    from step to step."""

    def __init__(self, time_factor: float = 0.0) -> None:
        # a step's time budget, as a multiple of a one-row step (0: the step's token budget)
        self.time_factor = time_factor
        self._service = TenantService()
        # seconds a shared step may spend beyond its pace (saved by cheaper steps)
        self._credit = 0.0

    def schedule(
        self, queues: RunQueues, chosen: dict[Sequence, int], preempted: list[Sequence]
    ) -> None:
        """Several tenants have work: swapped-out requests come back first, then each tenant, least recently
        served first, spends its fair share of the step (fair_share.py) on its decode rows (by priority, then
        those that waited longest), its prefill chunks, then its waiting requests (by priority, then arrival)."""
        work = _work_by_tenant(queues)
        prefill_wanted = any(
            w.waiting or any(seq.num_uncomputed_tokens > 1 for seq in w.runnable)
            for w in work.values()
        )
        streaming = any(seq.num_uncomputed_tokens == 1 for w in work.values() for seq in w.runnable)
        if streaming:
            tokens, prefill = self._budget(queues, len(work), prefill_wanted)
        else:  # (no stream to keep at pace: prompts only, within the solo step's time)
            tokens, prefill = queues.solo_budget(), True
        budget = tokens = queues.swap_in(tokens, chosen, preempted)
        shares = max_min_shares({tenant: w.demand(prefill) for tenant, w in work.items()}, tokens)
        seat_share = max(1, min(queues.max_seqs_per_tenant, queues.max_num_seqs // len(work)))
        in_progress = queues.blocks_in_progress() if queues.waiting else set()
        spent: dict[str, float] = {}
        for tenant in self._service.order(work):
            if tokens == 0 or preempted:
                break
            before = tokens
            tokens = _serve_tenant(
                queues,
                work[tenant],
                int(shares[tenant]),
                tokens,
                prefill,
                seat_share,
                chosen,
                preempted,
                in_progress,
            )
            spent[tenant] = before - tokens
        for seq in chosen:
            seq.last_step = queues.num_steps
        self._service.record(spent)
        if (prices := queues.step_cost.prices()) is not None:
            computed = any(n > 1 or seq.num_uncomputed_tokens > 1 for seq, n in chosen.items())
            spent_s = prices.cost(budget - tokens, computed)
            self._credit = max(self._credit - spent_s, -MAX_CREDIT_STEPS * prices.fixed)

    def _budget(
        self, queues: RunQueues, num_tenants: int, prefill_wanted: bool
    ) -> tuple[int, bool]:
        """Tokens of a shared step, and whether it may compute prefill. Once the step's cost is measured, steps
        take on average at most ``time_factor`` x a one-token step (the pace): a decode-only step stays within
        the pace; a step with prefill, dearer, runs once enough credit is saved, decode-only steps meanwhile
        keeping half their slack for it. At least one token per tenant. While prompts wait, a step earns at
        least the least step (a row per tenant) plus an eighth of the cheapest step with prefill: where a row per
        tenant already costs more than the pace (a token's own work well above the step's fixed cost, as on the
        CPU at long contexts), decode-only steps would spend all they earn and a new request wait for good."""
        prices = queues.step_cost.prices()
        if prices is None or not self.time_factor:
            return queues.max_num_batched_tokens, True
        pace = self.time_factor * prices.one_token_step()
        least = num_tokens_for_prefill(num_tenants, prices, queues)
        earned = pace
        if prefill_wanted:
            floor = prices.cost(num_tenants, False)
            earned = max(pace, floor + (prices.cost(least, True) - floor) / MAX_CREDIT_STEPS)
        # (the bank holds at least the cheapest step with prefill: whatever its price, prefill gets its turn)
        self._credit = min(
            self._credit + earned, max(MAX_CREDIT_STEPS * pace, prices.cost(least, True))
        )
        if prefill_wanted:
            tokens = prices.tokens_within(self._credit, prefill=True)
            if tokens >= least:
                return min(queues.max_num_batched_tokens, tokens), True
            pace = (pace + prices.one_token_step()) / 2
        tokens = max(prices.tokens_within(pace), num_tenants)
        return min(queues.max_num_batched_tokens, tokens), False


def _work_by_tenant(queues: RunQueues) -> dict[str, _TenantWork]:
    work = {tenant: _TenantWork() for tenant in queues.tenants}
    for seq in queues.running:
        entry = work[seq.tenant]
        entry.seats += 1 + len(seq.unforked)
        if (
            seq.status is not SequenceStatus.RUNNING
            or seq.awaiting_last_token
            or seq.awaiting_beam_step
        ):
            continue
        entry.runnable.append(seq)
    for seq in queues.waiting:
        work[seq.tenant].waiting.append(seq)
    for entry in work.values():
        # decode rows first (a stream steps every time), those that waited longest first; then prefill chunks
        entry.runnable.sort(
            key=lambda seq: (seq.num_uncomputed_tokens > 1, seq.priority, seq.last_step)
        )
        # (stable: arrival order within a priority)
        entry.waiting.sort(key=lambda seq: seq.priority)
    return work


def _serve_tenant(
    queues: RunQueues,
    work: _TenantWork,
    share: int,
    tokens: int,
    prefill: bool,
    seat_share: int,
    chosen: dict[Sequence, int],
    preempted: list[Sequence],
    in_progress: set[bytes],
) -> int:
    """One tenant's part of a shared step (up to ``share`` tokens, at least one; prefill chunks and new
    requests only where ``prefill``); returns the step's tokens left."""
    left = min(max(share, 1), tokens)
    for seq in work.runnable:
        if left == 0 or preempted:
            return tokens
        if seq.status is SequenceStatus.RUNNING and (prefill or seq.num_uncomputed_tokens == 1):
            # (else preempted as a victim in this step, or a prefill chunk in a decode-only step)
            before = tokens
            tokens = queues.schedule_running(seq, tokens, chosen, preempted, left)
            left = max(left - (before - tokens), 0)
    if queues.swapped or preempted or not prefill:
        return tokens
    for seq in work.waiting:
        left = min(left, tokens)
        if left == 0 or work.seats >= seat_share:
            break
        num_new = _admit_one(queues, seq, left, seat_share, chosen, preempted, in_progress)
        if num_new is None:
            break
        if num_new == 0:
            continue  # (waits for a prefix block another request computes)
        work.seats += 1 + len(seq.unforked)
        tokens, left = tokens - num_new, left - num_new
    return tokens


def _admit_one(
    queues: RunQueues,
    seq: Sequence,
    limit: int,
    seat_share: int,
    chosen: dict[Sequence, int],
    preempted: list[Sequence],
    in_progress: set[bytes],
) -> int | None:
    """Admit one waiting request of a shared step with up to ``limit`` tokens: 0 when it waits for a prefix
    block in progress (the next of its tenant may go), None when it cannot run now (nor those behind it)."""
    need = 1 + len(seq.unforked)
    if len(queues.running) + queues.num_unforked + need > queues.max_num_seqs:
        if not _yield_seats(queues, need, seq.tenant, seat_share, chosen, preempted):
            return None
    hits = queues.block_manager.match_prefix(seq)
    if len(hits) < len(seq.block_hashes) and seq.block_hashes[len(hits)] in in_progress:
        return 0
    num_new = min(seq.num_tokens - len(hits) * queues.block_manager.block_size, limit)
    if not queues.block_manager.allocate(seq, num_new, hits):
        return None
    queues.waiting.remove(seq)
    queues.start(seq, num_new, len(hits), chosen, in_progress)
    return num_new


def _yield_seats(
    queues: RunQueues,
    need: int,
    tenant: str,
    seat_share: int,
    chosen: dict[Sequence, int],
    preempted: list[Sequence],
) -> bool:
    """Seats for a tenant under its share: the newest sequences of the tenant holding the most seats, over
    its share, are preempted (recompute) until ``need`` seats are free. False when no tenant is over."""
    while len(queues.running) + queues.num_unforked + need > queues.max_num_seqs:
        seats = Counter()
        for seq in queues.running:
            seats[seq.tenant] += 1 + len(seq.unforked)
        holder, held = max(seats.items(), key=lambda item: item[1], default=("", 0))
        if holder == tenant or held <= seat_share:
            return False
        victim = next(seq for seq in reversed(queues.running) if seq.tenant == holder)
        chosen.pop(victim, None)
        preempted += queues.preempt(victim, allow_swap=False)
    return True
