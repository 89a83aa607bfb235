// A mixture-of-experts layer's experts for the CPU (engine/layers/moe.py Experts): the step's (token, slot)
// pairs grouped by expert, so that each expert's weights are read once a step for all of its tokens, and
// experts no token chose cost nothing. Three passes, the first two split over threads by (expert, block of
// output columns): the fused gate and up projection with its activation after it (SiLU-and-mul, or gpt-oss's
// clamped SwiGLU with the projection's bias), the down projection (and its bias) scaled by the routing
// weight, then each token's pairs added into the output in place, in ascending expert order.
// Weights in the model's dtype are k-major (each expert's transpose contiguous): every output is one chain of
// fused multiply-adds over its inputs, k ascending from 0, and values are rounded to the model's dtype where
// the torch loop (Experts.loop_ over pagoda's linear and SiLU ops) rounds them, so the SiLU result is bitwise
// that loop's. Quantized weights are row-major (each output's inputs contiguous) and dequantized in
// registers: int8 with a float32 scale per output row, or MXFP4 as gpt-oss ships it (per row K / 32 blocks of
// 16 bytes, value 2j in the low nibble of byte j and 2j + 1 in the high one, each an FP4 e2m1 code, with one
// uint8 exponent per block: w = fp4 * 2^(e - 127)); the inputs of an MXFP4 block are permuted once (its even
// inputs, then its odd ones) so that a block's low and high nibbles meet contiguous inputs; or GGUF blocks
// (gguf_blocks.h: any type it decodes, [rows, row_bytes] an expert, the ggml type id in place of the scales), a
// span of a row's blocks decoded into L1 and every row's fused multiply-adds over it (as gguf_linear).
// A row's result never depends on the rows beside it, except over GGUF blocks: their kernel's summation order
// depends on how many rows share a pass (fewer than 3: more accumulators), as gguf_linear's does.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <cstdint>
#include <utility>
#include <vector>

#include "cpu_math.h"
#include "cpu_vec.h"
#include "gguf_blocks.h"

namespace {

using namespace pagoda;
constexpr int64_t kMaxRows = 8;  // rows per pass over a block of weights (their accumulators stay in L1)
constexpr int KU = 4;  // rows of weights per step of a stream

// the activation between the projections: SiLU-and-mul, or (alpha set) gpt-oss's clamped SwiGLU
// (up + 1) * gate * sigmoid(alpha * gate), gate clamped above and up on both sides at `limit`
struct Act {
  bool clamped;
  float alpha, limit;
};

template <typename T>
inline float act_mul(const Act& a, float g, float u) {
  // as silu_and_mul over the gate/up projection rounded to T (csrc/layers_cpu.cpp)
  const float gf = static_cast<float>(round_to<T>(g)), uf = static_cast<float>(round_to<T>(u));
  if (a.clamped) {
    const float gc = std::min(gf, a.limit), uc = std::min(std::max(uf, -a.limit), a.limit);
    return static_cast<float>(round_to<T>((uc + 1.f) * (gc / (1.f + exp_approx(-a.alpha * gc)))));
  }
  const T act = round_to<T>(gf / (1.f + exp_approx(-gf)));
  return static_cast<float>(round_to<T>(static_cast<float>(act) * uf));
}

// acc[m][0, n) = x[m] . columns [c, c + n) of wt ([K, ld] k-major; n a multiple of kW) for M rows: KU rows of
// weights at a time, each read along the block (a few long contiguous runs, which the hardware prefetchers
// follow; register tiles that read a short piece of every row in turn run at half the bandwidth), the
// accumulators in L1. Each output is one chain of fused multiply-adds, k ascending from 0.
template <typename T>
void stream(const float* x, int64_t ldx, int64_t M, const T* wt, int64_t K, int64_t ld, int64_t c, int64_t n,
            float* acc, int64_t ldacc) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < n; j += kW) store(acc + m * ldacc + j, splat(0.f));
  int64_t k = 0;
  for (; k + KU <= K; k += KU) {
    const T* w = wt + k * ld + c;
    for (int64_t j = 0; j < n; j += kW) {
      vec wv[KU];
      for (int u = 0; u < KU; ++u) wv[u] = load(w + u * ld + j);
      for (int64_t m = 0; m < M; ++m) {
        float* a = acc + m * ldacc + j;
        vec s = load(a);
        for (int u = 0; u < KU; ++u) s = fma(splat(x[m * ldx + k + u]), wv[u], s);
        store(a, s);
      }
    }
  }
  for (; k < K; ++k) {
    const T* w = wt + k * ld + c;
    for (int64_t j = 0; j < n; j += kW) {
      const vec wv = load(w + j);
      for (int64_t m = 0; m < M; ++m)
        store(acc + m * ldacc + j, fma(splat(x[m * ldx + k]), wv, load(acc + m * ldacc + j)));
    }
  }
}

