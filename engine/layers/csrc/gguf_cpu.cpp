// Linear layers over GGUF block formats as llama.cpp stores them (ggml-quants.c's layouts), computed on the
// blocks in memory: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL (32 weights a block), Q4_K, Q5_K, Q6_K (256 a
// super-block), and whatever else gguf_blocks.h decodes. A few rows (decode) take one of two paths, per type
// (integer_path below):
// - integer (gguf_dot.h): the activations are quantized once per call to 16 bits in blocks of 32 (dx = max|x| /
//   32767 in float32, q = round-half-even(x / dx)), each weight block's dot with them summed in integers (int16
//   weights times int16 activations, madd) and scaled in float. Each output is then dequantize(W) @
//   dequantize(q16(x)) (up to float32 rounding), not dequantize(W) @ x: each activation off by up to dx / 2, a
//   relative error of about 2e-5 of a dot product of random activations (8 bits, llama.cpp's, gave 0.5%: enough to
//   flip the test models' greedy near-ties).
// - float (gguf_blocks.h rows): 256 weights of a row at a time dequantized into L1 by vector code, then every
//   row's float32 activations multiply them, the rows' accumulators in registers: dequantize(W) @ x up to
//   summation order; bound by the int-to-float conversions. Types without an integer dot take it.
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
#include "gguf_dot.h"

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

// Which path a type's few-row kernel takes: the integer dots wherever they are faster than the float path.
// benchmarks/gguf_kernels.py --paths float integer --rows 1 4 8 --threads 1, GB/s of weights, [4864, 896]
// (K-quants [4864, 768]), one thread on a Zen 4 shared with other work (best of 5, thread clock), float -> integer:
//            AVX-512 build                                  AVX2 build (ATEN_CPU_CAPABILITY=avx2)
//            1 row          4 rows        8 rows          1 row          4 rows        8 rows
//   Q8_0     16.7 -> 23.9    7.4 -> 10.3    4.6 ->  5.8    12.4 -> 21.3    6.4 ->  7.6    4.2 ->  4.2
//   Q4_0      7.4 -> 11.2    3.7 ->  4.7    2.4 ->  3.0     5.1 ->  9.0    3.0 ->  3.9    2.3 ->  2.2
//   Q4_1      8.0 -> 11.9    4.0 ->  5.0    2.6 ->  3.1     6.2 -> 10.0    3.3 ->  4.1    2.6 ->  2.4
//   Q5_0      6.6 -> 10.6    3.8 ->  5.2    2.6 ->  3.4     5.4 ->  8.3    3.1 ->  4.2    2.5 ->  2.5
//   Q5_1      7.0 -> 11.1    3.9 ->  5.4    2.7 ->  3.4     5.8 ->  8.8    3.4 ->  4.5    2.7 ->  2.6
//   IQ4_NL    7.7 -> 10.3    3.7 ->  4.5    2.4 ->  2.9     5.7 ->  9.2    3.0 ->  3.8    2.3 ->  2.2
//   Q4_K      5.4 -> 10.9    3.4 ->  5.3    2.2 ->  3.2     4.9 -> 10.4    2.6 ->  4.4    1.7 ->  1.6
//   Q5_K      5.5 ->  9.1    3.5 ->  5.6    2.5 ->  3.5     4.2 ->  8.2    2.7 ->  4.6    1.6 ->  2.5
//   Q6_K      7.0 -> 13.1    4.2 ->  5.5    2.9 ->  3.2     5.0 -> 11.7    3.2 ->  4.8    2.5 ->  2.3
// The integer path is the faster in both builds at 1 and 4 rows (1.3-2.4x at one row); at 8 rows (and so for
// batches, 8 rows at a time) it is ahead in the AVX-512 build and level within noise in the AVX2 one, whose 16
// registers cannot hold a span's 16 vectors of int16 weights. It stays on madd: VNNI's dpwssd (AVX512-VNNI,
// AVX-VNNI) would fuse the adds, but is in neither build's flags.
bool integer_path(int64_t type) {
  switch (type) {
    case kQ8_0: case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: case kIQ4_NL: case kQ4_K: case kQ5_K: case kQ6_K:
      return true;
    default:
      return false;
  }
}

// x: [M, K] float32 or bfloat16; w: [O, K / block * block_bytes] uint8 -> x @ dequantize(w).T: [M, O] in x's dtype,
// accumulated in float32; on the integer path x is first quantized to 16 bits in blocks of 32, so the result is
// dequantize(q16(x)) @ dequantize(w).T. path: -1 the type's (integer_path), 0 float, 1 integer (benchmarks, tests).
// Threads split the outputs.
at::Tensor gguf_linear(const at::Tensor& x_in, const at::Tensor& w, int64_t type, int64_t path) {
  TORCH_CHECK(x_in.dim() == 2, "x must be [M, K]");
  TORCH_CHECK(path >= -1 && path <= 1, "path must be -1 (the type's), 0 (float) or 1 (integer), not ", path);
  const int64_t K = x_in.size(1), O = w.size(0);
  check_blocks(w, type, K);
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, O}, x.options());
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, K));
  const bool integer = path == -1 ? integer_path(type) : path == 1;
  by_type(type, [&](auto t) {
    using T = decltype(t);
    if constexpr (Dot<T>::kHas) {
      if (integer) {
        // x quantized once: [M, K] int16, then float32 [M, K / 32] scales and [M, K / 32] sums; 512 bytes more for
        // the loads past the last row's end (of 8 blocks, up to 7 unused)
        at::Tensor buf = at::empty({M * K * 2 + M * K / 32 * 8 + 512}, x.options().dtype(at::kByte));
        int16_t* q = reinterpret_cast<int16_t*>(buf.data_ptr<uint8_t>());
        float* d = reinterpret_cast<float*>(q + M * K);
        float* s = d + M * K / 32;
        at::parallel_for(0, M * K / 32, 256, [&](int64_t a, int64_t e) {
          quantize_blocks(x.data_ptr<float>() + a * 32, e - a, q + a * 32, d + a, s + a);
        });
        at::parallel_for(0, O, grain, [&](int64_t a, int64_t e) {
          for (int64_t r = 0; r < M; r += kMaxRows)
            dot_rows<T>(static_cast<int>(std::min<int64_t>(kMaxRows, M - r)), Q16Rows{q + r * K, d + r * K / 32, s + r * K / 32, K},
                        w.data_ptr<uint8_t>(), w.size(1), y.data_ptr<float>() + r * O + a, O, a, e);
        });
        return;
      }
    }
    TORCH_CHECK(!integer || path == -1, "GGUF type ", type, " has no integer path");
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
  m.def("gguf_linear(Tensor x, Tensor blocks, int type, int path=-1) -> Tensor");
  m.def("gguf_dequantize(Tensor blocks, int type, int in_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) {
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_dequantize", &gguf_dequantize);
}
