"""Fair shares of a step among tenants: max-min fairness ("water filling") over the step's budget.

A tenant is whoever the front says sent a request (a hash of its API key, or its client's address). While two or
more tenants have work, the scheduler (scheduler.py) splits each step so that no tenant gets less than an equal
share unless it asks for less, and what one does not need goes to the others:

    share(t) = min(demand(t), level), the level chosen so that the shares sum to the budget (or meet every demand)

The budget is in tokens (a decode row is one, a prefill chunk its length): as many as fit in ``factor`` x the time
of a one-token step once the step's cost is measured (step_cost.py), else the step's token budget. A tenant with
work gets at least one token per step whatever its share, and the least recently served tenant goes first. Seats
(running sequences, ``max_num_seqs``) are shared the same way: a tenant at or over ``max_num_seqs / tenants``
admits nothing more while others have work (shared_step.py).
"""

from __future__ import annotations

from collections.abc import Iterable

DECAY = 0.9  # per step: how fast a tenant's recent service is forgotten


def max_min_shares(demands: dict[str, float], budget: float) -> dict[str, float]:
    """Each tenant's share of ``budget``: its demand if at most the common level, else the level."""
    shares: dict[str, float] = {}
    left, open_demands = budget, dict(demands)
    while open_demands:
        level = left / len(open_demands)
        met = {tenant: demand for tenant, demand in open_demands.items() if demand <= level}
        if not met:
            shares.update((tenant, level) for tenant in open_demands)
            break
        for tenant, demand in met.items():
            shares[tenant] = demand
            left -= demand
            del open_demands[tenant]
    return shares


class TenantService:
    """Each tenant's recent service (step budget spent, exponentially decayed): the least served go first."""

    def __init__(self) -> None:
        self._served: dict[str, float] = {}

    def order(self, tenants: Iterable[str]) -> list[str]:
        return sorted(tenants, key=lambda tenant: (self._served.get(tenant, 0.0), tenant))

    def record(self, spent: dict[str, float]) -> None:
        served = self._served
        for tenant in list(served):
            served[tenant] *= DECAY
            if served[tenant] < 1e-9 and tenant not in spent:
                del served[tenant]
        for tenant, amount in spent.items():
            served[tenant] = served.get(tenant, 0.0) + amount