// a column past the vectors: the same chain of fused multiply-adds
template <typename T>
float dot_column(const float* x, const T* wt, int64_t K, int64_t ld, int64_t col) {
  float s = 0.f;
  for (int64_t k = 0; k < K; ++k) s = __builtin_fmaf(x[k], static_cast<float>(wt[k * ld + col]), s);
  return s;
}

// h[m][j0 + j] = act(gate + bias, up + bias) for the M rows' gate | up projections in acc ([M][2B]: B gate
// columns, then B up ones); perm: where an MXFP4 down projection wants each input (nullptr: in place)
template <typename T>
void activate(float* acc, int64_t M, int64_t B, int64_t j0, int64_t I, const T* bias, const Act& act, float* h,
              int64_t ldh, const int64_t* perm) {
  for (int64_t m = 0; m < M; ++m) {
    float *g = acc + m * 2 * B, *u = g + B;
    if (bias != nullptr)
      for (int64_t j = 0; j < B; ++j) {
        g[j] = static_cast<float>(round_to<T>(g[j])) + static_cast<float>(bias[j0 + j]);
        u[j] = static_cast<float>(round_to<T>(u[j])) + static_cast<float>(bias[I + j0 + j]);
      }
    float* hm = h + m * ldh;
    if (perm == nullptr) {
#pragma omp simd
      for (int64_t j = 0; j < B; ++j) hm[j0 + j] = act_mul<T>(act, g[j], u[j]);
    } else {
      for (int64_t j = 0; j < B; ++j) hm[perm[j0 + j]] = act_mul<T>(act, g[j], u[j]);
    }
  }
}

// row-major quantized weights of one expert, dequantized in registers. int8: [rows, K] with a float32 scale per
// row; MXFP4: [rows, K / 32, 16] code bytes with a uint8 exponent per block [rows, K / 32]; GGUF: [rows, row_bytes]
// blocks of a ggml type
enum Format : int { kFloat = 0, kInt8 = 1, kMxfp4 = 2, kGguf = 3 };

// the lower kW bytes of b from byte j (0, or kW = 8 on AVX2) widened to floats
inline vec i8_at(__m128i b, int j) {
  if (j != 0) b = _mm_unpackhi_epi64(b, b);
#if defined(__AVX512F__)
  return (vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
#else
  return (vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
#endif
}

// 2^(e - 128) for each exponent byte: the FP4 codes below are twice their e2m1 values
struct Exponents {
  float v[256];
  Exponents() {
    for (int e = 0; e < 256; ++e) v[e] = std::ldexp(1.f, e - 128);
  }
};
const Exponents kExp;

// y[m][o - o0] = x[m] . W[o] for o in [o0, o1), M rows; each output one sum over vector lanes then across them
template <int F, int M>
void quant_rows_t(const float* x, int64_t ldx, const uint8_t* w, const void* scales, int64_t K, int64_t o0,
                  int64_t o1, float* y, int64_t ldy) {
  const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t o = o0; o < o1; ++o) {
    vec acc[M];
    for (int m = 0; m < M; ++m) acc[m] = splat(0.f);
    if constexpr (F == kInt8) {
      const uint8_t* row = w + o * K;
      for (int64_t k = 0; k < K; k += 16) {
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k));
        for (int j = 0; j < 16; j += kW) {
          const vec wv = i8_at(q, j);
          for (int m = 0; m < M; ++m) acc[m] = fma(wv, load(x + m * ldx + k + j), acc[m]);
        }
      }
    } else {
      const int64_t G = K / 32;
      const uint8_t* row = w + o * G * 16;
      const uint8_t* e = static_cast<const uint8_t*>(scales) + o * G;
      for (int64_t g = 0; g < G; ++g) {
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g * 16));
        const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(q, low));
        const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(q, 4), low));
        const vec d = splat(kExp.v[e[g]]);
        for (int j = 0; j < 16; j += kW) {
          const vec wl = d * i8_at(lo, j), wh = d * i8_at(hi, j);
          for (int m = 0; m < M; ++m) {
            const float* xs = x + m * ldx + g * 32 + j;
            acc[m] = fma(wh, load(xs + 16), fma(wl, load(xs), acc[m]));
          }
        }
      }
    }
    const float s = F == kInt8 ? static_cast<const float*>(scales)[o] : 1.f;
    for (int m = 0; m < M; ++m) {
      float sum = 0.f;
      for (int l = 0; l < kW; ++l) sum += acc[m][l];
      y[m * ldy + o - o0] = sum * s;
    }
  }
}

