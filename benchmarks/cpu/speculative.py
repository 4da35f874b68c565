"""Workload ``speculative-cpu``: n-gram speculative decoding against plain decoding on the CPU default model.

The workload (benchmarks/cpu/speculative_workload.py): a repetitive one, two chat sessions of edit-this-code,
quote-and-answer, summarise-a-list and regenerate turns (eight turns, 128-256 new tokens each, each prompt the
conversation so far), and a non-repetitive one, eight open questions of the same lengths.

Two engines in one process, both the default model (SmolLM2-135M-Instruct, its GGUF blocks on the native CPU
kernels, ``--threads`` threads): ``LLM()`` (plain) and ``LLM(speculative="ngram", num_speculative_tokens=K)``
(spec). For ``--rounds`` rounds they take turns on each scenario (plain first in even rounds, spec first in odd
ones), so drift in a shared machine hits both alike:

- single stream: each workload's turns one request at a time; tok/s = output tokens / wall seconds of the
  turns (prefill included). Every step is timed, so the report also has the plain decode step's time and the
  verify step's at each draft count, and the tokens a decode step gives.
- ``--streams`` concurrent streams: the workload's turns (their prompts and parameters as the single-stream run
  built them) submitted at once, their prompts first put in the prefix cache by an untimed one-token run (as a
  session's next turn finds its conversation there); tok/s = output tokens / wall from submit to the last
  finished.

The ratio is spec over plain of the medians over rounds. On a shared 2-core machine a neighbour's burst stalls
single steps of 2 threads (seen: 1.2-1.5 s for a 6-ms step), so two estimates that such bursts move less come
beside it: "best" (each turn at its fastest over the rounds; 8 streams: the fastest round) and "steady" (every
step priced at the median time of its kind, prefill or decode and its row count, over the side's runs). Each pass gets a fresh ``cache_salt`` (no pass reuses an
earlier one's prefix-cache blocks; a session's turns share their pass's). Acceptance (drafts kept / drafted,
tokens per verification) comes from the engine's counters (``llm.engine.stats()``). Greedy outputs of plain and
spec must be identical: the script stops with an error where they are not; the seeded regenerate turns are
compared too (the engine keeps seeded sampling's tokens, engine/speculative/__init__.py) and reported.

    python -m benchmarks.cpu.speculative [--rounds 3] [--streams 8] [--num-speculative-tokens 4] [--threads 2]
                                         [--json PATH]
    python -m benchmarks.cpu.speculative --replay   # the proposer replayed over plain's turns, no timing
    python -m benchmarks.cpu.speculative --profile-steps   # the native step's phases by draft count
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks.cpu.speculative_workload import (
    MAX_TOKENS,
    MIN_TOKENS,
    NON_REPETITIVE,
    REGENERATE_SEED,
    REGENERATE_TEMPERATURE,
    REPETITIVE,
    Turn,
)
from benchmarks.cpu.throughput import native_level
from benchmarks.harness import record
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.speculative.ngram import NgramIndex

logger = logging.getLogger("benchmarks.cpu.speculative")

_SALTS = itertools.count()
Request = tuple[list[int], SamplingParams]


@dataclass(slots=True)
class Step:
    """One engine step: its seconds, decode rows, drafts verified (and kept), and whether it had prefill."""

    seconds: float
    rows: int
    drafts: int
    accepted: int
    prefill: bool


@dataclass(slots=True)
class Run:
    """One side's pass over one scenario."""

    seconds: float
    outputs: list[list[int]]
    kinds: list[str]
    steps: list[Step]
    spec: dict[str, int]  # the engine's speculative counters over the pass
    turn_seconds: list[float] = field(default_factory=list)  # single stream: each turn's

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


@dataclass(slots=True)
class Side:
    runs: list[Run] = field(default_factory=list)

    @property
    def median_tok_s(self) -> float:
        return statistics.median(r.tok_s for r in self.runs)


# running requests ----------------------------------------------------------------------------------------


