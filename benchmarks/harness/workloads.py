"""The request generators of the shared WORKLOADS.md: ``nano`` (offline throughput, waste) and ``shared-prefix``.

Prompt ids are drawn uniformly from [0, VOCAB) by ``random.Random(seed)``, in the order the page gives, so that
every script (and every peer) runs the very same requests for a seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from random import Random

VOCAB = 10_000  # prompt ids are drawn uniformly from [0, VOCAB)
NANO_LENGTHS = (100, 1024)  # nano: prompt and output lengths, bounds inclusive


@dataclass(slots=True, frozen=True)
class Request:
    prompt: list[int]
    output_len: int  # EOS is ignored, so this is both max_tokens and the tokens produced


def nano_workload(
    num_requests: int,
    seed: int = 0,
    prompt_len: tuple[int, int] = NANO_LENGTHS,
    output_len: tuple[int, int] = NANO_LENGTHS,
) -> list[Request]:
    """Per request, in this order: the prompt length, its ids, the output length (bounds inclusive)."""
    rng = Random(seed)
    requests = []
    for _ in range(num_requests):
        ids = [rng.randrange(VOCAB) for _ in range(rng.randint(*prompt_len))]
        requests.append(Request(ids, rng.randint(*output_len)))
    return requests


def capped(cap: int | None, bounds: tuple[int, int] = NANO_LENGTHS) -> tuple[int, int]:
    """``bounds`` with both ends clipped to ``cap`` (smoke tests only; the draws stay the same)."""
    return (min(bounds[0], cap or bounds[0]), min(bounds[1], cap or bounds[1]))


def shared_prefix_prompts(
    groups: int, per_group: int, prefix_len: int, question_len: int, seed: int = 0
) -> dict[str, list[int]]:
    """Request id -> prompt ids, in group order: one drawn prefix per group, one drawn question per request."""
    rng = Random(seed)
    prompts: dict[str, list[int]] = {}
    for g in range(groups):
        prefix = [rng.randrange(VOCAB) for _ in range(prefix_len)]
        for r in range(per_group):
            prompts[f"g{g}-r{r}"] = prefix + [rng.randrange(VOCAB) for _ in range(question_len)]
    return prompts
