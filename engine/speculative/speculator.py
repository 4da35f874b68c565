"""The speculator: drafts for a scheduled batch's decode rows before the pass, and their verification after it.

``extend`` runs after the scheduler: for each decode row that may speculate (speculation on, the row's request not
beam search or under a grammar, the batch at most ``speculative_max_batch`` decode rows) it asks the sequence's
n-gram index for drafts, as many as draft_length.py finds worth their rows, within the step's token budget, the
sequence's length limit and the blocks free (drafts never preempt anyone, nor take the pool's last eighth), appends them to the sequence's
``token_ids`` and moves its entry after the plain decodes with ``1 + k`` tokens. ``accept`` compares a verified
sequence's drafts with its rows' samples and takes the drafts back out of its ``token_ids``; the engine then
appends the tokens kept (engine/runtime/speculative_steps.py).
"""

from __future__ import annotations

from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.core.metrics import EngineCounters
from engine.core.scheduled_batch import ScheduledBatch
from engine.core.step_cost import StepCostModel
from engine.sequence import Sequence
from engine.speculative.draft_length import (
    DEFAULT_ROW_COST,
    MAX_PROBE_AFTER,
    PROBE_AFTER,
    Speculation,
    choose_draft_length,
    expected_tokens,
)
from engine.speculative.grammar_drafts import FixedMask, grammar_rows
from engine.speculative.ngram import NgramIndex
from engine.worker.draft_model import DraftModel


