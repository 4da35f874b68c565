// Shared by the native CPU kernels (kernels/cpu_native.py builds them into one library): the quantized matmuls
// (cpu_quant_matmul.cpp) that the decode step (cpu_decode.cpp) calls, and the registration of every op there.
#pragma once

#include <ATen/ATen.h>

#include <string>

// One library per instruction-set level, each with its own op namespace (torch.ops.pagedchat_cpu_avx2, ...) and
// C++ namespace, so that one process can load several levels side by side (the tests compare them).
#ifndef PAGEDCHAT_CPU_NS
#define PAGEDCHAT_CPU_NS pagedchat_cpu
#endif
// (through a second macro, so that the namespace argument is expanded before TORCH_LIBRARY pastes it)
#define PAGEDCHAT_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define PAGEDCHAT_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

namespace PAGEDCHAT_CPU_NS {

inline void check(bool ok, const char* what) { TORCH_CHECK(ok, "pagedchat_cpu: ", what); }

// logits [M, N] = x [M, K] float32 times int8 weights packed [N / 16, K, 16] with a scale per output
at::Tensor int8_linear(at::Tensor x, at::Tensor packed, at::Tensor scales);
// [M, N] = x [M, K] float32 (quantized to 8 bits per 32 inputs) times Q4_1 weights (AVX2 and AVX-512 builds)
at::Tensor q4q8_linear(at::Tensor x, at::Tensor packed, at::Tensor d, at::Tensor m);
// [M, N] = x [M, K] float32 (quantized as above) times Q8_0 weights (AVX2 and AVX-512 builds)
at::Tensor q8q8_linear(at::Tensor x, at::Tensor packed, at::Tensor d);
bool has_q4q8();
std::string isa();

}  // namespace PAGEDCHAT_CPU_NS

namespace pagedchat_cpu_level = PAGEDCHAT_CPU_NS;
