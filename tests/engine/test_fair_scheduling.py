"""Fair scheduling among tenants (engine/core/fair_share.py, engine/core/step_cost.py, the scheduler's shared steps), without
a model: a heavy tenant's rows take turns while a light tenant runs every step; seats and waiting requests are
shared by tenant, not by arrival; priority orders a tenant's own requests; the step's time budget comes from the
measured cost of steps."""

from __future__ import annotations

import math

import pytest

from engine.core.block_hash import BlockHasher
from engine.core.block_manager import BlockManager
from engine.core.fair_share import TenantService, max_min_shares
from engine.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.sequence import Sequence
from engine.core.step_cost import StepCostModel
from tests.block_invariants import check_pool

BLOCK = 4
_ids = iter(range(10**6))


def make_scheduler(
    max_num_seqs: int = 32,
    budget: int = 64,
    num_blocks: int = 256,
    factor: float = 0.0,
    max_seqs_per_tenant: int | None = None,
) -> Scheduler:
    manager = BlockManager(
        num_blocks, BLOCK, enable_prefix_caching=True, hasher=BlockHasher("sha256", "t", "")
    )
    return Scheduler(
        manager,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        shared_step_time_factor=factor,
        max_seqs_per_tenant=max_seqs_per_tenant,
    )


def request(tenant: str, length: int = 5, priority: int = 0, n: int = 1) -> Sequence:
    seq_id = next(_ids)
    # distinct first tokens: no prefix sharing between requests here
    seq = Sequence(
        seq_id=seq_id,
        request_id=f"{tenant}-{seq_id}",
        token_ids=[seq_id % 1000 + 1] * length,
        params=SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, n=n),
        tenant=tenant,
        priority=priority,
    )
    seq.unforked = [
        Sequence(
            seq_id=next(_ids),
            request_id=seq.request_id,
            token_ids=list(seq.token_ids),
            params=seq.params,
            tenant=tenant,
            index=i,
        )
        for i in range(1, n)
    ]
    return seq


def step(scheduler: Scheduler) -> dict[Sequence, int]:
    """One step without a model: the scheduled tokens per sequence."""
    batch = scheduler.schedule()
    scheduler.advance(list(zip(batch.seqs, batch.num_new_tokens)), batch.forks)
    for seq in batch.sampling_seqs:
        seq.append_token(7)
    return dict(zip(batch.seqs, batch.num_new_tokens))


def run_until_decoding(scheduler: Scheduler, seqs: list[Sequence]) -> None:
    for _ in range(50):
        if all(s.num_computed_tokens and s.num_uncomputed_tokens == 1 for s in seqs):
            return
        step(scheduler)
    raise AssertionError("prompts never finished")


def decoding(scheduler: Scheduler, tenant: str, count: int) -> list[Sequence]:
    """``count`` requests of ``tenant``, all decoding."""
    seqs = [request(tenant) for _ in range(count)]
    for seq in seqs:
        scheduler.add(seq)
    run_until_decoding(scheduler, seqs)
    return seqs


def heavy_and_light(scheduler: Scheduler, num_heavy: int) -> tuple[list[Sequence], Sequence]:
    """``num_heavy`` requests of the tenant "heavy" and one of "light", all decoding."""
    heavy = [request("heavy") for _ in range(num_heavy)]
    light = request("light")
    for seq in heavy + [light]:
        scheduler.add(seq)
    run_until_decoding(scheduler, heavy + [light])
    # (added together: their prompts run in one step, as decoding() would run them apart)
    return heavy, light


def accounting(scheduler: Scheduler) -> None:
    check_pool(scheduler.block_manager, list(scheduler.running) + list(scheduler.waiting))


def test_max_min_shares_fill_small_demands_and_split_the_rest_evenly():
    # budget 10 over demands 1, 3, 100: 1 and 3 are met, the 6 left go to the third
    assert max_min_shares({"a": 1, "b": 3, "c": 100}, 10) == {"a": 1, "b": 3, "c": 6}
    # every demand over the level: equal split
    assert max_min_shares({"a": 50, "b": 60}, 10) == {"a": 5, "b": 5}
    # enough for everyone
    assert max_min_shares({"a": 2, "b": 3}, 10) == {"a": 2, "b": 3}


