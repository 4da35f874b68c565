"""What a large response_format schema costs, and where: compile + check in a worker thread (as the server does)
with the event loop's longest gap meanwhile, one matcher, and its copies for the other samples of an n > 1 request.

    python -m benchmarks.online.grammar_compile [--entries 20000] [--samples 128]

The schema is an object with one field whose value is a string from an enum of ``--entries`` entries (the shape
of issue 22's 1.4 MB finding). The default model's tokenizer; CPU only; no model weights are loaded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from benchmarks.harness import record
from engine.config import EngineConfig
from engine.worker.tokenizer_files import load_tokenizer
from engine.worker.model_sources import ensure_default_model
from engine.sampling_params import StructuredOutput
from engine.output.grammar_compiler import GrammarCompiler


def enum_schema(entries: int) -> str:
    values = [f"value-{i}-abcabcabcabcabc" for i in range(entries)]
    return json.dumps({"type": "object", "properties": {"x": {"enum": values}}, "required": ["x"]})


async def measure(
    compiler: GrammarCompiler, spec: StructuredOutput, samples: int
) -> dict[str, float]:
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
    compiled = await asyncio.to_thread(compiler.compiled, spec)
    compile_s = time.perf_counter() - start
    tick.cancel()
    start = time.perf_counter()
    matcher = compiler.matcher(compiled)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=20000)
    parser.add_argument("--samples", type=int, default=128, help="n of the request")
    args = parser.parse_args()
    load_before = record.load_average()
    tokenizer = load_tokenizer(ensure_default_model(Path(EngineConfig().cache_dir)))
    compiler = GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    compiler.ll_tokenizer()  # (built once per server; not part of a request's cost)
    result = asyncio.run(
        measure(
            compiler,
            StructuredOutput("json_schema", schema=enum_schema(args.entries)),
            args.samples,
        )
    )
    print(
        f"schema {result['schema_bytes'] / 1e3:.0f} kB ({args.entries} enum entries), n = {args.samples}"
    )
    print(
        f"compile + check in a thread: {result['compile_and_check_s']:.2f} s; the event loop's longest gap "
        f"meanwhile: {result['event_loop_max_gap_ms']:.0f} ms"
    )
    print(
        f"one matcher: {result['one_matcher_ms']:.1f} ms; {args.samples - 1} copies: {result['copies_ms']:.1f} ms "
        f"(one matcher per sample, as before: {result['matchers_built_before_ms']:.0f} ms)"
    )
    print(record.environment_line(record.environment(__spec__.name, "cpu", load_before)))


if __name__ == "__main__":
    main()
