"""How close each ``--cpu-weights`` mode stays to the float32 engine (token-exact with transformers), next to
llama.cpp on the very GGUF file: 16 chat prompts (tests/engine/test_cpu_weights.py's) x 64 greedy tokens (EOS ignored);
per engine, the prompts whose first token equals float32's and the mean share of each output that is identical
to float32's before the first difference.

    python -m benchmarks.cpu.agreement [--modes bfloat16 int8 q4] [--no-llama-cpp] [--json PATH]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.harness import record
from benchmarks.harness.peers import LlamaCppPeer
from engine.llm import LLM
from engine.worker.model_sources import default_gguf_file
from engine.sampling_params import SamplingParams
from tests.engine.test_cpu_weights import NEW_TOKENS, QUESTIONS, first_divergence


def agreement(reference: list[list[int]], outputs: list[list[int]]) -> dict[str, float]:
    first = sum(a[0] == b[0] for a, b in zip(reference, outputs))
    share = sum(first_divergence(a, b) / NEW_TOKENS for a, b in zip(reference, outputs)) / len(
        outputs
    )
    return {"first_token_equal": first, "prompts": len(outputs), "identical_prefix_share": share}


def llama_cpp_tokens(prompts: list[list[int]], threads: int) -> list[list[int]]:
    return LlamaCppPeer(str(default_gguf_file()), threads).generate(prompts, NEW_TOKENS)[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modes", nargs="+", default=["bfloat16", "int8", "q4"])
    parser.add_argument("--no-llama-cpp", dest="llama_cpp", action="store_false")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = record.load_average()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    results: dict[str, dict[str, float]] = {}
    reference_llm = LLM(cpu_weights="float32", num_threads=args.threads)
    prompts = [reference_llm.chat_prompt_ids([{"role": "user", "content": q}]) for q in QUESTIONS]
    reference = [o.token_ids for o in reference_llm.generate(prompts, params)]
    del reference_llm
    for mode in args.modes:
        outputs = [
            o.token_ids
            for o in LLM(cpu_weights=mode, num_threads=args.threads).generate(prompts, params)
        ]
        results[f"pagedchat {mode}"] = agreement(reference, outputs)
    if args.llama_cpp:
        results["llama.cpp (Q4_1 GGUF)"] = agreement(
            reference, llama_cpp_tokens(prompts, args.threads)
        )
    print("\n| engine | first token equal to float32 | identical prefix, mean share |")
    print("|---|---:|---:|")
    for name, r in results.items():
        print(
            f"| {name} | {r['first_token_equal']}/{r['prompts']} | {r['identical_prefix_share']:.2f} |"
        )
    env = record.environment(__spec__.name, "cpu", load_before=load_before, threads=args.threads)
    print(record.environment_line(env))
    record.write_json(args.json, {"environment": env, "engines": results})


if __name__ == "__main__":
    main()