template <int F>
void quant_rows(const float* x, int64_t ldx, int64_t M, const uint8_t* w, const void* scales, int64_t K, int64_t o0,
                int64_t o1, float* y, int64_t ldy) {
#define PAGODA_ROWS(R) \
  case R: quant_rows_t<F, R>(x, ldx, w, scales, K, o0, o1, y, ldy); break;
  switch (M) {
    PAGODA_ROWS(1) PAGODA_ROWS(2) PAGODA_ROWS(3) PAGODA_ROWS(4)
    PAGODA_ROWS(5) PAGODA_ROWS(6) PAGODA_ROWS(7) PAGODA_ROWS(8)
  }
#undef PAGODA_ROWS
}

// an expert's quantized weights: F's rows from `w`, the bytes of a row (or block row) `row_bytes`
struct QuantExpert {
  int format;
  const uint8_t* w;
  const void* scales;  // int8: float [rows]; MXFP4: uint8 [rows, K / 32]
  int64_t type, row_bytes;  // GGUF: the ggml type, the bytes of a row
};

inline void rows_of(const QuantExpert& q, const float* x, int64_t ldx, int64_t M, int64_t K, int64_t o0, int64_t o1,
                    float* y, int64_t ldy) {
  if (q.format == kGguf)  // x's rows are K apart (ldx == K at both projections)
    gguf::by_type(q.type, [&](auto t) {
      gguf::rows<decltype(t)>(static_cast<int>(M), x, K, q.w, q.row_bytes, y, ldy, o0, o1);
    });
  else if (q.format == kInt8)
    quant_rows<kInt8>(x, ldx, M, q.w, q.scales, K, o0, o1, y, ldy);
  else
    quant_rows<kMxfp4>(x, ldx, M, q.w, q.scales, K, o0, o1, y, ldy);
}

// h[m][j0, j1) = act(x[m] . gate columns, x[m] . up columns) for M rows; wt: the expert's [K, 2I] k-major
// gate|up weights (each up column I after its gate column); acc: 2 * M * (j1 - j0) floats
template <typename T>
void gate_up_rows(const float* x, int64_t ldx, int64_t M, const T* wt, int64_t K, int64_t I, int64_t j0, int64_t j1,
                  float* h, int64_t ldh, float* acc, const T* bias, const Act& act) {
  const int64_t B = j1 - j0, n = B / kW * kW;
  stream(x, ldx, M, wt, K, 2 * I, j0, n, acc, 2 * B);
  stream(x, ldx, M, wt, K, 2 * I, I + j0, n, acc + B, 2 * B);
  for (int64_t m = 0; m < M; ++m) {
    float *g = acc + m * 2 * B, *u = g + B;
    const float* xm = x + m * ldx;
    for (int64_t j = n; j < B; ++j)
      g[j] = dot_column(xm, wt, K, 2 * I, j0 + j), u[j] = dot_column(xm, wt, K, 2 * I, I + j0 + j);
  }
  activate<T>(acc, M, B, j0, I, bias, act, h, ldh, nullptr);
}

