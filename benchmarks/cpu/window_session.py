"""A sliding-window model's session on the CPU (issue 50's acceptance): a real Gemma 3 GGUF (512-token windows on
five of every six layers), a ~2,000-token first turn, then the next turn (the first turn's prompt and reply and a
new user message, as a chat client sends it): the share of its prompt found in the prefix cache
(``num_cached_tokens``), the window layers' blocks each sequence held after every decode step against the bound
(window / block + 1; a prefill chunk holds its own tokens' blocks besides, while it runs), and the two turns'
times to the first token.

    python -m benchmarks.cpu.window_session --model gemma-3-270m-*.gguf [--first-turn 2000] [--threads 2]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import record
from engine.llm import LLM
from engine.sampling_params import SamplingParams

STORY = (
    "The lighthouse keeper climbed the spiral stairs each evening, trimmed the wick, polished the lens and wrote "
    "the weather in his log before the ships came past the rocks. "
)


def turn(
    llm: LLM, prompt: list[int], tokens: int, held: list[int], peak: list[int]
) -> tuple[Any, float]:
    """One turn, step by step: its output, its time to the first token; ``held`` gets the window blocks of the
    running sequence after each decode step, ``peak`` after each step."""
    engine = llm.engine
    window = engine.core.block_manager.window
    engine.add_request(f"turn-{time.monotonic_ns()}", prompt, greedy(tokens))
    start, first, final = time.perf_counter(), None, None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.token_ids_delta and first is None:
                first = time.perf_counter() - start
            if output.finished:
                final = output
        running = engine.core.scheduler.running
        peak += [window.held(seq) for seq in running]
        # (its last step was a decode step)
        held += [window.held(seq) for seq in running if seq.num_output_tokens >= 2]
    return final, first


def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, metavar="FILE.gguf")
    parser.add_argument("--first-turn", type=int, default=2000, help="tokens of the first prompt")
    parser.add_argument("--reply", type=int, default=32, help="tokens of each reply")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = record.load_average()
    llm = LLM(model=args.model, num_threads=args.threads)
    window = llm.engine.core.block_manager.window
    if window is None:
        parser.error(f"--model: {Path(args.model).name} has no sliding-window layers")
    block = llm.engine.config.block_size
    text = STORY * (args.first_turn // 28 + 1)
    messages = [{"role": "user", "content": "Summarize this story: " + text}]
    while len(first_prompt := llm.chat_prompt_ids(messages)) > args.first_turn:
        messages[0]["content"] = messages[0]["content"][: -len(STORY)]
    held: list[int] = []
    peak: list[int] = []
    first, first_ttft = turn(llm, first_prompt, args.reply, held, peak)
    messages += [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "Now tell it again in one sentence."},
    ]
    second_prompt = llm.chat_prompt_ids(messages)
    second, second_ttft = turn(llm, second_prompt, args.reply, held, peak)
    bound = -(-window.window // block) + 1
    result = {
        "window": window.window,
        "block_size": block,
        "first_prompt_tokens": len(first_prompt),
        "second_prompt_tokens": len(second_prompt),
        "second_cached_tokens": second.num_cached_tokens,
        "cached_share": second.num_cached_tokens / len(second_prompt),
        "max_window_blocks_held_decoding": max(held),
        "max_window_blocks_held_prefilling": max(peak),
        "bound": bound,
        "first_ttft_s": first_ttft,
        "second_ttft_s": second_ttft,
    }
    env = record.environment(__spec__.name, "cpu", load_before=load_before, threads=args.threads)
    print(
        f"\n{Path(args.model).name}: window {window.window}, blocks of {block}\n"
        f"turn 2: {second.num_cached_tokens} of {len(second_prompt)} prompt tokens cached "
        f"({result['cached_share']:.1%}); TTFT {second_ttft * 1e3:.0f} ms against turn 1's "
        f"{first_ttft * 1e3:.0f} ms ({len(first_prompt)} tokens)\n"
        f"window blocks held per sequence while decoding: at most {max(held)} (bound {bound}); "
        f"with a prefill chunk: {max(peak)}\n"
        f"{record.environment_line(env)}"
    )
    record.write_json(args.json, {"environment": env, "result": result})


if __name__ == "__main__":
    main()
