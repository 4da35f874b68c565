"""pagedchat's benchmarks, grouped by what they measure. Every number they print names its workload (the team's
WORKLOADS.md), its command, its device and its date; the record of those numbers is docs/BENCHMARKS.md (today's
headline, one table per area) and docs/benchmarks/ (the history behind it, by topic).

- ``benchmarks.kernel``: one kernel or device primitive at a time against its roofline or its peer (decode and
  prefill attention, skinny matmuls, the all-reduce, the persistent decode kernel, CUDA VMM calls). GPU only.
- ``benchmarks.offline``: the engine in process, no HTTP (nano throughput, the decode step, prefix caching,
  KV waste and backends, sharing, offload, tensor parallelism, the host's share of a step).
- ``benchmarks.online``: the server over real HTTP (serve, serve-vs-engine, multi-turn sessions, fairness between
  tenants, the soak under faults, and the costs the front pays per request).
- ``benchmarks.cpu``: the embedded default model on the CPU against transformers and llama.cpp, and the CPU
  kernels and weight formats behind it.
- ``benchmarks.harness``: what the others share: the workloads' request generators, the environment line and
  JSON of a run, the dummy-weights engine, and the peers (transformers, llama.cpp).

Each group's ``__init__`` lists its scripts, one line each; every script is run as ``python -m
benchmarks.GROUP.NAME`` from the repository root, and ``--help`` says what it measures and takes.
"""