// y[m][o0, o1) = round(round(acc[m] + bias) * weight[m]) (acc: [M][o1 - o0])
template <typename T>
void weigh(const float* acc, int64_t M, int64_t o0, int64_t o1, const T* bias, const float* weight, float* y,
           int64_t ldy) {
  const int64_t B = o1 - o0;
  for (int64_t m = 0; m < M; ++m) {
    const float* a = acc + m * B;
    float* ym = y + m * ldy + o0;
    const float wm = weight[m];
    if (bias == nullptr) {
#pragma omp simd
      for (int64_t j = 0; j < B; ++j)
        ym[j] = static_cast<float>(round_to<T>(static_cast<float>(round_to<T>(a[j])) * wm));
    } else {
      for (int64_t j = 0; j < B; ++j) {
        const float b = static_cast<float>(round_to<T>(a[j])) + static_cast<float>(bias[o0 + j]);
        ym[j] = static_cast<float>(round_to<T>(static_cast<float>(round_to<T>(b)) * wm));
      }
    }
  }
}

// y[m][o0, o1) = round(round(h[m] . down columns) * weight[m]) for M rows; wt: the expert's [I, H] k-major down
// weights; acc: M * (o1 - o0) floats
template <typename T>
void down_rows(const float* h, int64_t ldh, int64_t M, const T* wt, int64_t K, int64_t H, int64_t o0, int64_t o1,
               const float* weight, float* y, int64_t ldy, float* acc, const T* bias) {
  const int64_t B = o1 - o0, n = B / kW * kW;
  stream(h, ldh, M, wt, K, H, o0, n, acc, B);
  for (int64_t m = 0; m < M; ++m) {
    float* a = acc + m * B;
    for (int64_t j = n; j < B; ++j) a[j] = dot_column(h + m * ldh, wt, K, H, o0 + j);
  }
  weigh<T>(acc, M, o0, o1, bias, weight, y, ldy);
}


// output columns per task (a multiple of kW): about 4 tasks a thread, in runs of at least 4 vectors and at
// most what keeps the accumulators of `rows` rows (gate and up) within 32 KB of L1: the longer a run, the more
// a weight read is one contiguous stream (a decode step's few rows run on whole rows of a small expert)
int64_t block_width(int64_t cols, int64_t experts_hit, int64_t rows) {
  const int64_t want = cols * experts_hit / (4 * std::max(1, at::get_num_threads()));
  const int64_t most = std::max<int64_t>(4, 32768 / (2 * rows * 4 * kW));
  return std::min(most, std::max<int64_t>(4, want / kW)) * kW;
}

// one projection of every expert: its format, weights and scales (bytes from one expert to the next), bias
struct Proj {
  int format;
  const uint8_t* w;
  int64_t w_stride;
  const uint8_t* s;
  int64_t s_stride;
  const void* bias;  // [E, rows] in the model's dtype, or nullptr
  int64_t type = 0, row_bytes = 0;  // GGUF
  QuantExpert expert(int64_t e) const {
    return {format, w + e * w_stride, s == nullptr ? nullptr : s + e * s_stride, type, row_bytes};
  }
  template <typename T>
  const T* bias_of(int64_t e, int64_t rows) const {
    return bias == nullptr ? nullptr : static_cast<const T*>(bias) + e * rows;
  }
};

// where an MXFP4 block wants input k: the block's even inputs, then its odd ones
inline int64_t mxfp4_place(int64_t k) { return (k & ~int64_t{31}) | ((k & 1) << 4) | ((k & 31) >> 1); }

