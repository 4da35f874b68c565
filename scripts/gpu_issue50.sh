#!/usr/bin/env bash
# Issue 50's checks on a GPU machine (the device tool's H200): the new families and GGUF loading through CUDA
# graphs, the windowed kernels compiled, and the nano workload on a Qwen3-MoE-shaped model beside its dense twin.
# Expects the wheels of .whl installed on PYTHONPATH (see docs/benchmarks/README.md) and $OUT for the results.
set -u
export PYTHONUNBUFFERED=1
python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())'
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_models_gpu.py tests/kernels/test_window_attention.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -25
for arch in qwen3-30b-a3b qwen3-30b-a3b-dense; do
  timeout $([ "$arch" = qwen3-30b-a3b ] && echo 170 || echo 110) python3 -m benchmarks.offline.nano --model-config "$arch" --no-peer --no-split --max-model-len 4096 \
    --json "$OUT/nano-$arch.json" 2>&1 | grep -v Warning | tail -6
done
