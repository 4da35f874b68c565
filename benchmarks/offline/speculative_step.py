"""Speculative decoding's verify step against a plain decode step (issue 55's GPU acceptance), and what n-gram
drafts give end to end on one stream.

Part 1, the step: B sequences are prefilled (prompts of ``--input-len`` ids), then two step shapes are timed on
the same sequences, alternately, with CUDA events around the model runner's ``execute`` and the sampled ids' read
(the device's time for the pass and its sampling, and the host's packing): a plain decode step (B rows) and a
verify step with ``k`` drafts per sequence (B * (1 + k) rows, replayed from the verify graphs). A verify step's
drafts are taken out again after it and nothing advances, so every repetition runs the very same shapes at the same
contexts. Medians over ``--repeats``; the ratio verify / decode is the acceptance's number (<= 1.3x at k = 4,
batch 1).

Part 2, end to end: one stream at a time, greedy, ``--new-tokens`` each, plain and ``--speculative ngram`` engines
built in turn in the same process, on prompts of a public-domain-style English text written for this benchmark with
a repeated passage (what a quote-and-answer or edit turn holds). With dummy weights the model's tokens follow no
text, so the acceptance here says what the drafts cost and give on that model's own (often looping) output, not
what a real model's chat gets (benchmarks/cpu/speculative.py measures that with real weights).

    python -m benchmarks.offline.speculative_step --model-config llama-3.2-1b --batches 1 2 4 8 --drafts 1 2 4

With ``--draft-model NAME`` the drafts come from a draft model instead (e.g. llama-3.2-1b for llama-3-8b, the
same tokenizer): the verify step then includes the draft's pass over the verify rows (its KV), a drafted step's
``k`` propose passes are timed on their own (CUDA graphs replayed, the drafts read), and the end-to-end part runs
plain against the draft model. With dummy weights a draft of other weights is never right; the model drafting for
itself (``--draft-model`` = ``--model-config``) is the upper bound (every draft right in float32).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path
from random import Random
from typing import Any

import torch

PASSAGE = (
    "The river ran slowly past the old mill, where the miller's daughter kept the accounts of every sack of grain "
    "that came down from the hills. Each morning she wrote the weight, the farm and the price in a green book, "
    "and each evening she read the figures back to her father, who trusted no number he had not heard twice."
)


def build_engine(
    args: argparse.Namespace, speculative: bool, max_batch: int, drafts: int, **more: Any
) -> Any:
    from engine.llm_engine import LLMEngine

    options = dict(
        load_format="dummy",
        model_config=args.model_config,
        device="cuda",
        max_model_len=args.max_model_len,
        max_num_seqs=max(8, max_batch),
        num_kv_blocks=2048,  # (a set pool: engines built in turn need no free-memory probe)
        **more,
    )
    if speculative:
        options.update(
            num_speculative_tokens=drafts,
            speculative_max_batch=max_batch,
            **(
                {"speculative_model": args.draft_model}
                if args.draft_model
                else {"speculative": "ngram"}
            ),
        )
    return LLMEngine(**options)


def prefill(engine: Any, prompts: list[list[int]], max_tokens: int) -> list[Any]:
    """Add the prompts and step until every one is decoding; their sequences."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, speculative=False
    )
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    core = engine.core
    while True:
        engine.step()
        batch = core.last_batch
        if batch is not None and batch.num_decodes == len(prompts) == len(batch.seqs):
            return list(batch.seqs)


def time_shapes(engine: Any, seqs: list[Any], drafts: int, repeats: int) -> dict[str, float]:
    """Median ms of a plain decode step and of a verify step with ``drafts`` drafts a sequence (CUDA events)."""
    from engine.core.scheduled_batch import ScheduledBatch

    core = engine.core
    runner, blocks = core.runner, core.block_manager
    for seq in seqs:  # (room for the drafts' KV; the blocks stay the sequence's)
        assert blocks.allocate(seq, 1 + drafts)
    rng = Random(0)
    draft = runner.draft  # (a draft model: its k propose passes timed too)
    shapes = ("decode", "verify") + (("propose",) if draft is not None else ())
    times: dict[str, list[float]] = {shape: [] for shape in shapes}
    for repeat in range(repeats + 3):
        for shape in shapes:
            if shape == "propose":
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                torch.cuda.synchronize()
                start.record()
                # (a sequence that drafted last step: no catch-up; its drafts read, synchronised)
                known = [seq.num_computed_tokens for seq in seqs]
                draft.propose(list(seqs), [drafts] * len(seqs), known)
                end.record()
                torch.cuda.synchronize()
                if repeat >= 3:
                    times[shape].append(start.elapsed_time(end))
                continue
            if shape == "verify":
                for seq in seqs:
                    seq.token_ids.extend(rng.randrange(1000) for _ in range(drafts))
                batch = ScheduledBatch(
                    seqs=list(seqs),
                    num_new_tokens=[1 + drafts] * len(seqs),
                    drafts={seq: drafts for seq in seqs},
                )
            else:
                batch = ScheduledBatch(seqs=list(seqs), num_new_tokens=[1] * len(seqs))
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            runner.execute(batch, None).wait()
            end.record()
            torch.cuda.synchronize()
            if shape == "verify":
                for seq in seqs:
                    del seq.token_ids[-drafts:]
            if repeat >= 3:  # (the first replays: untimed)
                times[shape].append(start.elapsed_time(end))
    decode, verify = statistics.median(times["decode"]), statistics.median(times["verify"])
    row = {"decode_ms": decode, "verify_ms": verify, "ratio": verify / decode}
    if draft is not None:  # (a drafted step: its proposals, then its verification)
        propose = statistics.median(times["propose"])
        row.update(propose_ms=propose, drafted_step_ratio=(propose + verify) / decode)
    return row


