"""What every benchmark shares (no script here is run on its own).

- ``record``: where and when a run happened (UTC date, the command, device, library versions, load average
  before and after), its one printed line, its JSON file, and the clear exit of a GPU-only script without a GPU.
- ``workloads``: the request generators of WORKLOADS.md (``nano``, ``shared-prefix``), seeded, the same for every
  script and every peer.
- ``engine``: the dummy-weights engine from the common engine options, greedy sampling, a warm-up, freeing an
  engine, one run's throughput (``Run``), the Triton variants compiled.
- ``peers``: the peers run in the same command: transformers continuous batching (nano), transformers
  ``generate`` and llama.cpp on the GGUF file (cpu).
- ``graph_timing``: Triton's CUDA-graph timing after the current stream's work (inputs written) is done.
"""
