"""The engine in process (no HTTP), on dummy weights of a named architecture unless said otherwise. Each script
also runs on the CPU with small sizes (its ``--help`` gives the smoke-test flags).

- ``nano``: offline throughput against transformers continuous batching, and the steady decode step (``--split-*``:
  wall, GPU busy and host phases per step) (workload ``nano``; chat latency at 1/16 streams with ``--split-batch``).
  ``python -m benchmarks.offline.nano --model-config llama-3.2-1b``
- ``engine_step``: the engine's steady decode step at batch C, built from the server's own flags: the floor that
  ``benchmarks.online.serve --compare-offline`` holds the served stream against (workload ``serve-vs-engine``;
  a library, no command of its own).
- ``host_step``: the host's work per decode step (schedule, input packing) without a model, on any machine.
  ``python -m benchmarks.offline.host_step --batch 256 --context 640``
- ``step_trace``: each step's wall time and shape over cold and warm passes of nano, and the Triton variants
  compiled. ``python -m benchmarks.offline.step_trace --model-config llama-3.2-1b``
- ``prefix``: TTFT and throughput with prefix caching on and off (workload ``shared-prefix``).
  ``python -m benchmarks.offline.prefix``
- ``waste``: the paper's KV memory table, paged against three reservation modes (workload ``waste``).
  ``python -m benchmarks.offline.waste``; its chart: ``python -m benchmarks.offline.waste_chart PATH``
- ``kv_backends``: paged against vattention on nano: throughput, useful KV share, allocation latency, and the
  decode kernel on each layout. ``python -m benchmarks.offline.kv_backends``; its chart:
  ``python -m benchmarks.offline.kv_backends_chart PATH``
- ``kv_offload``: swap against recompute preemption, and the host tier of the prefix cache.
  ``python -m benchmarks.offline.kv_offload``
- ``kv_restore``: a 32k-token session's KV read back from the disk tier against recomputing it, and nano with the
  tier on and off (workload "Restart", issue 52).
  ``python -m benchmarks.offline.kv_restore --model-config llama-3.2-1b``
- ``sharing``: KV blocks saved by parallel sampling and beam search against independent requests.
  ``python -m benchmarks.offline.sharing``
- ``tensor_parallel``: nano and the decode step at each tensor-parallel size, with the collectives' share.
  ``python -m benchmarks.offline.tensor_parallel --model-config llama-3-8b --sizes 1 2``
"""