def step_costs(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    # (the runner's passes alone, timed one at a time: no step in flight holds a pending token)
    engine = build_engine(args, True, max(args.batches), max(args.drafts), async_scheduling=False)
    graphs = engine.core.runner.decode_graphs
    for batch in args.batches:
        rng = Random(batch)
        prompts = [
            [rng.randrange(1000, 20000) for _ in range(args.input_len)] for _ in range(batch)
        ]
        seqs = prefill(engine, prompts, args.max_model_len - args.input_len - 8)
        for drafts in args.drafts:
            row = {
                "batch": batch,
                "drafts": drafts,
                **time_shapes(engine, seqs, drafts, args.repeats),
            }
            row["verify_graph"] = graphs.verify_graphs is not None and bool(
                graphs.padded_size(batch * (1 + drafts), shared=True)
            )
            print(json.dumps(row), flush=True)
            rows.append(row)
        for i in range(batch):
            engine.abort_request(f"r{i}")
        while engine.has_unfinished_requests():
            engine.step()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def end_to_end(args: argparse.Namespace) -> list[dict[str, Any]]:
    from engine.sampling_params import SamplingParams

    rng = Random(1)
    # token ids standing for the passage: a fixed random vocabulary walk, the passage repeated twice
    words = PASSAGE.split()
    vocab = {w: rng.randrange(1000, 30000) for w in words}
    passage_ids = [vocab[w] for w in words]
    prompt = passage_ids + [rng.randrange(1000, 30000) for _ in range(40)] + passage_ids[:20]
    results = []
    outputs: dict[str, list[int]] = {}
    # plain; n-gram drafts; n-gram drafts with plain's output as speculative_context (a regenerated turn whose
    # reply comes out the same: the drafts' best case)
    modes = ("plain", "draft") if args.draft_model else ("plain", "ngram", "ngram+context")
    for mode in modes * 2:
        context = outputs.get("plain", []) if mode == "ngram+context" else []
        params = SamplingParams(
            temperature=0.0,
            max_tokens=args.new_tokens,
            ignore_eos=True,
            speculative_context=context,
        )
        engine = build_engine(args, mode != "plain", 1, 4, dtype=args.e2e_dtype)
        engine.add_request("warm", prompt, SamplingParams(max_tokens=8, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        torch.cuda.synchronize()
        before = engine.core.stats()
        phases = ("schedule", "prepare", "launch", "wait", "output")
        counters = engine.core.counters
        spent = {name: getattr(counters, f"{name}_seconds") for name in phases}
        synced = [
            0,
            0.0,
        ]  # (steps that read the step in flight first; the draft's proposals' seconds)
        needs = engine.core._needs_known_tokens

        def counted(batch, needs=needs):
            known = needs(batch)
            synced[0] += bool(known)
            return known

        engine.core._needs_known_tokens = counted
        draft = engine.core.runner.draft
        if draft is not None:
            propose = draft.propose

            def timed(*args, propose=propose):
                begin = time.perf_counter()
                try:
                    return propose(*args)
                finally:
                    synced[1] += time.perf_counter() - begin

            draft.propose = timed
        start = time.perf_counter()
        engine.add_request("e2e", prompt, params)
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    tokens = list(output.token_ids)
        seconds = time.perf_counter() - start
        stats = engine.core.stats()
        outputs.setdefault(mode, tokens)
        steps = stats.steps - before.steps
        row = {
            "mode": mode,
            "tok_s": len(tokens) / seconds,
            "steps": steps,
            "verifications": stats.spec_verifications - before.spec_verifications,
            "drafted": stats.spec_draft_tokens - before.spec_draft_tokens,
            "accepted": stats.spec_accepted_tokens - before.spec_accepted_tokens,
            "tokens_per_step": len(tokens) / max(1, steps),
            "steps_read_in_sync": synced[0],
            "propose_ms": 1000 * synced[1],
            # (host phases over the run, ms: where a slower mode's time went)
            **{
                f"{name}_ms": 1000 * (getattr(counters, f"{name}_seconds") - spent[name])
                for name in phases
            },
        }
        print(json.dumps(row), flush=True)
        results.append(row)
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    equal = {mode: outputs[mode] == outputs["plain"] for mode in outputs}
    results.append({"greedy_equal_to_plain": equal})
    print(json.dumps(results[-1]), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-config", default="llama-3.2-1b")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--drafts", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument(
        "--e2e-dtype",
        default="bfloat16",
        help="the end-to-end part's dtype (float32: the verify and decode paths agree to the token, so a "
        "context of plain decoding's output is the drafts' best case)",
    )
    parser.add_argument(
        "--draft-model",
        default=None,
        help="a named dummy architecture as the draft model (speculative_model) instead of n-gram drafts; "
        "the model's own name drafts for itself (the same seeded weights: float32 accepts every draft)",
    )
    parser.add_argument("--skip-steps", action="store_true", help="only the end-to-end part")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    result = {
        "device": torch.cuda.get_device_name(),
        "model_config": args.model_config,
        "draft_model": args.draft_model,
        "steps": [] if args.skip_steps else step_costs(args),
        "e2e_dtype": args.e2e_dtype,
        "end_to_end": end_to_end(args),
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