template <typename T>
void experts(T* out, const T* x, const Proj& w13, const Proj& w2, const float* weights, const int64_t* ids, int64_t n,
             int64_t topk, int64_t E, int64_t H, int64_t I, const Act& act) {
  const int64_t P = n * topk;
  // the pairs grouped by expert (a counting sort: within an expert, in token order); where[p]: pair p's place
  std::vector<int64_t> start(E + 1, 0), order(P), where(P);
  for (int64_t p = 0; p < P; ++p) ++start[ids[p] + 1];
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t p = 0; p < P; ++p) where[p] = fill[ids[p]]++, order[where[p]] = p;
  // the places of an MXFP4 projection's inputs (identity otherwise)
  std::vector<int64_t> in13(H), in2(I);
  for (int64_t k = 0; k < H; ++k) in13[k] = w13.format == kMxfp4 ? mxfp4_place(k) : k;
  for (int64_t k = 0; k < I; ++k) in2[k] = w2.format == kMxfp4 ? mxfp4_place(k) : k;
  // xy: the pairs' inputs in float32 [P, H], then their weighted outputs; h: their activations [P, I]
  std::vector<float> xy(P * H), h(P * I), w(P);
  at::parallel_for(0, P, std::max<int64_t>(1, 32768 / std::max<int64_t>(H, 1)), [&](int64_t a, int64_t b) {
    for (int64_t q = a; q < b; ++q) {
      const T* xr = x + (order[q] / topk) * H;
      for (int64_t i = 0; i < H; ++i) xy[q * H + in13[i]] = static_cast<float>(xr[i]);
      w[q] = weights[order[q]];
    }
  });
  std::vector<int64_t> hit;
  int64_t rows = 1;  // the most rows a pass over an expert's block of weights takes
  for (int64_t e = 0; e < E; ++e)
    if (start[e + 1] > start[e]) hit.push_back(e), rows = std::max(rows, std::min(kMaxRows, start[e + 1] - start[e]));
  // (expert, first column) for every expert that got pairs, each over its rows kMaxRows at a time
  auto run = [&](int64_t cols, auto&& body) {
    const int64_t width = block_width(cols, static_cast<int64_t>(hit.size()), rows);
    std::vector<std::pair<int64_t, int64_t>> tasks;
    for (const int64_t e : hit)
      for (int64_t c = 0; c < cols; c += width) tasks.emplace_back(e, c);
    at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t a, int64_t b) {
      std::vector<float> acc(2 * kMaxRows * width);
      for (int64_t t = a; t < b; ++t) {
        const auto [e, c0] = tasks[t];
        for (int64_t r = start[e]; r < start[e + 1]; r += kMaxRows)
          body(e, r, std::min(kMaxRows, start[e + 1] - r), c0, std::min(cols, c0 + width), acc.data());
      }
    });
  };
  const int64_t* perm2 = w2.format == kMxfp4 ? in2.data() : nullptr;
  run(I, [&](int64_t e, int64_t r, int64_t M, int64_t j0, int64_t j1, float* acc) {
    const T* bias = w13.bias_of<T>(e, 2 * I);
    if (w13.format == kFloat && perm2 == nullptr) {
      gate_up_rows(xy.data() + r * H, H, M, reinterpret_cast<const T*>(w13.w) + e * 2 * I * H, H, I, j0, j1,
                   h.data() + r * I, I, acc, bias, act);
      return;
    }
    const int64_t B = j1 - j0;
    const QuantExpert q = w13.expert(e);
    rows_of(q, xy.data() + r * H, H, M, H, j0, j1, acc, 2 * B);
    rows_of(q, xy.data() + r * H, H, M, H, I + j0, I + j1, acc + B, 2 * B);
    activate<T>(acc, M, B, j0, I, bias, act, h.data() + r * I, I, perm2);
  });
  run(H, [&](int64_t e, int64_t r, int64_t M, int64_t o0, int64_t o1, float* acc) {  // xy's inputs are read no more
    const T* bias = w2.bias_of<T>(e, H);
    if (w2.format == kFloat) {
      down_rows(h.data() + r * I, I, M, reinterpret_cast<const T*>(w2.w) + e * H * I, I, H, o0, o1, w.data() + r,
                xy.data() + r * H, H, acc, bias);
      return;
    }
    rows_of(w2.expert(e), h.data() + r * I, I, M, I, o0, o1, acc, o1 - o0);
    weigh<T>(acc, M, o0, o1, bias, w.data() + r, xy.data() + r * H, H);
  });
  // each token's pairs into its row, experts ascending (as index_add_ expert by expert)
  at::parallel_for(0, n, std::max<int64_t>(1, 32768 / std::max<int64_t>(topk * H, 1)), [&](int64_t a, int64_t b) {
    std::vector<int64_t> q(topk);
    for (int64_t t = a; t < b; ++t) {
      for (int64_t s = 0; s < topk; ++s) q[s] = where[t * topk + s];
      std::sort(q.begin(), q.end());  // places in expert order
      T* o = out + t * H;
      for (const int64_t p : q) {
        const float* y = xy.data() + p * H;
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) o[i] = round_to<T>(static_cast<float>(o[i]) + y[i]);
      }
    }
  });
}

