// Shared by the native CPU kernels (kernels/cpu_native.py builds them into one library): the quantized matmuls
// (cpu_quant_matmul.cpp) that the decode step (cpu_decode.cpp) calls, and the registration of every op there.
#pragma once

#include <ATen/ATen.h>

namespace pagedchat_cpu {

inline void check(bool ok, const char* what) { TORCH_CHECK(ok, "pagedchat_cpu: ", what); }

// logits [M, N] = x [M, K] float32 times int8 weights packed [N / 16, K, 16] with a scale per output
at::Tensor int8_linear(at::Tensor x, at::Tensor packed, at::Tensor scales);
// [M, N] = x [M, K] float32 (quantized to 8 bits per 32 inputs) times Q4_1 weights (AVX-512 VNNI builds only)
at::Tensor q4q8_linear(at::Tensor x, at::Tensor packed, at::Tensor d, at::Tensor m);
// [M, N] = x [M, K] float32 (quantized as above) times Q8_0 weights (AVX-512 VNNI builds only)
at::Tensor q8q8_linear(at::Tensor x, at::Tensor packed, at::Tensor d);
bool has_q4q8();

}  // namespace pagedchat_cpu