def test_the_least_recently_served_tenant_goes_first():
    service = TenantService()
    service.record({"heavy": 10.0, "light": 1.0})
    assert service.order(["heavy", "light", "new"]) == ["new", "light", "heavy"]


def test_step_cost_recovers_a_linear_step_time():
    model = StepCostModel()
    fixed, per_token = 0.010, 0.002
    assert model.prices() is None
    model.observe(1, fixed + per_token)
    assert model.prices() is None, "one step size says nothing of the slope"
    for tokens in (1, 4, 16, 300, 64, 16):
        model.observe(tokens, fixed + per_token * tokens)
    prices = model.prices()
    assert math.isclose(prices.fixed, fixed, rel_tol=1e-9)
    assert math.isclose(prices.per_token, per_token, rel_tol=1e-9)
    assert prices.tokens_within(0.030) == 10


def test_a_long_run_at_one_size_does_not_wash_out_the_fit():
    model = StepCostModel()
    model.observe(1, 0.012)
    for _ in range(1000):
        model.observe(64, 0.010 + 0.002 * 64)
    assert math.isclose(model.prices().per_token, (0.138 - 0.012) / 63, rel_tol=1e-9)


def test_one_tenant_alone_decodes_every_running_sequence_each_step():
    scheduler = make_scheduler(budget=8)
    seqs = decoding(scheduler, "a", 6)
    assert set(step(scheduler)) == set(seqs)


def test_a_light_tenant_runs_every_step_while_a_heavy_tenants_rows_take_turns():
    scheduler = make_scheduler(budget=64)
    heavy, light = heavy_and_light(scheduler, 9)
    scheduler.max_num_batched_tokens = 4  # token shares: light 1, heavy 3 of the 4
    turns = {seq: 0 for seq in heavy}
    for _ in range(6):
        scheduled = step(scheduler)
        assert light in scheduled, "the light tenant's stream steps every time"
        assert len(scheduled) == 4 and sum(scheduled.values()) == 4
        for seq in heavy:
            turns[seq] += seq in scheduled
    # 3 heavy rows per step over 6 steps: each of the 9 rows twice (the longest waiting goes first)
    assert set(turns.values()) == {2}
    accounting(scheduler)


def test_a_measured_step_cost_caps_a_shared_step_by_time():
    scheduler = make_scheduler(budget=64)
    _, light = heavy_and_light(scheduler, 8)
    scheduler.shared_step.time_factor = 1.5
    fixed, per_token = 0.010, 0.005
    for tokens in (1, 8):  # a 1-token step 15 ms; 1.5 x 15 = 22.5 ms: 2 tokens (light 1, heavy 1)
        scheduler.step_cost.observe(tokens, fixed + per_token * tokens)
    for _ in range(4):
        scheduled = step(scheduler)
        assert light in scheduled and len(scheduled) == 2


def test_a_step_time_target_cuts_a_lone_tenants_prefill_but_not_its_decodes():
    scheduler = make_scheduler(budget=256)
    running = decoding(scheduler, "a", 6)
    scheduler.step_time_target_s = 0.050
    for tokens in (1, 100):
        scheduler.step_cost.observe(tokens, 0.010 + 0.002 * tokens)  # 50 ms: 20 tokens
    long_prompt = request("a", length=120)
    scheduler.add(long_prompt)
    scheduled = step(scheduler)
    assert all(seq in scheduled for seq in running)
    assert scheduled[long_prompt] == 20 - len(running)
    # below the decode rows' own time: they run, with the efficient chunk of prefill (its own work at least the
    # step's fixed 10 ms: 5 tokens, 2 blocks), not one block
    scheduler.step_time_target_s = 0.001
    scheduled = step(scheduler)
    assert all(seq in scheduled for seq in running) and scheduled[long_prompt] == 2 * BLOCK