// one projection's weights ([E, rows, K] as the model holds them) checked and described: in x's dtype with each
// expert's [K, rows] transpose contiguous; int8 [E, rows, K] contiguous with float32 scales [E, rows]; or MXFP4
// blocks uint8 [E, rows, K / 32, 16] with exponents uint8 [E, rows, K / 32]; or GGUF blocks uint8 [E, rows,
// row_bytes] with s the ggml type id (int64 [1]); bias: [E, rows] in x's dtype
Proj describe(const char* name, const at::Tensor& w, const std::optional<at::Tensor>& s,
              const std::optional<at::Tensor>& bias, at::ScalarType dtype, int64_t E, int64_t rows, int64_t K) {
  Proj p{kFloat, static_cast<const uint8_t*>(w.data_ptr()), 0, nullptr, 0, nullptr};
  const auto type = w.scalar_type();
  if (type == dtype) {
    TORCH_CHECK(w.dim() == 3 && w.size(0) == E && w.size(1) == rows && w.size(2) == K && w.stride(0) == rows * K &&
                    w.stride(1) == 1 && w.stride(2) == rows,
                name, " must be [E, ", rows, ", ", K, "] with each expert's transpose contiguous");
    p.w_stride = rows * K * w.element_size();
  } else if (type == at::kChar) {
    TORCH_CHECK(w.dim() == 3 && w.size(0) == E && w.size(1) == rows && w.size(2) == K && w.is_contiguous() &&
                    K % 16 == 0,
                name, " (int8) must be contiguous [E, ", rows, ", ", K, "], ", K, " a multiple of 16");
    TORCH_CHECK(s.has_value() && s->scalar_type() == at::kFloat && s->is_contiguous() && s->numel() == E * rows,
                name, " (int8) needs float32 scales [E, ", rows, "]");
    p = {kInt8, p.w, rows * K, static_cast<const uint8_t*>(s->data_ptr()), rows * 4, nullptr};
  } else if (type == at::kByte && w.dim() == 3) {
    TORCH_CHECK(s.has_value() && s->scalar_type() == at::kLong && s->numel() == 1, name,
                " (GGUF blocks) needs its ggml type id as int64 [1] in place of scales");
    const int64_t t = s->item<int64_t>();
    int64_t row_bytes = 0;
    gguf::by_type(t, [&](auto b) {
      using B = decltype(b);
      TORCH_CHECK(K % B::kN == 0, name, ": ", K, " inputs are not whole blocks of GGUF type ", t);
      row_bytes = K / B::kN * B::kBytes;
    });
    TORCH_CHECK(w.size(0) == E && w.size(1) == rows && w.size(2) == row_bytes && w.is_contiguous(), name,
                " (GGUF type ", t, ") must be contiguous uint8 [E, ", rows, ", ", row_bytes, "]");
    p = {kGguf, p.w, rows * row_bytes, nullptr, 0, nullptr, t, row_bytes};
  } else {
    TORCH_CHECK(type == at::kByte && K % 32 == 0 && w.dim() == 4 && w.size(0) == E && w.size(1) == rows &&
                    w.size(2) == K / 32 && w.size(3) == 16 && w.is_contiguous(),
                name, " must be in x's dtype, int8, GGUF blocks, or MXFP4 blocks uint8 [E, ", rows, ", ", K / 32,
                ", 16]");
    TORCH_CHECK(s.has_value() && s->scalar_type() == at::kByte && s->is_contiguous() && s->numel() == E * rows * K / 32,
                name, " (MXFP4) needs uint8 exponents [E, ", rows, ", ", K / 32, "]");
    p = {kMxfp4, p.w, rows * K / 2, static_cast<const uint8_t*>(s->data_ptr()), rows * K / 32, nullptr};
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == dtype && bias->is_contiguous() && bias->numel() == E * rows, name,
                "'s bias must be contiguous [E, ", rows, "] in x's dtype");
    p.bias = bias->data_ptr();
  }
  return p;
}

