// A mixture-of-experts layer's experts for the CPU (engine/layers/moe.py Experts): the step's (token, slot)
// pairs grouped by expert, so that each expert's weights are read once a step for all of its tokens, and
// experts no token chose cost nothing. Three passes, the first two split over threads by (expert, block of
// output columns): the fused gate and up projection with SiLU-and-mul after it, the down projection scaled by
// the routing weight, then each token's pairs added into the output in place, in ascending expert order.
// Every output is one chain of fused multiply-adds over its inputs, k ascending from 0, and values are
// rounded to the model's dtype where the torch loop (Experts.loop_ over pagoda's linear and SiLU ops) rounds
// them, so the result is bitwise that loop's, and a row's result does not depend on the rows beside it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "cpu_math.h"
#include "cpu_vec.h"

namespace {

using namespace pagoda;
constexpr int64_t kMaxRows = 8;  // rows per pass over a block of weights (their accumulators stay in L1)
constexpr int KU = 4;  // rows of weights per step of a stream

template <typename T>
inline float silu_mul(float g, float u) {
  // as silu_and_mul over the gate/up projection rounded to T (csrc/layers_cpu.cpp)
  const float gf = static_cast<float>(round_to<T>(g)), uf = static_cast<float>(round_to<T>(u));
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

// h[m][j0, j1) = silu_mul(x[m] . gate columns, x[m] . up columns) for M rows; wt: the expert's [K, 2I] k-major
// gate|up weights (each up column I after its gate column); acc: 2 * M * (j1 - j0) floats
template <typename T>
void gate_up_rows(const float* x, int64_t ldx, int64_t M, const T* wt, int64_t K, int64_t I, int64_t j0, int64_t j1,
                  float* h, int64_t ldh, float* acc) {
  const int64_t B = j1 - j0, n = B / kW * kW;
  stream(x, ldx, M, wt, K, 2 * I, j0, n, acc, 2 * B);
  stream(x, ldx, M, wt, K, 2 * I, I + j0, n, acc + B, 2 * B);
  for (int64_t m = 0; m < M; ++m) {
    const float *g = acc + m * 2 * B, *u = g + B, *xm = x + m * ldx;
    float* hm = h + m * ldh + j0;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) hm[j] = silu_mul<T>(g[j], u[j]);
    for (int64_t j = n; j < B; ++j)
      hm[j] = silu_mul<T>(dot_column(xm, wt, K, 2 * I, j0 + j), dot_column(xm, wt, K, 2 * I, I + j0 + j));
  }
}

// y[m][o0, o1) = round(round(h[m] . down columns) * weight[m]) for M rows; wt: the expert's [I, H] k-major down
// weights; acc: M * (o1 - o0) floats
template <typename T>
void down_rows(const float* h, int64_t ldh, int64_t M, const T* wt, int64_t K, int64_t H, int64_t o0, int64_t o1,
               const float* weight, float* y, int64_t ldy, float* acc) {
  const int64_t B = o1 - o0, n = B / kW * kW;
  stream(h, ldh, M, wt, K, H, o0, n, acc, B);
  for (int64_t m = 0; m < M; ++m) {
    float* a = acc + m * B;
    for (int64_t j = n; j < B; ++j) a[j] = dot_column(h + m * ldh, wt, K, H, o0 + j);
    float* ym = y + m * ldy + o0;
    const float wm = weight[m];
#pragma omp simd
    for (int64_t j = 0; j < B; ++j) ym[j] = static_cast<float>(round_to<T>(static_cast<float>(round_to<T>(a[j])) * wm));
  }
}

// output columns per task (a multiple of kW): about 4 tasks a thread, in runs of at least 4 vectors and at
// most what keeps the accumulators of `rows` rows (gate and up) within 32 KB of L1: the longer a run, the more
// a weight read is one contiguous stream (a decode step's few rows run on whole rows of a small expert)
int64_t block_width(int64_t cols, int64_t experts_hit, int64_t rows) {
  const int64_t want = cols * experts_hit / (4 * std::max(1, at::get_num_threads()));
  const int64_t most = std::max<int64_t>(4, 32768 / (2 * rows * 4 * kW));
  return std::min(most, std::max<int64_t>(4, want / kW)) * kW;
}

template <typename T>
void experts(T* out, const T* x, const T* w13, const T* w2, const float* weights, const int64_t* ids, int64_t n,
             int64_t topk, int64_t E, int64_t H, int64_t I) {
  const int64_t P = n * topk;
  // the pairs grouped by expert (a counting sort: within an expert, in token order); where[p]: pair p's place
  std::vector<int64_t> start(E + 1, 0), order(P), where(P);
  for (int64_t p = 0; p < P; ++p) ++start[ids[p] + 1];
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t p = 0; p < P; ++p) where[p] = fill[ids[p]]++, order[where[p]] = p;
  // xy: the pairs' inputs in float32 [P, H], then their weighted outputs; h: their activations [P, I]
  std::vector<float> xy(P * H), h(P * I), w(P);
  at::parallel_for(0, P, std::max<int64_t>(1, 32768 / std::max<int64_t>(H, 1)), [&](int64_t a, int64_t b) {
    for (int64_t q = a; q < b; ++q) {
      const T* xr = x + (order[q] / topk) * H;
      for (int64_t i = 0; i < H; ++i) xy[q * H + i] = static_cast<float>(xr[i]);
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
  run(I, [&](int64_t e, int64_t r, int64_t M, int64_t j0, int64_t j1, float* acc) {
    gate_up_rows(xy.data() + r * H, H, M, w13 + e * 2 * I * H, H, I, j0, j1, h.data() + r * I, I, acc);
  });
  run(H, [&](int64_t e, int64_t r, int64_t M, int64_t o0, int64_t o1, float* acc) {  // xy's inputs are read no more
    down_rows(h.data() + r * I, I, M, w2 + e * H * I, I, H, o0, o1, w.data() + r, xy.data() + r * H, H, acc);
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

// out: [n, H] += for each token its experts' routing-weighted SwiGLU outputs; x: [n, H]; w13: [E, 2I, H] gate|up
// and w2: [E, H, I], each expert's transpose contiguous (engine/layers/moe.py Experts), in x's dtype (float32
// or bfloat16); weights: [n, k] float32; ids: [n, k] int64, distinct experts per token
void moe_experts_(at::Tensor& out, const at::Tensor& x_in, const at::Tensor& w13, const at::Tensor& w2,
                  const at::Tensor& weights_in, const at::Tensor& ids_in) {
  const auto dtype = x_in.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(x_in.dim() == 2 && w13.dim() == 3 && w2.dim() == 3, "x must be [n, H], w13 [E, 2I, H], w2 [E, H, I]");
  const int64_t n = x_in.size(0), H = x_in.size(1), E = w13.size(0), I = w13.size(1) / 2;
  TORCH_CHECK(w13.size(1) == 2 * I && w13.size(2) == H && w2.size(0) == E && w2.size(1) == H && w2.size(2) == I,
              "w13 must be [E, 2I, H] and w2 [E, H, I] for x's H");
  TORCH_CHECK(w13.scalar_type() == dtype && w2.scalar_type() == dtype, "the weights must be in x's dtype");
  TORCH_CHECK(w13.stride(0) == 2 * I * H && w13.stride(1) == 1 && w13.stride(2) == 2 * I,
              "w13 must hold each expert's [H, 2I] transpose contiguous");
  TORCH_CHECK(w2.stride(0) == H * I && w2.stride(1) == 1 && w2.stride(2) == H,
              "w2 must hold each expert's [I, H] transpose contiguous");
  TORCH_CHECK(out.scalar_type() == dtype && out.is_contiguous() && out.sizes() == x_in.sizes(),
              "out must be contiguous, with x's shape and dtype");
  TORCH_CHECK(ids_in.dim() == 2 && ids_in.size(0) == n && ids_in.scalar_type() == at::kLong &&
                  weights_in.sizes() == ids_in.sizes() && weights_in.scalar_type() == at::kFloat,
              "ids must be [n, k] int64 and weights [n, k] float32");
  const at::Tensor x = x_in.contiguous(), ids = ids_in.contiguous(), weights = weights_in.contiguous();
  const int64_t topk = ids.size(1);
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t p = 0; p < n * topk; ++p) TORCH_CHECK(ip[p] >= 0 && ip[p] < E, "expert id ", ip[p], " out of range");
  if (n == 0 || topk == 0) return;
  if (dtype == at::kFloat)
    experts(out.data_ptr<float>(), x.data_ptr<float>(), w13.data_ptr<float>(), w2.data_ptr<float>(),
            weights.data_ptr<float>(), ip, n, topk, E, H, I);
  else
    experts(out.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(), w13.data_ptr<c10::BFloat16>(),
            w2.data_ptr<c10::BFloat16>(), weights.data_ptr<float>(), ip, n, topk, E, H, I);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda, m) {
  m.def("moe_experts_(Tensor(a!) out, Tensor x, Tensor w13, Tensor w2, Tensor weights, Tensor ids) -> ()");
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) { m.impl("moe_experts_", &moe_experts_); }
