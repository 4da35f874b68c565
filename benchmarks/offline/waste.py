"""Workload ``waste`` (shared WORKLOADS.md): the PagedAttention paper's KV memory table, reproduced.

The nano workload (``random.Random(--seed)``; per request: prompt length uniform in ``--prompt-len``, prompt ids
uniform in [0, 10000), output length uniform in ``--output-len``; greedy, EOS ignored) runs once per allocation
mode on one engine (dummy weights of ``--model-config``) with one fixed KV pool of ``--num-kv-blocks`` blocks of
16 slots (default 8192 x 16 = 131,072 slots), so every mode competes for the same memory:

- ``paged``: the engine as it is, blocks taken on demand; reserved = slots of the blocks referenced.
- ``reserve-max``: a request is admitted only if ``--max-model-len`` slots (default 2048) fit in what the
  running requests' reservations leave of the pool (FasterTransformer, Orca-Max);
- ``reserve-pow2``: it reserves the next power of two >= prompt + max_tokens (Orca-Pow2);
- ``reserve-oracle``: exactly prompt + output (Orca-Oracle; with EOS ignored, output = max_tokens).

A reservation is held while the request is in ``scheduler.running`` and is counted in whole blocks against the
pool, so the paged engine underneath never runs out of blocks for a reserved request. Each mode gets its own
cache salt (the prompts repeat across modes, their blocks must not be hit).

Sampled after every ``--sample-every``-th step, each sample weighted by the wall time since the previous one:
useful KV = slot-seconds holding a token's KV (block manager's used slots) / slot-seconds reserved (the
paper's "KV memory actually used"); mean running requests (and the max). Output tok/s = output tokens / wall
seconds from submitting all requests to the last finishing. Sampling walks every block table (host time,
inside the wall time; ``sample_seconds`` in the JSON, and a warning above 5% of the wall).

    python -m benchmarks.offline.waste [--num-requests 256] [--modes paged reserve-max reserve-pow2 reserve-oracle]
        [--num-kv-blocks 8192] [--max-model-len 2048] [--model-config llama-3.2-1b] [--json PATH]
    python -m benchmarks.offline.waste_chart PATH      # the PNG, wherever matplotlib is
"""

from __future__ import annotations

import argparse
import itertools
import logging
import time
from collections import deque
from dataclasses import asdict, dataclass

from tqdm import tqdm

from benchmarks.harness import record
from benchmarks.harness.engine import (
    add_engine_options,
    build_engine,
    greedy,
    warm_up,
)
from benchmarks.harness.workloads import NANO_LENGTHS, Request, nano_workload
from engine.core.block_manager import BlockManager
from engine.llm_engine import LLMEngine
from engine.core.scheduler import Scheduler
from engine.sequence import Sequence

logger = logging.getLogger("benchmarks.offline.waste")

MODES = ("paged", "reserve-max", "reserve-pow2", "reserve-oracle")


# reservations ---------------------------------------------------------------------------------------------


def next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def reservation_slots(mode: str, prompt_len: int, max_tokens: int, max_model_len: int) -> int:
    """KV slots a request holds from admission to its end under a reservation ``mode``. A request never grows
    past max_model_len tokens, so no reservation exceeds it."""
    if mode == "reserve-max":
        return max_model_len
    total = min(prompt_len + max_tokens, max_model_len)
    if mode == "reserve-pow2":
        return min(next_pow2(total), max_model_len)
    if mode == "reserve-oracle":
        return total
    raise ValueError(f"mode: {mode!r} is not one of {MODES[1:]}")