def counters(llm: LLM) -> dict[str, int]:
    stats = llm.engine.stats()
    return {
        "verifications": stats.spec_verifications,
        "drafted": stats.spec_draft_tokens,
        "accepted": stats.spec_accepted_tokens,
        "steps": stats.steps,
    }


def run_requests(
    llm: LLM, requests: list[Request], salt: str
) -> tuple[float, list[list[int]], list[Step]]:
    """``requests`` submitted at once and stepped to the end, every step timed: wall seconds, the outputs (in
    order) and the steps."""
    engine = llm.engine
    count = engine.counters
    ids = [f"{salt}-{i}" for i in range(len(requests))]
    start = time.perf_counter()
    for request_id, (prompt, params) in zip(ids, requests):
        engine.add_request(request_id, prompt, params, cache_salt=salt)
    outputs: dict[str, list[int]] = {}
    steps = []
    while engine.has_unfinished_requests():
        drafted, accepted = count.spec_draft_tokens, count.spec_accepted_tokens
        before = time.perf_counter()
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = list(output.token_ids)
        seconds = time.perf_counter() - before
        batch = engine.last_batch
        drafts = batch.drafts if batch is not None else {}
        rows = sum(batch.num_new_tokens) if batch is not None else 0
        prefill = batch is not None and any(
            n > 1 and seq not in drafts for seq, n in zip(batch.seqs, batch.num_new_tokens)
        )
        steps.append(
            Step(
                seconds,
                rows,
                count.spec_draft_tokens - drafted,
                count.spec_accepted_tokens - accepted,
                prefill,
            )
        )
    return time.perf_counter() - start, [outputs[i] for i in ids], steps


def turn_params(turn: Turn, context: list[int]) -> SamplingParams:
    sampled = {"temperature": REGENERATE_TEMPERATURE, "seed": REGENERATE_SEED}
    return SamplingParams(
        **(sampled if turn.regenerate else {"temperature": 0.0}),
        min_tokens=MIN_TOKENS,
        max_tokens=MAX_TOKENS,
        speculative_context=context,
    )


