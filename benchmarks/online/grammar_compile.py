"""What a large response_format schema costs, and where, both ways pagedchat compiles one:
- served: compile + check in a grammar worker process (engine/grammar_worker.py, forked from the zygote), the
  front's event loop's longest gap meanwhile, then the request's matcher and its copies for the other samples of
  an n > 1 request made in the zygote's matcher server (engine/output/remote_matchers.py), as the engine core
  makes them;
- in process (the offline ``LLM``): compile + check on a thread of this process (the event loop's gap as above:
  the thread holds the GIL part of the time), one matcher and its copies here.

    python -m benchmarks.online.grammar_compile [--entries 20000] [--samples 128] [--json PATH]

The schema is an object with one field whose value is a string from an enum of ``--entries`` entries (the shape
of issue 22's 1.4 MB finding). The default model's tokenizer; CPU only; no model weights are loaded. Building
the tokenizer's grammar form (once per server or process, before any request) is not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from benchmarks.harness import record
from engine.config import EngineConfig
from engine.grammar_side import GrammarSide
from engine.output.grammar_compiler import GrammarCompiler
from engine.sampling_params import StructuredOutput
from engine.worker.model_sources import ensure_default_model
from engine.worker.tokenizer_files import load_tokenizer


def enum_schema(entries: int) -> str:
    values = [f"value-{i}-abcabcabcabcabc" for i in range(entries)]
    return json.dumps({"type": "object", "properties": {"x": {"enum": values}}, "required": ["x"]})


async def measure(
    compile_spec: Callable[[StructuredOutput], Awaitable[StructuredOutput]],
    matchers: GrammarCompiler,
    spec: StructuredOutput,
    samples: int,
) -> dict[str, float]:
    """``compile_spec`` timed with the event loop's gaps meanwhile; then ``matchers``'s matcher for it and its
    copies."""
    gaps: list[float] = []

    async def ticker() -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    start = time.perf_counter()
    compiled = await compile_spec(spec)
    compile_s = time.perf_counter() - start
    tick.cancel()
    start = time.perf_counter()
    matcher = matchers.matcher(compiled)
    matcher_s = time.perf_counter() - start
    start = time.perf_counter()
    copies = [matcher.deep_copy() for _ in range(samples - 1)]
    copies_s = time.perf_counter() - start
    assert len(copies) == samples - 1
    return {
        "schema_bytes": len(spec.schema),
        "compile_and_check_s": compile_s,
        "event_loop_max_gap_ms": 1000 * max(gaps, default=0.0),
        "one_matcher_ms": 1000 * matcher_s,
        "copies_ms": 1000 * copies_s,
        "matchers_built_before_ms": 1000 * matcher_s * samples,
    }


async def served(
    model_dir: Path, tokenizer: Any, spec: StructuredOutput, samples: int
) -> dict[str, float]:
    """The server's way: a worker process compiles, the zygote's matcher server holds the matchers."""
    side = GrammarSide()
    side.start(model_dir, workers=2)
    eos = (tokenizer.eos_token_id,)
    try:
        workers = side.pool(str(model_dir), len(tokenizer), eos)
        await workers.start()  # (the zygote built, the workers forked: before any request)
        core = GrammarCompiler(None, len(tokenizer), eos)
        core.use_remote(side.matchers_path)
        deadline = time.monotonic() + 60
        while not os.path.exists(side.matchers_path) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        result = await measure(workers.compile, core, spec, samples)
        assert workers.pids, "the compile ran in a worker process"
        return result
    finally:
        side.close()


def in_process(tokenizer: Any, spec: StructuredOutput, samples: int) -> dict[str, float]:
    """The offline engine's way: a thread of this process compiles, the matchers live here."""
    compiler = GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    compiler.ll_tokenizer()  # (built once per process; not part of a request's cost)

    async def compile_spec(spec: StructuredOutput) -> StructuredOutput:
        return await asyncio.to_thread(compiler.compiled, spec)

    return asyncio.run(measure(compile_spec, compiler, spec, samples))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=20000)
    parser.add_argument("--samples", type=int, default=128, help="n of the request")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    load_before = record.load_average()
    model_dir = ensure_default_model(Path(EngineConfig().cache_dir))
    tokenizer = load_tokenizer(model_dir)
    spec = StructuredOutput("json_schema", schema=enum_schema(args.entries))
    results = {
        "served": asyncio.run(served(model_dir, tokenizer, spec, args.samples)),
        "in_process": in_process(tokenizer, spec, args.samples),
    }
    print(
        f"schema {len(spec.schema) / 1e3:.0f} kB ({args.entries} enum entries), n = {args.samples}"
    )
    for way, where in (("served", "a grammar worker process"), ("in_process", "a thread")):
        result = results[way]
        print(
            f"{way}: compile + check in {where}: {result['compile_and_check_s']:.2f} s; the event "
            f"loop's longest gap meanwhile: {result['event_loop_max_gap_ms']:.0f} ms; one matcher: "
            f"{result['one_matcher_ms']:.1f} ms; {args.samples - 1} copies: {result['copies_ms']:.1f} ms"
        )
    env = record.environment(__spec__.name, "cpu", load_before)
    print(record.environment_line(env))
    record.write_json(args.json, dict(environment=env, entries=args.entries, **results))


if __name__ == "__main__":
    main()