def test_a_new_request_gets_its_prefill_even_when_a_step_with_prefill_costs_many_paces():
    scheduler = make_scheduler(budget=256, num_blocks=1024)
    _, light = heavy_and_light(scheduler, 12)
    scheduler.shared_step.time_factor = 1.2
    # a one-token step 1 ms (+10 us a token); a step with prefill costs 14 ms more
    for tokens in (1, 8):
        scheduler.step_cost.observe(tokens, 0.001 + 0.00001 * tokens)
    for _ in range(20):
        scheduler.step_cost.observe(20, 0.001 + 0.00001 * 20 + 0.014, prefill=True)
    newcomer = request("light", length=40)
    scheduler.add(newcomer)
    steps = 0
    while not (newcomer.num_computed_tokens and newcomer.num_uncomputed_tokens == 1):
        scheduled = step(scheduler)
        assert light in scheduled, "the light tenant's stream steps every time meanwhile"
        steps += 1
        assert steps < 2000, "the newcomer's prompt never ran"
    accounting(scheduler)


def test_a_light_tenants_request_is_admitted_before_a_heavy_tenants_queue():
    scheduler = make_scheduler(max_num_seqs=4, budget=64)
    heavy = [request("heavy") for _ in range(12)]
    for seq in heavy:
        scheduler.add(seq)
    step(scheduler)  # heavy fills the 4 seats (alone, in order)
    light = request("light")
    scheduler.add(light)
    scheduled = step(scheduler)
    assert light in scheduled, "no wait behind the heavy tenant's 8 queued requests"
    assert len(scheduler.running) == 4 and light in scheduler.running
    preempted = [seq for seq in heavy if seq in scheduler.waiting and seq.num_preemptions]
    assert len(preempted) == 1, "the heavy tenant's newest sequence gave back its seat"
    assert preempted[0] is heavy[3]
    accounting(scheduler)


def test_a_tenant_over_its_seat_share_admits_nothing_more_while_others_wait():
    scheduler = make_scheduler(max_num_seqs=8, budget=256)
    a = [request("a") for _ in range(6)]
    b = [request("b") for _ in range(6)]
    for seq in a + b:
        scheduler.add(seq)
    step(scheduler)  # two tenants from the start: 4 seats each
    running = [seq.tenant for seq in scheduler.running]
    assert running.count("a") == 4 and running.count("b") == 4
    accounting(scheduler)


def test_a_parallel_request_counts_all_its_samples_as_seats():
    scheduler = make_scheduler(max_num_seqs=8, budget=256)
    wide = request("heavy", n=6)
    samples = [wide] + wide.unforked
    scheduler.add(wide)
    step(scheduler)
    light = [request("light") for _ in range(3)]
    for seq in light:
        scheduler.add(seq)
    step(scheduler)
    # 8 seats, a share of 4 each: light takes the 2 free ones, then one of the heavy tenant's 6 (over its share)
    assert sum(seq.tenant == "light" for seq in scheduler.running) == 3
    assert sum(seq.num_preemptions for seq in samples) == 1
    accounting(scheduler)


def test_max_seqs_per_tenant_caps_a_tenant_alone():
    scheduler = make_scheduler(max_num_seqs=16, budget=256, max_seqs_per_tenant=3)
    for _ in range(5):
        scheduler.add(request("a"))
    step(scheduler)
    assert len(scheduler.running) == 3 and len(scheduler.waiting) == 2


def test_priority_orders_a_tenants_own_requests_only():
    scheduler = make_scheduler(max_num_seqs=3, budget=256)
    low = request("a", priority=5)
    urgent = request("a", priority=-5)
    other = request("b", priority=0)
    later = request("a", priority=-5)
    for seq in (low, urgent, other, later):
        scheduler.add(seq)
    step(scheduler)
    assert set(scheduler.running) == {urgent, other, later} or set(scheduler.running) == {
        urgent,
        other,
    }
    assert low in scheduler.waiting, "a's priority 5 request waits behind its -5 ones"
    assert other in scheduler.running, "b's request is not pushed back by a's priorities"


@pytest.mark.parametrize("victims", [2, 5])
def test_a_block_shortage_preempts_the_tenant_running_the_most(victims: int):
    # 2 blocks each; heavy holds 6 sequences, light 1; a pool of exactly that size runs out on the next block
    scheduler = make_scheduler(max_num_seqs=16, budget=256, num_blocks=14)
    heavy = [request("heavy", length=7) for _ in range(6)]
    light = request("light", length=7)
    for seq in heavy + [light]:
        scheduler.add(seq)
    run_until_decoding(scheduler, heavy + [light])
    for _ in range(victims):
        step(scheduler)
    assert light.num_preemptions == 0
    assert sum(seq.num_preemptions for seq in heavy) >= 1
    accounting(scheduler)


