"""The embedded default model (SmolLM2-135M-Instruct, its 4-bit GGUF) on the CPU, against what a CPU user would
pick instead, and the CPU kernels and weight formats behind it.

- ``throughput``: 1 and 8 streams of 128 tokens and a 500-token prompt's TTFT, against transformers and llama.cpp
  built for the same instruction-set level (workload ``cpu``; ``--isa avx2|avx512|avx512_vnni``).
  ``python -m benchmarks.cpu.throughput --peer transformers llama-cpp`` (``make bench-cpu``)
- ``own_gguf``: a user's GGUF file (K-quants) against llama.cpp on the same file: time to healthy, 16-token
  greedy agreement, 1/8-stream tok/s, TTFT, resident memory (workload "your own GGUF").
  ``python -m benchmarks.cpu.own_gguf --model FILE.gguf --llama-cpp-dir DIR``
- ``make_kquants``: Q4_K_M / Q5_K_M / Q6_K / Q8_0 files of one model by llama.cpp's own quantizer.
  ``python -m benchmarks.cpu.make_kquants --out DIR``
- ``window_session``: a sliding-window GGUF's next turn after a 2,000-token turn: cached share, window blocks held.
  ``python -m benchmarks.cpu.window_session --model gemma-3-*.gguf``
- ``step``: where a CPU decode step spends its time, per path (modules, lean Python, native step).
  ``python -m benchmarks.cpu.step``
- ``agreement``: how close each ``--cpu-weights`` mode stays to the float32 engine, beside llama.cpp on the GGUF.
  ``python -m benchmarks.cpu.agreement``
- ``kv_fp8_quality``: how far an FP8 KV cache moves the default model's greedy output, with the weights' own drift
  for scale. ``python -m benchmarks.cpu.kv_fp8_quality``
- ``quant_linear``: each weight-only quantized matmul on the default model's shapes, torch's and ours.
  ``python -m benchmarks.cpu.quant_linear``
- ``linear_layout``: why CPU linear weights are kept column-major: one matmul, three memory layouts.
  ``python -m benchmarks.cpu.linear_layout``
- ``busy_prefill``: a 2,000-token prompt's TTFT quiet and beside a busy-looping neighbour, alone and beside a
  stream (issue 49: busy <= 2x quiet). ``python -m benchmarks.cpu.busy_prefill``
- ``busy_structured_output``: 20 ``response_format`` requests (json_object, three schemas) to a server started
  beside a busy-looping neighbour, the first at once after /health (issue 49: all valid, none a 400).
  ``python -m benchmarks.cpu.busy_structured_output``
- ``kv_restart``: a 2,000-token session's next turn after a server restart (its KV read back from the disk tier)
  against the same turn warm and a cold re-prefill; ``--redis``: the next turn on a second server of one Redis
  (workload "Restart", issue 52). ``python -m benchmarks.cpu.kv_restart [--redis]``
- ``speculative``: n-gram speculative decoding against plain decoding on edit / quote / summarise / regenerate chat
  turns and on open questions, 1 and 8 streams, interleaved (workload "speculative-cpu", issue 55).
  ``python -m benchmarks.cpu.speculative``
"""