// out: [n, H] += for each token its experts' routing-weighted outputs; x: [n, H] float32 or bfloat16; w13: every
// expert's gate|up projection [E, 2I, H] and w2 its down projection [E, H, I] (describe: in x's dtype, int8,
// MXFP4 or GGUF blocks, with s13 / s2 their scales or ggml type id), b13 / b2 their biases; weights: [n, k]
// float32; ids: [n, k] int64, distinct experts per token. swiglu_alpha set: gpt-oss's clamped SwiGLU at
// swiglu_limit; else SiLU-and-mul.
void moe_experts_(at::Tensor& out, const at::Tensor& x_in, const at::Tensor& w13, const at::Tensor& w2,
                  const at::Tensor& weights_in, const at::Tensor& ids_in, const std::optional<at::Tensor>& s13,
                  const std::optional<at::Tensor>& s2, const std::optional<at::Tensor>& b13,
                  const std::optional<at::Tensor>& b2, std::optional<double> swiglu_alpha,
                  std::optional<double> swiglu_limit) {
  const auto dtype = x_in.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(x_in.dim() == 2 && w13.dim() >= 3 && w2.dim() >= 3, "x must be [n, H], w13 [E, 2I, H], w2 [E, H, I]");
  const int64_t n = x_in.size(0), H = x_in.size(1), E = w13.size(0), I = w13.size(1) / 2;
  const Proj p13 = describe("w13", w13, s13, b13, dtype, E, 2 * I, H);
  const Proj p2 = describe("w2", w2, s2, b2, dtype, E, H, I);
  TORCH_CHECK(out.scalar_type() == dtype && out.is_contiguous() && out.sizes() == x_in.sizes(),
              "out must be contiguous, with x's shape and dtype");
  TORCH_CHECK(ids_in.dim() == 2 && ids_in.size(0) == n && ids_in.scalar_type() == at::kLong &&
                  weights_in.sizes() == ids_in.sizes() && weights_in.scalar_type() == at::kFloat,
              "ids must be [n, k] int64 and weights [n, k] float32");
  TORCH_CHECK(swiglu_alpha.has_value() == swiglu_limit.has_value(), "swiglu_alpha and swiglu_limit go together");
  const Act act{swiglu_alpha.has_value(), static_cast<float>(swiglu_alpha.value_or(0.)),
                static_cast<float>(swiglu_limit.value_or(0.))};
  const at::Tensor x = x_in.contiguous(), ids = ids_in.contiguous(), weights = weights_in.contiguous();
  const int64_t topk = ids.size(1);
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t p = 0; p < n * topk; ++p) TORCH_CHECK(ip[p] >= 0 && ip[p] < E, "expert id ", ip[p], " out of range");
  if (n == 0 || topk == 0) return;
  if (dtype == at::kFloat)
    experts(out.data_ptr<float>(), x.data_ptr<float>(), p13, p2, weights.data_ptr<float>(), ip, n, topk, E, H, I, act);
  else
    experts(out.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(), p13, p2, weights.data_ptr<float>(), ip, n,
            topk, E, H, I, act);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda, m) {
  m.def(
      "moe_experts_(Tensor(a!) out, Tensor x, Tensor w13, Tensor w2, Tensor weights, Tensor ids, Tensor? s13=None, "
      "Tensor? s2=None, Tensor? b13=None, Tensor? b2=None, float? swiglu_alpha=None, float? swiglu_limit=None) -> ()");
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) { m.impl("moe_experts_", &moe_experts_); }