class ReservingScheduler(Scheduler):
    """The engine's scheduler under an up-front reservation: admission (FCFS) also needs the waiting head's
    reservation to fit in the pool left by the running requests' reservations, each counted in whole blocks.
    A reservation is released when its sequence leaves ``running`` (finished or preempted)."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        mode: str,
        max_model_len: int,
    ) -> None:
        super().__init__(block_manager, max_num_seqs, max_num_batched_tokens)
        reservation_slots(mode, 1, 1, max_model_len)  # ValueError for an unknown mode
        self.mode = mode
        self.max_model_len = max_model_len
        self.reservations: dict[int, int] = {}  # seq_id -> reserved slots

    def reservation(self, seq: Sequence) -> int:
        max_tokens = seq.params.max_tokens or self.max_model_len - seq.num_prompt_tokens
        return reservation_slots(self.mode, seq.num_prompt_tokens, max_tokens, self.max_model_len)

    @property
    def reserved_slots(self) -> int:
        return sum(self.reservations.get(seq.seq_id, 0) for seq in self.running)

    def _admit_waiting(self, budget: int, chosen: dict[Sequence, int]) -> None:
        """The engine's admission, run on the head of the queue whose reservations fit: the first request
        that does not fit blocks those behind it, as the engine's own FCFS does on free blocks."""
        running = {seq.seq_id for seq in self.running}
        self.reservations = {
            sid: slots for sid, slots in self.reservations.items() if sid in running
        }
        free = self.block_manager.num_blocks - sum(
            map(self.block_manager.blocks_needed, self.reservations.values())
        )
        fitting = 0
        for seq in self.waiting:
            free -= self.block_manager.blocks_needed(self.reservation(seq))
            if free < 0:
                break
            fitting += 1
        head, tail = (
            deque(itertools.islice(self.waiting, fitting)),
            list(itertools.islice(self.waiting, fitting, None)),
        )
        self.waiting = head
        try:
            super()._admit_waiting(budget, chosen)
        finally:
            head.extend(tail)  # the ones not admitted, in their order
        for seq in self.running:
            if seq.seq_id not in self.reservations:
                self.reservations[seq.seq_id] = self.reservation(seq)


