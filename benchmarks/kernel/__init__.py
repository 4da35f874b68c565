"""Kernels and device primitives, one at a time, against their roofline and a peer in the same run (GPU only: on a
machine without CUDA each script still answers ``--help`` and exits with a message naming what it needs).

- ``decode_attention``: paged decode attention, effective TB/s against SDPA and a device copy (workload
  ``decode-kernel``; ``--kv-cache-dtype fp8`` for the FP8 cache). ``python -m benchmarks.kernel.decode_attention``
- ``prefill_attention``: the paged prefill kernel against SDPA's flash backend, TFLOP/s of causal work, with and
  without a cached prefix (``--cuda-graph`` times graph replays). ``python -m benchmarks.kernel.prefill_attention``
- ``skinny_gemm``: decode matmuls of M <= 32 rows against cuBLAS and the weight-read limit, every projection of
  llama-3.2-1b and llama-3-8b. ``python -m benchmarks.kernel.skinny_gemm``
- ``fused_moe``: Qwen3-30B-A3B's MoE layer (kernels/fused_moe.py) at 1-256 tokens against the weight-read limit
  of the experts chosen, beside a dense MLP of the same active bytes (``--sweep`` for launch configs).
  ``python -m benchmarks.kernel.fused_moe``
- ``all_reduce``: the tensor-parallel all-reduce, NCCL against our symmetric-memory kernels, captured in CUDA
  graphs (2+ GPUs). ``python -m benchmarks.kernel.all_reduce --ranks 2``
- ``persistent_chain``: the experiment behind the persistent decode kernel: a decode step's matmul chain in one
  launch against one launch per matmul. ``python -m benchmarks.kernel.persistent_chain``
- ``persistent_decode``: the persistent decode kernel (every decoder layer in one launch) against the layer path
  at 1-16 rows (chat latency; ``--trace`` for a phase profile). ``python -m benchmarks.kernel.persistent_decode``
- ``persistent_l2``: DRAM and L2 counters of one persistent decode launch per variant, through Nsight Compute.
  ``python -m benchmarks.kernel.persistent_l2``
- ``vmm_latency``: CUDA virtual-memory calls (create, map, unmap) per 2 MiB page, the vattention backend's cost.
  ``python -m benchmarks.kernel.vmm_latency``
"""
