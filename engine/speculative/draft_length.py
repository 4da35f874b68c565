"""How many drafts a sequence gets: as many as raise the batch's expected tokens per second.

A sequence's drafts are accepted position by position until the first miss; with a per-draft acceptance rate
``a``, ``k`` drafts give ``E(k) = 1 + a + ... + a^k`` tokens a step. The rate is estimated per sequence from its
own verifications as a geometric trial (each accepted draft a success, the first rejected one a failure), with
older steps decaying, starting from a prior of PRIOR_ACCEPTED / PRIOR_TRIALS.

A draft row costs the step what a decode row does: ``b`` seconds, against the step's ``a + b * x`` (the engine's
learned step prices, engine/core/step_cost.py; before they are known, DEFAULT_ROW_COST of a fixed cost). Rows are
given drafts one sequence at a time: ``k`` is the one that maximises the step's expected tokens over its expected
seconds with the drafts given so far, so a batch whose step is already long (many rows, a compute-bound device)
gives few or none, and a sequence whose drafts keep missing gets none (its proposals still run; a draft is
retried after PROBE_AFTER skipped steps, so a sequence that turns repetitive is noticed; with a draft model,
whose probe first catches the draft up over the steps skipped, each probe that misses doubles the wait, up to
MAX_PROBE_AFTER).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.speculative.ngram import NgramIndex

PRIOR_ACCEPTED, PRIOR_TRIALS = 1.0, 2.0  # a = 0.5 before any verification
DECAY = 0.8  # the weight of the trials before each new verification
DEFAULT_ROW_COST = 0.1  # b / a before the step prices are known
PROBE_AFTER = 16  # steps without drafts before a sequence with a low rate gets one draft again
# a draft model's probe costs a catch-up of the draft over the steps skipped: after each probe that misses, the
# next waits twice as long, up to this
MAX_PROBE_AFTER = 256


@dataclass(slots=True)
class Speculation:
    """A sequence's speculative state: its n-gram index and its acceptance so far."""

    index: NgramIndex | None  # (None: a draft model proposes)
    # the request's speculative_context, indexed whole, with its tokens (None: none given)
    context: tuple[NgramIndex, list[int]] | None = None
    accepted: float = 0.0
    trials: float = 0.0
    skipped: int = 0  # steps since its last drafts
    probe_after: int = PROBE_AFTER  # skipped steps before a probe
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    # a draft model's KV of the sequence (engine/worker/draft_model.py): its leading positions known right, as of
    # its preemption count then
    draft_known: int = 0
    draft_preemptions: int = 0

    @property
    def rate(self) -> float:
        return (self.accepted + PRIOR_ACCEPTED) / (self.trials + PRIOR_TRIALS)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """A verification: ``num_accepted`` of ``num_drafts`` drafts kept (the first miss ends a trial run)."""
        self.accepted = DECAY * self.accepted + num_accepted
        self.trials = DECAY * self.trials + num_accepted + (num_accepted < num_drafts)
        self.drafted_tokens += num_drafts
        self.accepted_tokens += num_accepted
        self.skipped = 0


def expected_tokens(rate: float, num_drafts: int) -> float:
    """Tokens a step gives a sequence with ``num_drafts`` drafts at acceptance ``rate``: 1 + a + ... + a^k."""
    return sum(rate**i for i in range(num_drafts + 1))


def choose_draft_length(
    state: Speculation, limit: int, step_tokens: float, step_seconds: float, row_seconds: float
) -> int:
    """Drafts (0 to ``limit``) for a sequence, given the step so far: ``step_tokens`` expected tokens out of
    ``step_seconds`` seconds, a draft row costing ``row_seconds`` (the speculator probes a sequence at 0 after
    PROBE_AFTER steps without drafts)."""
    if limit <= 0:
        return 0
    rate = state.rate
    best, best_speed = 0, step_tokens / step_seconds
    for k in range(1, limit + 1):
        speed = (step_tokens + expected_tokens(rate, k) - 1) / (step_seconds + row_seconds * k)
        if speed > best_speed * 1.0001:
            best, best_speed = k, speed
    return best
