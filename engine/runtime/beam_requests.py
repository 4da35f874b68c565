"""The engine core's beam-search requests: each beam's group, the log-probs a step collects from the beams' rows,
and the beam step once every live beam has them (engine/output/beam_search.py selects; this file applies the selection
to the sequences, their blocks and the scheduler).

A beam's sampled row is not its next token: its log-probs are. Once every live beam of a request has given its
row, the beam step picks the next beams, and each continues one of the current beams (sharing its blocks,
copy-on-write) with one more token. A recomputed beam gives its log-probs again; a swapped one keeps them, and a
step whose beams are all swapped out waits for their swap-in (``deferred_steps``).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

import torch

from engine.output.beam_search import BeamGroup
from engine.core.block_manager import BlockManager
from engine.core.metrics import EngineCounters
from engine.output.outputs import SampleDelta
from engine.core.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


class BeamRequests:
    def __init__(
        self,
        scheduler: Scheduler,
        block_manager: BlockManager,
        counters: EngineCounters,
        forget: Callable[[Sequence], None],
        finish: Callable[[Sequence, SequenceStatus], None],
        end_request: Callable[[str], int],
    ) -> None:
        """``forget(seq)``: the runner drops the sequence's input rows; ``finish(seq, status)``: the core ends a
        sequence; ``end_request(request_id)``: the core forgets the request, returning its ``n``."""
        self.scheduler, self.block_manager, self.counters = scheduler, block_manager, counters
        self._forget, self._finish, self._end_request = forget, finish, end_request
        self.groups: dict[int, BeamGroup] = {}  # seq_id -> its request's group, for every beam
        self._swapped_at_step: list[BeamGroup] = []  # beam steps waiting for their beams' swap-in

    def add(self, group: BeamGroup) -> None:
        self.groups.update((seq.seq_id, group) for seq in group.beams)

    def preempted(self, seqs: list[Sequence]) -> None:
        """A recomputed beam computes its log-probs again; a swapped one keeps them."""
        for seq in seqs:
            if (
                group := self.groups.get(seq.seq_id)
            ) is not None and seq.status is not SequenceStatus.SWAPPED:
                group.collected.pop(seq.seq_id, None)

    def collect(self, seq: Sequence, log_probs: torch.Tensor) -> list[SampleDelta]:
        """A beam's next-token log-probs; the request's beam step runs once every live beam has them."""
        group = self.groups.get(seq.seq_id)
        # (a beam swapped out after this pass keeps its log-probs: its KV was written before the copy)
        if group is None or seq.status not in (SequenceStatus.RUNNING, SequenceStatus.SWAPPED):
            return []
        if not group.collect(seq, log_probs):
            return []
        if all(b.status is SequenceStatus.RUNNING for b in group.live):
            return self._step(group)
        # swapped out (all together): the step waits for their swap-in
        self._swapped_at_step.append(group)
        return []

    def deferred_steps(self) -> list[SampleDelta]:
        """Beam steps whose log-probs were complete while the request's beams were swapped out: taken once the
        beams are back on the device (before the schedule, which then runs the new beams)."""
        deltas, waiting = [], []
        for group in self._swapped_at_step:
            live = group.live
            if any(seq.is_finished for seq in live):
                continue  # aborted meanwhile
            if all(seq.status is SequenceStatus.RUNNING for seq in live):
                deltas += self._step(group)
            else:
                waiting.append(group)
        self._swapped_at_step = waiting
        return deltas

    def unstall(self) -> list[SampleDelta] | None:
        """A step found nothing to run, none in flight. If every running sequence waits for its beam step while
        others wait for blocks (a preempted beam, a swap-in, a new request), the beams hold the blocks that what
        they wait for needs, for good: the newest search gives way. Where others wait, its running beams give
        their blocks back (recomputed once admitted again, their full blocks still cached) and queue behind
        them; where it is alone, its live beams need more KV than the pool holds (pinned presets given back
        first), and it ends now with the best hypotheses it has (finish reason "length", as at max_model_len).
        None: no such stall; else the final deltas (none where the search gave way)."""
        scheduler = self.scheduler
        if not (scheduler.waiting or scheduler.swapped) or not scheduler.running:
            return None
        if not all(seq.awaiting_beam_step for seq in scheduler.running):
            return None
        newest = scheduler.running[-1].request_id
        queued = itertools.chain(scheduler.running, scheduler.waiting, scheduler.swapped)
        if any(seq.request_id != newest for seq in queued):
            preempted = []
            for seq in [seq for seq in scheduler.running if seq.request_id == newest]:
                preempted += scheduler.preempt(seq, allow_swap=False)
            scheduler.waiting.rotate(-len(preempted))  # (preempt put them first: now last)
            for seq in preempted:
                self._forget(seq)
            self.preempted(preempted)
            logger.warning(
                "beam search %s gave way: its beams held blocks others waited for", newest
            )
            return []
        if self.block_manager.pins:
            self.block_manager.unpin_all()
            return []
        group = self.groups[scheduler.running[-1].seq_id]
        logger.warning(
            "beam search %s ended at %d new tokens: its %d beams need more KV than the cache holds",
            newest,
            len(group.live[0].token_ids) - group.live[0].num_prompt_tokens,
            group.num_live,
        )
        return self.finish(group, None)

    def _step(self, group: BeamGroup) -> list[SampleDelta]:
        live = group.live
        sources, token_ids = group.advance()
        self.counters.generation_tokens += len(live)
        if group.search.done:
            return self.finish(group, None)
        if group.num_live == 1:
            self.scheduler.start_beams(live[0])
            group.num_live = len(group.beams)
        self.block_manager.reassign(group.beams, sources)
        for seq, ids in zip(group.beams, token_ids):
            seq.token_ids = ids
            seq.awaiting_beam_step = False
            self._forget(seq)  # its block table changed as a whole
        return []

    def finish(self, group: BeamGroup, status: SequenceStatus | None) -> list[SampleDelta]:
        """End a beam search (``status`` None: it is done; else aborted): one final delta per hypothesis."""
        first = group.beams[0]
        n = self._end_request(first.request_id)
        for seq in group.beams:
            if not seq.is_finished:
                self._finish(seq, status or SequenceStatus.FINISHED_STOPPED)
            self.groups.pop(seq.seq_id, None)
        queued = (
            None
            if first.first_scheduled_time is None
            else first.first_scheduled_time - first.arrival_time
        )
        deltas = []
        for index, (ids, logprob, reason) in enumerate(group.results(n, status is not None)):
            self.counters.finished[reason] += 1
            deltas.append(
                SampleDelta(
                    first.request_id,
                    index,
                    ids,
                    None,
                    reason,
                    None,
                    max(first.num_cached_tokens, 0),
                    queued,
                    logprob,
                )
            )
        return deltas
