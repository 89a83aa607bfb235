// Linear layers over GGUF block formats as llama.cpp stores them (ggml-quants.c's layouts), computed on the
// blocks in memory: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL (32 weights a block), Q4_K, Q5_K, Q6_K (256 a
// super-block). A few rows (decode): 256 weights of a row at a time are dequantized into L1 by vector code
// (every type), then every row's float32 activations multiply them, the rows' accumulators in registers.
// Activations stay float32 (not llama.cpp's int8 ones, so no VNNI): each output is a float32 dot product of
// the dequantized weights, gguf.quants.dequantize(W) @ x up to summation order; the price is the int-to-float
// conversions, which bound these loops (benchmarks/gguf_kernels.py: one row of [4864, 896] on one Zen 4 core,
// GB/s of weights: Q8_0 16, Q4_0 7.5, Q4_1 8, Q5_0 6.6, Q5_1 7, IQ4_NL 7.6, Q6_K 6.9, Q4_K 5.3 at 768 inputs).
// Many rows: the caller dequantizes chunks of rows (gguf_dequantize) for a GEMM.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "gguf_blocks.h"

namespace {

using namespace pagoda;
using namespace pagoda::gguf;

void check_blocks(const at::Tensor& w, int64_t type, int64_t K) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "blocks must be [O, row_bytes] uint8");
  by_type(type, [&](auto t) {
    using T = decltype(t);
    TORCH_CHECK(K % T::kN == 0 && w.size(1) == K / T::kN * T::kBytes, "blocks of ", w.size(1), " bytes a row do not hold ",
                K, " weights of GGUF type ", type);
  });
}

// x: [M, K] float32 or bfloat16; w: [O, K / block * block_bytes] uint8 -> x @ dequantize(w).T: [M, O] in x's dtype,
// accumulated in float32. Threads split the outputs.
at::Tensor gguf_linear(const at::Tensor& x_in, const at::Tensor& w, int64_t type) {
  TORCH_CHECK(x_in.dim() == 2, "x must be [M, K]");
  const int64_t K = x_in.size(1), O = w.size(0);
  check_blocks(w, type, K);
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, O}, x.options());
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, K));
  by_type(type, [&](auto t) {
    using T = decltype(t);
    at::parallel_for(0, O, grain, [&](int64_t a, int64_t e) {
      for (int64_t r = 0; r < M; r += kMaxRows)
        rows<T>(static_cast<int>(std::min<int64_t>(kMaxRows, M - r)), x.data_ptr<float>() + r * K, K,
                w.data_ptr<uint8_t>(), w.size(1), y.data_ptr<float>() + r * O + a, O, a, e);
    });
  });
  return y.to(x_in.scalar_type());
}

// w: [O, row_bytes] uint8 blocks of K weights a row -> [O, K] float32
at::Tensor gguf_dequantize(const at::Tensor& w, int64_t type, int64_t K) {
  check_blocks(w, type, K);
  const int64_t O = w.size(0);
  at::Tensor out = at::empty({O, K}, w.options().dtype(at::kFloat));
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, K));
  by_type(type, [&](auto t) {
    using T = decltype(t);
    at::parallel_for(0, O, grain, [&](int64_t a, int64_t e) {
      dequant_t<T>(w.data_ptr<uint8_t>(), w.size(1), K, out.data_ptr<float>(), a, e);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda, m) {
  m.def("gguf_linear(Tensor x, Tensor blocks, int type) -> Tensor");
  m.def("gguf_dequantize(Tensor blocks, int type, int in_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) {
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_dequantize", &gguf_dequantize);
}