def install_scheduler(engine: LLMEngine, mode: str) -> None:
    """A fresh scheduler of ``mode`` over the engine's block manager (call with no request in the engine)."""
    config = engine.config
    args = (engine.core.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
    engine.core.scheduler = (
        Scheduler(*args)
        if mode == "paged"
        else ReservingScheduler(*args, mode, config.max_model_len)
    )


def reserved_slots(engine: LLMEngine, allocated_slots: int) -> int:
    scheduler = engine.core.scheduler
    return (
        scheduler.reserved_slots if isinstance(scheduler, ReservingScheduler) else allocated_slots
    )


# the run --------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class ModeResult:
    mode: str
    wall_s: float = 0.0
    output_tokens: int = 0
    # integrals over the sampled time: slot-seconds and request-seconds
    sampled_s: float = 0.0
    used_slot_s: float = 0.0
    reserved_slot_s: float = 0.0
    allocated_slot_s: float = 0.0  # blocks the engine really referenced (equals reserved for paged)
    running_s: float = 0.0
    max_running: int = 0
    samples: int = 0
    sample_seconds: float = 0.0  # host time spent sampling (inside wall_s)
    steps: int = 0
    preemptions: int = 0
    prefix_hits: int = 0

    @property
    def useful(self) -> float:
        return self.used_slot_s / self.reserved_slot_s if self.reserved_slot_s else 0.0

    @property
    def mean_running(self) -> float:
        return self.running_s / self.sampled_s if self.sampled_s else 0.0

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    def summary(self) -> dict:
        return {
            **asdict(self),
            "useful": self.useful,
            "mean_running": self.mean_running,
            "output_tok_s": self.output_tok_s,
            "mean_used_slots": self.used_slot_s / self.sampled_s,
            "mean_reserved_slots": self.reserved_slot_s / self.sampled_s,
        }


@dataclass(slots=True, frozen=True)
class Sample:
    time: float
    used: int
    reserved: int
    allocated: int
    running: int


def sample(engine: LLMEngine) -> Sample:
    """The state between two steps, stamped with the time it was taken from."""
    now = time.perf_counter()
    blocks = engine.core.block_manager.stats()
    return Sample(
        now,
        blocks.used_slots,
        reserved_slots(engine, blocks.allocated_slots),
        blocks.allocated_slots,
        len(engine.core.scheduler.running),
    )


def account(result: ModeResult, taken: Sample, seconds: float) -> None:
    """``taken`` stands for the ``seconds`` of steps since the previous sample."""
    result.sampled_s += seconds
    result.used_slot_s += taken.used * seconds
    result.reserved_slot_s += taken.reserved * seconds
    result.allocated_slot_s += taken.allocated * seconds
    result.running_s += taken.running * seconds
    result.max_running = max(result.max_running, taken.running)
    result.samples += 1


def run_mode(
    engine: LLMEngine, mode: str, requests: list[Request], sample_every: int
) -> ModeResult:
    install_scheduler(engine, mode)
    result, before = ModeResult(mode), engine.stats()
    produced = [0] * len(requests)
    bar = tqdm(total=sum(r.output_len for r in requests), unit="tok", desc=mode)
    start = time.perf_counter()
    for i, request in enumerate(requests):
        engine.add_request(
            f"{mode}-{i}", request.prompt, greedy(request.output_len), cache_salt=f"waste-{mode}"
        )
    last_time = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        for output in outputs:
            produced[int(output.request_id.rsplit("-", 1)[1])] += len(output.token_ids_delta)
        bar.update(sum(len(output.token_ids_delta) for output in outputs))
        result.steps += 1
        if result.steps % sample_every == 0:
            # after step(): the blocks and reservations of the pass just launched (with async scheduling it
            # still runs on the device), standing for the steps since the previous sample
            taken = sample(engine)
            account(result, taken, taken.time - last_time)
            last_time = taken.time
            result.sample_seconds += time.perf_counter() - taken.time
    result.wall_s = time.perf_counter() - start
    bar.close()
    if result.sample_seconds > 0.05 * result.wall_s:
        logger.warning(
            "%s: sampling took %.1f of %.1f s; consider --sample-every",
            mode,
            result.sample_seconds,
            result.wall_s,
        )
    wrong = [i for i, (n, r) in enumerate(zip(produced, requests)) if n != r.output_len]
    if wrong:
        raise RuntimeError(
            f"{mode}: {len(wrong)} requests produced a wrong number of tokens (e.g. #{wrong[0]})"
        )
    after = engine.stats()
    result.output_tokens = sum(produced)
    result.preemptions = after.preemptions  # the scheduler (and its counter) is new for this mode
    result.prefix_hits = after.prefix_hits - before.prefix_hits
    return result


# report ---------------------------------------------------------------------------------------------------


def table(results: list[ModeResult]) -> str:
    rows = [
        "| mode | useful KV % | mean running | tok/s | max running | preemptions |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    rows += [
        f"| {r.mode} | {r.useful:.1%} | {r.mean_running:.1f} | {r.output_tok_s:.1f} | {r.max_running} | "
        f"{r.preemptions} |"
        for r in results
    ]
    return "\n".join(rows)


def int_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    bounds = (int(low), int(high or low))
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LOW-HIGH with 1 <= LOW <= HIGH")
    return bounds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int_range, default=NANO_LENGTHS, metavar="LOW-HIGH")
    parser.add_argument("--output-len", type=int_range, default=NANO_LENGTHS, metavar="LOW-HIGH")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument(
        "--num-kv-blocks", type=int, default=8192, help="the KV pool of every mode, in blocks of 16"
    )
    parser.add_argument(
        "--max-model-len", type=int, default=2048, help="what reserve-max reserves per request"
    )
    parser.add_argument(
        "--sample-every", type=int, default=1, help="sample the KV use every k steps"
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="also write the numbers here (input of benchmarks.offline.waste_chart)",
    )
    add_engine_options(parser)
    args = parser.parse_args(argv)
    if min(args.num_requests, args.num_kv_blocks, args.sample_every) < 1:
        parser.error("--num-requests, --num-kv-blocks and --sample-every must be >= 1")
    if args.prompt_len[1] + args.output_len[1] > args.max_model_len:
        parser.error("the longest prompt + output must fit in --max-model-len")
    if args.max_model_len > args.num_kv_blocks * 16:
        parser.error(
            "--max-model-len must fit in the KV pool (--num-kv-blocks x 16), or reserve-max admits nothing"
        )
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    load_before = record.load_average()
    requests = nano_workload(args.num_requests, args.seed, args.prompt_len, args.output_len)
    engine = build_engine(args, num_kv_blocks=args.num_kv_blocks, max_model_len=args.max_model_len)
    config = engine.config
    warm_up(engine, args.prompt_len[1])
    results = []
    for mode in args.modes:
        results.append(run_mode(engine, mode, requests, args.sample_every))
        logger.info("%s: %s", mode, results[-1].summary())
    env = record.environment(__spec__.name, config.torch_device, load_before)
    pool = {
        "num_kv_blocks": engine.core.block_manager.num_blocks,
        "block_size": config.block_size,
        "pool_slots": engine.core.block_manager.num_blocks * config.block_size,
        "max_model_len": config.max_model_len,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "async_scheduling": config.async_scheduling,
        "dtype": str(config.torch_dtype),
    }
    if args.json:
        workload = {
            "num_requests": args.num_requests,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "seed": args.seed,
            "model_config": args.model_config,
            "sample_every": args.sample_every,
        }
        record.write_json(
            args.json,
            {
                "workload": workload,
                "engine": pool,
                "environment": env,
                "modes": [r.summary() for r in results],
            },
        )
    print(
        f"\n## waste: nano workload, {args.num_requests} requests; {args.model_config} dummy, {pool['dtype']}, "
        f"{env['device']}; KV pool {pool['num_kv_blocks']} blocks x {pool['block_size']} = {pool['pool_slots']} "
        f"slots, max_model_len {pool['max_model_len']}"
    )
    print(record.environment_line(env) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