# ----------------------------- with the model (CPU, the file's blocks on the native kernels: a row's numbers depend
# on no other row, so a greedy row's tokens do not depend on what shares its step)

PROMPT = "Name three rivers of Europe:"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_beside_a_wide_request_a_light_tenant_steps_every_time_with_its_tokens_unchanged(
    tokenizer, async_scheduling
):
    from engine.llm_engine import LLMEngine
    from tests.conftest import SMALL_KV_GIB

    ids = tokenizer.encode(PROMPT)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    options = dict(
        kv_cache_memory_gib=SMALL_KV_GIB,
        cpu_weights="file",
        async_scheduling=async_scheduling,
        # token shares: the test sets a budget of 4 tokens a step
        shared_step_time_factor=0,
    )
    alone = LLMEngine(**options)
    alone.add_request("light", ids, greedy)
    expected = _finals(alone)["light"]

    engine = LLMEngine(**options, max_num_batched_tokens=4)
    engine.add_request(
        "wide", ids, SamplingParams(temperature=1.0, n=12, max_tokens=12, seed=3), tenant="heavy"
    )
    engine.add_request("light", ids, greedy, tenant="light")
    finals, light_steps, shared_steps = {}, 0, 0
    while engine.has_unfinished_requests():
        light_open = any(
            seq.tenant == "light" and seq.awaiting_last_token is False
            for seq in engine.core.scheduler.running + list(engine.core.scheduler.waiting)
        )
        for out in engine.step():
            if out.finished:
                finals.setdefault(out.request_id, []).append(out)
        batch = engine.last_batch
        if light_open and any(seq.tenant == "heavy" for seq in batch.seqs):
            shared_steps += 1
            light_steps += any(seq.tenant == "light" for seq in batch.seqs)
            assert len(batch.seqs) <= 4
        check_pool(
            engine.core.block_manager,
            list(engine.core.scheduler.running) + list(engine.core.scheduler.waiting),
        )
    assert finals["light"][0].token_ids == expected.token_ids
    assert len(finals["wide"]) == 12 and all(len(out.token_ids) == 12 for out in finals["wide"])
    assert shared_steps >= 8 and light_steps == shared_steps


def _finals(engine) -> dict:
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def test_with_only_prompts_waiting_a_shared_step_computes_them_whatever_its_credit():
    """No stream runs, so nothing is kept at pace: a dear step with prefill runs at once (an empty step would
    stall the engine)."""
    scheduler = make_scheduler(budget=256)
    scheduler.shared_step.time_factor = 1.2
    for tokens in (1, 8):
        scheduler.step_cost.observe(tokens, 0.001 + 0.00001 * tokens)
    for _ in range(20):
        scheduler.step_cost.observe(20, 0.001 + 0.00001 * 20 + 0.014, prefill=True)
    a, b = request("a", length=30), request("b", length=30)
    scheduler.add(a)
    scheduler.add(b)
    scheduled = step(scheduler)
    assert scheduled.get(a) and scheduled.get(b)


def test_a_new_request_gets_its_prefill_when_a_row_per_tenant_already_costs_more_than_the_pace():
    """The CPU beside a wide request: a token's own work (3.4 ms) is twice the step's fixed cost (1.6 ms), so the
    least shared step, a row per tenant, costs 8.4 ms against a pace of 1.5 x 5 ms. Decode-only steps spent all
    the credit they earned and the light tenant's new request waited for good (a server's beam search of 128 held
    one 40 s); now prompts get a turn within a few steps."""
    scheduler = make_scheduler(budget=256, num_blocks=1024)
    scheduler.shared_step.time_factor = 1.5
    heavy = decoding(scheduler, "heavy", 24)
    for tokens in (1, 2, 8):
        scheduler.step_cost.observe(tokens, 0.0016 + 0.0034 * tokens)
    newcomer = request("light", length=40)
    scheduler.add(newcomer)
    steps = 0
    while not newcomer.num_computed_tokens:
        scheduled = step(scheduler)
        assert 1 <= sum(seq in scheduled for seq in heavy), "the heavy tenant steps meanwhile"
        steps += 1
        assert steps <= 24, "the newcomer's prompt never ran"
    accounting(scheduler)