class Speculator:
    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        step_cost: StepCostModel,
        counters: EngineCounters,
        vocab_size: int,
        draft: DraftModel | None = None,
    ) -> None:
        """``vocab_size``: the logits' width (a grammar's verify rows' masks); ``draft``: the draft model that
        proposes (speculative="draft"), else each sequence's n-gram index does."""
        self.num_tokens = config.num_speculative_tokens
        self.max_batch = config.speculative_max_batch
        self.token_budget = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.block_manager, self.step_cost = block_manager, step_cost
        self.counters = counters
        self.vocab_size = vocab_size
        self.draft = draft

    def extend(self, batch: ScheduledBatch) -> ScheduledBatch:
        """``batch`` with drafts for the decode rows that speculate this step (itself when none do). A row whose
        last token is still pending (async scheduling: sampled by the step in flight) gets none."""
        num_decodes = batch.num_decodes
        if not num_decodes or num_decodes > self.max_batch or self._short_of_blocks():
            return batch
        room = self.token_budget - sum(batch.num_new_tokens)
        step_tokens, step_seconds, row_seconds = self._step_estimate(batch)
        drafts: dict[Sequence, int] = {}
        grammars: dict[Sequence, list[FixedMask]] = {}
        # (a one-token last prompt chunk is decode-shaped: its samples fork from its plain row)
        parents = {parent for parent, _ in batch.forks}
        wanted: list[tuple[Sequence, int]] = []  # (the draft model's: proposed for all at once)
        for seq in batch.seqs[:num_decodes]:
            state = self._state(seq)
            if state is None or room <= 0 or seq.num_pending_tokens or seq.is_finished:
                continue
            if parents and seq in parents:
                continue
            k = self._draft_length(
                seq, min(room, self.num_tokens), step_tokens, step_seconds, row_seconds
            )
            if self.draft is None:
                tokens = state.index.propose(seq.token_ids, len(seq.token_ids), k, state.context)
                tokens = tokens[: self._writable(seq, len(tokens))]
                if not (k := self._take(seq, tokens, drafts, grammars, allocate=True)):
                    continue
            elif (k := min(k, self._writable(seq, k))) and self.block_manager.allocate(seq, 1 + k):
                wanted.append((seq, k))  # (its blocks first: the draft model writes KV in them)
            else:
                state.skipped += 1
                continue
            room -= k
            step_tokens += expected_tokens(state.rate, k) - 1
            step_seconds += row_seconds * k
        if wanted:
            self._propose_from_model(wanted, drafts, grammars)
        if not drafts:
            return batch
        return _with_drafts(batch, num_decodes, drafts, grammars)

    def _propose_from_model(
        self,
        wanted: list[tuple[Sequence, int]],
        drafts: dict[Sequence, int],
        grammars: dict[Sequence, list[FixedMask]],
    ) -> None:
        """The draft model's proposals for ``wanted`` (sequence, drafts), each from the positions its draft KV
        holds right (none after a preemption: its blocks were recomputed or swapped without the draft's)."""
        known = []
        for seq, _ in wanted:
            state = seq.speculation
            if state.draft_preemptions != seq.num_preemptions:
                state.draft_known, state.draft_preemptions = 0, seq.num_preemptions
            known.append(state.draft_known)
        proposals = self.draft.propose([seq for seq, _ in wanted], [k for _, k in wanted], known)
        for (seq, k), tokens in zip(wanted, proposals):
            state = seq.speculation
            # (its last token's KV is right now; the drafts' where the verification keeps them: accept)
            state.draft_known = seq.num_computed_tokens + 1
            self._take(seq, tokens, drafts, grammars, allocate=False)

    def _draft_length(
        self, seq: Sequence, limit: int, step_tokens: float, step_seconds: float, row_seconds: float
    ) -> int:
        """Drafts for ``seq`` in the step so far (choose_draft_length within its length limit, or a probe)."""
        state = seq.speculation
        limit = min(limit, self._length_room(seq))
        k = choose_draft_length(state, limit, step_tokens, step_seconds, row_seconds)
        if k == 0 and limit > 0 and state.skipped >= state.probe_after:
            k = 1  # (a probe: its rate is low, but its text may have turned repetitive)
        return k

    def _take(
        self,
        seq: Sequence,
        tokens: list[int],
        drafts: dict[Sequence, int],
        grammars: dict[Sequence, list[FixedMask]],
        allocate: bool,
    ) -> int:
        """Make ``tokens`` (cut to the run its grammar accepts) ``seq``'s drafts, its blocks for them allocated
        (``allocate``) or already; how many (0: none, the sequence skips a step)."""
        masks = None
        if tokens and seq.grammar is not None:
            masks = grammar_rows(seq.grammar, tokens, self.vocab_size)
            tokens = tokens if masks is not None else []
        if not tokens or (allocate and not self.block_manager.allocate(seq, 1 + len(tokens))):
            seq.speculation.skipped += 1
            return 0
        seq.token_ids.extend(tokens)
        drafts[seq] = len(tokens)
        if masks is not None:
            grammars[seq] = masks
        return len(tokens)

    def wants_known(self, batch: ScheduledBatch) -> bool:
        """Async scheduling: whether some decode row would get drafts once its pending token is known (its known
        tokens' suffix has an n-gram match, which the pending token most likely continues, and its acceptance makes
        drafts worth their rows). The engine then reads the step in flight before this one (a step with drafts
        runs in step with the host); otherwise the step runs without drafts, overlapped as usual."""
        num_decodes = batch.num_decodes
        if not num_decodes or num_decodes > self.max_batch or self._short_of_blocks():
            return False
        step_tokens, step_seconds, row_seconds = self._step_estimate(batch)
        for seq in batch.seqs[:num_decodes]:
            state = self._state(seq)
            if state is None or not seq.num_pending_tokens:
                continue
            worth = state.skipped >= state.probe_after or choose_draft_length(
                state, self.num_tokens, step_tokens, step_seconds, row_seconds
            )
            if worth and (
                self.draft is not None
                or state.index.propose(seq.token_ids, seq.num_known_tokens, 1, state.context)
            ):
                return True
            state.skipped += 1
        return False

    def _short_of_blocks(self) -> bool:
        """Free blocks at or below the pool's reserve (an eighth): drafts wait rather than take the blocks a
        prompt or a sequence's next token may need."""
        blocks = self.block_manager
        return blocks.num_free_blocks <= blocks.lookahead_reserve

    def _step_estimate(self, batch: ScheduledBatch) -> tuple[float, float, float]:
        """The step's expected tokens and seconds without drafts, and a draft row's seconds (the learned step
        prices; before they are known, a step's fixed cost is 1 and a row DEFAULT_ROW_COST)."""
        tokens = sum(batch.num_new_tokens)
        prices = self.step_cost.prices()
        if prices is None:
            return (
                float(len(batch.sampling_seqs)),
                1.0 + DEFAULT_ROW_COST * tokens,
                DEFAULT_ROW_COST,
            )
        prefill = batch.num_decodes < len(batch.seqs)
        # (a draft model's draft costs its verify row and a propose pass; more rows share the passes)
        row_seconds = prices.per_token + (self.draft.pass_seconds if self.draft else 0.0)
        return float(len(batch.sampling_seqs)), prices.cost(tokens, prefill), row_seconds

    def accept(self, seq: Sequence, num_drafts: int, sampled: list[int]) -> list[int]:
        """The tokens a verified sequence gains: its drafts while each equals the sample of the row before it, then
        the sample of the first row that differs (or of the last row). Its drafts leave its ``token_ids``."""
        drafts = seq.token_ids[-num_drafts:]
        del seq.token_ids[-num_drafts:]
        kept = 0
        while kept < num_drafts and drafts[kept] == sampled[kept]:
            kept += 1
        state = seq.speculation
        state.record(num_drafts, kept)
        if self.draft is not None:
            # the draft model's KV of the kept drafts is right (its passes wrote all but the last draft's; the
            # sequence has not advanced yet: its last token is still at num_computed_tokens)
            state.draft_known = seq.num_computed_tokens + 1 + min(kept, num_drafts - 1)
            # (a missed one-draft probe: the next one later; a kept draft: probes as usual)
            missed_probe = num_drafts == 1 and not kept
            state.probe_after = (
                min(2 * state.probe_after, MAX_PROBE_AFTER) if missed_probe else PROBE_AFTER
            )
        counters = self.counters
        counters.spec_verifications += 1
        counters.spec_draft_tokens += num_drafts
        counters.spec_accepted_tokens += kept
        return drafts[:kept] + [sampled[kept]]

    def _state(self, seq: Sequence) -> Speculation | None:
        """The sequence's speculative state (made on its first decode), or None where it may not speculate."""
        state = seq.speculation
        if state is None:
            params = seq.params
            if not params.speculative or params.use_beam_search:
                return None
            if self.draft is not None:  # (no n-gram index: the draft model proposes)
                state = seq.speculation = Speculation(None)
                return state
            context = None
            if params.speculative_context:  # (indexed as proposals go, UPDATE_BUDGET a step)
                context = (
                    NgramIndex.over(len(params.speculative_context)),
                    params.speculative_context,
                )
            state = seq.speculation = Speculation(NgramIndex.over(len(seq.token_ids)), context)
        return state

    def _length_room(self, seq: Sequence) -> int:
        """Drafts that fit its length limit with the step's one more token."""
        limit = self.max_model_len
        if seq.params.max_tokens is not None:
            limit = min(limit, seq.num_prompt_tokens + seq.params.max_tokens)
        return limit - len(seq.token_ids) - 1

    def _writable(self, seq: Sequence, num_drafts: int) -> int:
        """Drafts whose KV lands in blocks the sequence alone holds (or will take fresh): a block it shares
        after a fork is copied only where its next token is written (BlockManager.allocate)."""
        size, table, pool = self.block_manager.block_size, seq.block_table, self.block_manager.pool
        start = seq.num_computed_tokens
        for index in range(start // size + 1, (start + num_drafts) // size + 1):
            if index < len(table) and pool.blocks[table[index]].ref_count > 1:
                return index * size - start - 1
        return num_drafts


def _with_drafts(
    batch: ScheduledBatch,
    num_decodes: int,
    drafts: dict[Sequence, int],
    grammars: dict[Sequence, list[FixedMask]],
) -> ScheduledBatch:
    """``batch`` with its drafted entries (``1 + k`` tokens) right after the plain decodes."""
    entries = list(zip(batch.seqs, batch.num_new_tokens))
    plain = [(seq, n) for seq, n in entries[:num_decodes] if seq not in drafts]
    drafted = [(seq, 1 + k) for seq, k in drafts.items()]
    ordered = plain + drafted + entries[num_decodes:]
    return ScheduledBatch(
        seqs=[seq for seq, _ in ordered],
        num_new_tokens=[n for _, n in ordered],
        block_copies=batch.block_copies,
        window_copies=batch.window_copies,
        preempted=batch.preempted,
        swap_out=batch.swap_out,
        swap_in=batch.swap_in,
        forks=batch.forks,
        drafts=drafts,
        draft_grammars=grammars,
    )