class Sessions:
    """One side's pass over a workload's turns, a turn at a time (so that the sides can take turns turn by turn):
    each session's prompt is its conversation so far."""

    def __init__(self, llm: LLM, turns: tuple[Turn, ...]) -> None:
        self.llm, self.turns = llm, turns
        self.salt = f"spec-bench-{next(_SALTS)}"
        self.history: dict[str, list[dict[str, str]]] = {}
        self.last: dict[str, Request] = {}
        self.replies: dict[str, list[int]] = {}
        self.requests: list[Request] = []
        self.run = Run(0.0, [], [t.kind for t in turns], [], {})
        self.before = counters(llm)

    def next_turn(self) -> None:
        turn = self.turns[len(self.requests)]
        messages = self.history.setdefault(turn.session, [])
        if turn.regenerate:
            prompt = self.last[turn.session][0]
            messages.pop()  # the reply it replaces
        else:
            messages.append({"role": "user", "content": turn.message})
            prompt = self.llm.chat_prompt_ids(messages)
        request = (prompt, turn_params(turn, self.replies.get(turn.session, [])))
        seconds, (reply,), steps = run_requests(self.llm, [request], self.salt)
        text = self.llm.tokenizer.decode(reply, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": text})
        self.last[turn.session], self.replies[turn.session] = request, reply
        self.requests.append(request)
        self.run.outputs.append(reply)
        self.run.steps += steps
        self.run.seconds += seconds
        self.run.turn_seconds.append(seconds)

    def finish(self) -> Run:
        self.run.spec = {k: v - self.before[k] for k, v in counters(self.llm).items()}
        return self.run


def run_batch(llm: LLM, requests: list[Request], kinds: list[str]) -> Run:
    """The requests at once, their prompts already in the prefix cache (as a session's turn finds all but its
    new message there), so that the streams' decoding is measured rather than 8 fresh prompts' prefill."""
    salt = f"spec-bench-{next(_SALTS)}"
    one_token = SamplingParams(temperature=0.0, max_tokens=1, speculative=False)
    run_requests(llm, [(prompt, one_token) for prompt, _ in requests], salt)
    before = counters(llm)
    seconds, outputs, steps = run_requests(llm, requests, salt)
    spec = {k: v - before[k] for k, v in counters(llm).items()}
    return Run(seconds, outputs, kinds, steps, spec)


# checks and summaries ------------------------------------------------------------------------------------


def compare(scenario: str, plain: Run, spec: Run, turns_kinds: list[str]) -> dict[str, Any]:
    """Greedy outputs must match (an error where not); seeded (regenerate) ones are reported."""
    greedy_diff, seeded_diff = [], []
    for i, (kind, a, b) in enumerate(zip(turns_kinds, plain.outputs, spec.outputs)):
        if a != b:
            (seeded_diff if kind == "regenerate" else greedy_diff).append(i)
    if greedy_diff:
        raise AssertionError(
            f"{scenario}: greedy outputs of plain and spec differ in turns {greedy_diff}"
        )
    return {"greedy_identical": True, "seeded_differ_in_turns": seeded_diff}


def step_summary(runs: list[Run]) -> dict[str, Any]:
    """Decode-only steps: median seconds by draft count, and tokens per decode step."""
    by_drafts: dict[int, list[float]] = {}
    tokens = decode_steps = 0
    for run in runs:
        for step in run.steps:
            if step.prefill or not step.rows:
                continue
            by_drafts.setdefault(step.drafts, []).append(step.seconds)
            decode_steps += 1
            tokens += step.rows - step.drafts + step.accepted
    return {
        "median_ms_by_drafts": {
            k: round(statistics.median(v) * 1e3, 3) for k, v in sorted(by_drafts.items())
        },
        "steps_by_drafts": {k: len(v) for k, v in sorted(by_drafts.items())},
        "tokens_per_decode_step": tokens / decode_steps if decode_steps else 0.0,
        "prefill_seconds": sum(s.seconds for r in runs for s in r.steps if s.prefill) / len(runs),
    }


def steady_tok_s(runs: list[Run]) -> float:
    """tok/s with every step priced at the median of its kind over all the side's runs (kind: prefill or
    decode, and its rows): what the runs would take without a neighbour's bursts, which on a shared 2-core
    machine stall single steps of 2 threads by up to ~1.5 s."""
    prices: dict[tuple[bool, int], list[float]] = {}
    for run in runs:
        for step in run.steps:
            prices.setdefault((step.prefill, step.rows), []).append(step.seconds)
    median = {kind: statistics.median(v) for kind, v in prices.items()}
    seconds = sum(median[(step.prefill, step.rows)] for run in runs for step in run.steps)
    return sum(run.tokens for run in runs) / seconds


def best_tok_s(runs: list[Run]) -> float:
    """tok/s with each turn at its fastest over the rounds (single stream; every round's turns are the same)."""
    best = [min(seconds) for seconds in zip(*(run.turn_seconds for run in runs))]
    return runs[0].tokens / sum(best)


def acceptance(runs: list[Run]) -> dict[str, float]:
    total = {k: sum(r.spec[k] for r in runs) for k in ("verifications", "drafted", "accepted")}
    return {
        **total,
        "accepted_per_drafted": total["accepted"] / total["drafted"] if total["drafted"] else 0.0,
        "tokens_per_verification": (total["accepted"] + total["verifications"])
        / total["verifications"]
        if total["verifications"]
        else 0.0,
    }


def by_kind(runs: list[Run]) -> dict[str, float]:
    """tok/s of each turn kind over all rounds (single stream)."""
    totals: dict[str, list[float]] = {}
    for run in runs:
        for kind, output, seconds in zip(run.kinds, run.outputs, run.turn_seconds):
            t = totals.setdefault(kind, [0.0, 0.0])
            t[0] += len(output)
            t[1] += seconds
    return {kind: round(t[0] / t[1], 1) for kind, t in totals.items()}


def replay(requests: list[Request], outputs: list[list[int]], k: int) -> dict[str, float]:
    """The n-gram proposer replayed over finished turns (no engine): at each step it proposes up to ``k`` tokens
    (always, no draft-length back-off) and keeps them while they equal the reply. How many steps find no
    proposal at all tells a proposer that finds nothing from a draft length that chose none."""
    steps = empty = drafted = kept = tokens = 0
    for (prompt, params), reply in zip(requests, outputs):
        known, index, context = prompt + reply, NgramIndex(), None
        if params.speculative_context:
            context = (NgramIndex(), params.speculative_context)
            context[0].update(context[1], len(context[1]))
        position = len(prompt)
        while position < len(known):
            proposal = index.propose(known, position, min(k, len(known) - position - 1), context)
            run = 0
            while run < len(proposal) and proposal[run] == known[position + run]:
                run += 1
            steps, empty = steps + 1, empty + (not proposal)
            drafted, kept, tokens = drafted + len(proposal), kept + run, tokens + run + 1
            position += run + 1
    return {
        "steps": steps,
        "steps_without_proposal": empty,
        "tokens_per_step": tokens / steps,
        "kept_per_drafted": kept / drafted if drafted else 0.0,
    }


# main ----------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=8, help="0: skip the concurrent scenarios")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--json",
        metavar="PATH",
        default="auto",
        help="write the numbers here (auto: docs/results/speculative-cpu-<level>-<date>.json; '': nowhere)",
    )
    parser.add_argument(
        "--replay",
        action="store_true",
        help="only the plain engine's turns once, and the proposer replayed over them (no timing)",
    )
    parser.add_argument(
        "--profile-steps",
        action="store_true",
        help="only the first edit turn on the ngram engine, its native step's phases by draft count",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.streams < 0 or args.threads < 1:
        parser.error("--rounds and --threads must be >= 1, --streams >= 0")
    return args


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    if args.replay:
        replay_only(args)
        return
    if args.profile_steps:
        profile_steps(args)
        return
    load_before = record.load_average()
    engines = {
        "plain": LLM(num_threads=args.threads),
        "spec": LLM(
            num_threads=args.threads,
            speculative="ngram",
            num_speculative_tokens=args.num_speculative_tokens,
        ),
    }
    for llm in engines.values():  # one-time costs outside timing
        llm.generate(["Hello"] * 2, SamplingParams(temperature=0, max_tokens=8))
    workloads = {"repetitive": REPETITIVE, "non-repetitive": NON_REPETITIVE}
    single = {w: {side: Side() for side in engines} for w in workloads}
    batch = {w: {side: Side() for side in engines} for w in workloads}
    requests: dict[str, list[Request]] = {}
    loads = []
    for round_ in range(args.rounds):
        loads.append(record.load_average())
        order = list(engines) if round_ % 2 == 0 else list(reversed(engines))
        for name, turns in workloads.items():
            sessions = {side: Sessions(engines[side], turns) for side in order}
            for _ in turns:  # the sides take turns turn by turn
                for side in order:
                    sessions[side].next_turn()
            for side in order:
                run = sessions[side].finish()
                requests.setdefault(name, sessions[side].requests)
                single[name][side].runs.append(run)
                logger.info("round %d, %s, %s, 1 stream: %.1f tok/s", round_, name, side, run.tok_s)
            if args.streams:
                reqs = (requests[name] * args.streams)[: args.streams]
                kinds = [t.kind for t in (turns * args.streams)[: args.streams]]
                for side in order:
                    run = run_batch(engines[side], reqs, kinds)
                    batch[name][side].runs.append(run)
                    logger.info(
                        "round %d, %s, %s, %d streams: %.1f tok/s",
                        round_,
                        name,
                        side,
                        args.streams,
                        run.tok_s,
                    )
    env = record.environment(
        __spec__.name,
        "cpu",
        load_before=load_before,
        threads=args.threads,
        cpu_isa=native_level(engines["plain"]),
        cpu_weights=engines["plain"].engine.config.cpu_weights,
    )
    results = summarise(workloads, single, batch, args)
    results["environment"] = env
    results["load_average_by_round"] = loads
    path = default_json(env["cpu_isa"]) if args.json == "auto" else args.json
    record.write_json(path, results)
    report(results, env, args)


def replay_only(args: argparse.Namespace) -> None:
    llm = LLM(num_threads=args.threads)
    for name, turns in (("repetitive", REPETITIVE), ("non-repetitive", NON_REPETITIVE)):
        sessions = Sessions(llm, turns)
        for _ in turns:
            sessions.next_turn()
        found = replay(sessions.requests, sessions.run.outputs, args.num_speculative_tokens)
        print(
            f"{name}: the proposer replayed at k={args.num_speculative_tokens}: {json.dumps(found)}"
        )


def profile_steps(args: argparse.Namespace) -> None:
    """The first edit turn on the ngram engine, each decode step under torch's profiler: the native step's
    ranges (``decode_layers``, and inside it ``attend`` and the layer loop) by the step's draft count, in ms."""
    from torch.profiler import ProfilerActivity, profile

    llm = LLM(
        num_threads=args.threads,
        speculative="ngram",
        num_speculative_tokens=args.num_speculative_tokens,
    )
    prompt = llm.chat_prompt_ids([{"role": "user", "content": REPETITIVE[0].message}])
    params = turn_params(REPETITIVE[0], [])
    run_requests(llm, [(prompt, params)], "profile-warm-up")
    engine = llm.engine
    engine.add_request("profile", prompt, params, cache_salt="profile")
    engine.step()  # its prefill
    totals: dict[int, dict[str, float]] = {}
    counts: dict[int, int] = {}
    while engine.has_unfinished_requests():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            engine.step()
            wall = time.perf_counter() - start
        batch = engine.last_batch
        drafts = sum(batch.drafts.values()) if batch is not None else 0
        counts[drafts] = counts.get(drafts, 0) + 1
        total = totals.setdefault(drafts, {"wall": 0.0})
        total["wall"] += wall * 1e3
        for event in prof.key_averages():
            if event.key.startswith("pagedchat"):
                total[event.key] = total.get(event.key, 0.0) + event.cpu_time_total / 1e3
    for drafts in sorted(counts):
        mean = {key: round(v / counts[drafts], 2) for key, v in totals[drafts].items()}
        print(f"{drafts} drafts, {counts[drafts]} steps, mean ms: {json.dumps(mean)}")


def summarise(
    workloads: dict[str, tuple[Turn, ...]],
    single: dict[str, dict[str, Side]],
    batch: dict[str, dict[str, Side]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "workload": "speculative-cpu",
        "k": args.num_speculative_tokens,
        "rounds": args.rounds,
    }
    for name, turns in workloads.items():
        kinds = [t.kind for t in turns]
        plain, spec = single[name]["plain"], single[name]["spec"]
        checks = [compare(name, a, b, kinds) for a, b in zip(plain.runs, spec.runs)]
        entry: dict[str, Any] = {
            "single": {
                "plain_tok_s": [round(r.tok_s, 2) for r in plain.runs],
                "spec_tok_s": [round(r.tok_s, 2) for r in spec.runs],
                "plain_median_tok_s": round(plain.median_tok_s, 2),
                "spec_median_tok_s": round(spec.median_tok_s, 2),
                "ratio": round(spec.median_tok_s / plain.median_tok_s, 3),
                "round_ratios": [
                    round(b.tok_s / a.tok_s, 3) for a, b in zip(plain.runs, spec.runs)
                ],
                "plain_steady_tok_s": round(steady_tok_s(plain.runs), 2),
                "spec_steady_tok_s": round(steady_tok_s(spec.runs), 2),
                "steady_ratio": round(steady_tok_s(spec.runs) / steady_tok_s(plain.runs), 3),
                "plain_best_turns_tok_s": round(best_tok_s(plain.runs), 2),
                "spec_best_turns_tok_s": round(best_tok_s(spec.runs), 2),
                "best_ratio": round(best_tok_s(spec.runs) / best_tok_s(plain.runs), 3),
                "tokens": plain.runs[0].tokens,
                "acceptance": acceptance(spec.runs),
                "plain_steps": step_summary(plain.runs),
                "spec_steps": step_summary(spec.runs),
                "plain_tok_s_by_kind": by_kind(plain.runs),
                "spec_tok_s_by_kind": by_kind(spec.runs),
                "seeded_differ_in_turns": sorted(
                    {i for c in checks for i in c["seeded_differ_in_turns"]}
                ),
                "greedy_identical": True,
            }
        }
        if args.streams:
            bp, bs = batch[name]["plain"], batch[name]["spec"]
            checks = [
                compare(f"{name}, batch", a, b, bp.runs[0].kinds) for a, b in zip(bp.runs, bs.runs)
            ]
            entry["streams"] = {
                "streams": args.streams,
                "plain_tok_s": [round(r.tok_s, 2) for r in bp.runs],
                "spec_tok_s": [round(r.tok_s, 2) for r in bs.runs],
                "plain_median_tok_s": round(bp.median_tok_s, 2),
                "spec_median_tok_s": round(bs.median_tok_s, 2),
                "ratio": round(bs.median_tok_s / bp.median_tok_s, 3),
                "round_ratios": [round(b.tok_s / a.tok_s, 3) for a, b in zip(bp.runs, bs.runs)],
                "plain_steady_tok_s": round(steady_tok_s(bp.runs), 2),
                "spec_steady_tok_s": round(steady_tok_s(bs.runs), 2),
                "steady_ratio": round(steady_tok_s(bs.runs) / steady_tok_s(bp.runs), 3),
                "best_ratio": round(
                    max(r.tok_s for r in bs.runs) / max(r.tok_s for r in bp.runs), 3
                ),
                "acceptance": acceptance(bs.runs),
                "seeded_differ": sorted({i for c in checks for i in c["seeded_differ_in_turns"]}),
                "greedy_identical": True,
            }
        out[name] = entry
    return out


def report(results: dict[str, Any], env: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"\n## speculative-cpu: SmolLM2-135M-Instruct at {env['cpu_isa']}, ngram k={args.num_speculative_tokens}, "
        f"medians of {args.rounds} interleaved rounds\n"
    )
    print(
        "| workload | streams | plain tok/s | ngram tok/s | ngram / plain | rounds | best | steady "
        "| drafts kept | tokens / verify |"
    )
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    for name in ("repetitive", "non-repetitive"):
        for scenario in ("single", "streams"):
            if scenario not in results[name]:
                continue
            r = results[name][scenario]
            acc = r["acceptance"]
            print(
                f"| {name} | {r.get('streams', 1)} | {r['plain_median_tok_s']:.1f} | {r['spec_median_tok_s']:.1f} "
                f"| {r['ratio']:.2f}x | {r['round_ratios']} "
                f"| {r['best_ratio']:.2f}x | {r['steady_ratio']:.2f}x "
                f"| {acc['accepted_per_drafted']:.2f} | {acc['tokens_per_verification']:.2f} |"
            )
    for name in ("repetitive", "non-repetitive"):
        r = results[name]["single"]
        print(
            f"\n{name}, 1 stream: decode step ms by drafts plain {r['plain_steps']['median_ms_by_drafts']}, "
            f"spec {r['spec_steps']['median_ms_by_drafts']} (steps {r['spec_steps']['steps_by_drafts']}); "
            f"tokens per decode step {r['spec_steps']['tokens_per_decode_step']:.2f}; "
            f"tok/s by turn kind plain {r['plain_tok_s_by_kind']}, spec {r['spec_tok_s_by_kind']}; "
            f"seeded turns that differ {r['seeded_differ_in_turns']}"
        )
    print(
        f"\ngreedy outputs identical (plain vs ngram, every turn, every round); {record.environment_line(env)}"
    )
    print(json.dumps({k: v for k, v in results.items() if k != "environment"}, default=str))


def default_json(level: str) -> str:
    return f"docs/results/speculative-cpu-{level}-{datetime.date.today().isoformat()}.json"


if __name__ == "__main__":
    main()
