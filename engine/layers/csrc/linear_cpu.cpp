// A float32 linear layer for a few rows (a single stream's decode token, a speculative verification's
// last token and proposals), where MKL's sgemm costs about as many weight reads as there are rows
// (5 rows: 4-5x one row on a Zen 4). Here every weight is read once per block of up to 8 rows, so 5 rows
// cost about what one does while the weights come from memory. Each output is the same sequence of
// fused multiply-adds over the input whatever the number of rows, so a row's result does not depend
// on the rows beside it (speculation verifies with the logits a plain decode step would compute).
// Weights may be bfloat16 (widened in registers: half the bytes read for the memory-bound decode);
// the inputs and the accumulators are float32, the result rounded to the input's dtype.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <utility>
#include <vector>
#include <cstdint>

#include "cpu_vec.h"

namespace {

using namespace pagoda;
constexpr int kMaxRows = 8;  // rows per block (the accumulators of a block stay in registers)
constexpr int64_t kPrefetchRows = 16;  // a column-major tile asks for its weights this many inputs ahead
// a column-major weight this large comes from memory, not cache: streams; below it, register tiles
// (several rows of a cached weight: the streams' loads and stores of y would cost more than the reads)
constexpr int64_t kStreamBytes = 2 << 20;

// Column-major weight, a weight that fits in cache: a tile of NV vectors of outputs for M rows in
// registers; acc[m][j] += x[m][k] * wt[k][o + j * kW + lane], k ascending.
template <int M, int NV, typename W>
void tile_t(const float* x, int64_t ldx, const W* wt, const float* bias, float* y, int64_t ldy, int64_t K,
            int64_t O, int64_t o) {
  vec acc[M][NV];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NV; ++j) acc[m][j] = vec{} + 0.f;
  for (int64_t k = 0; k < K; ++k) {
    const W* w = wt + k * O + o;
    // the tile's rows of weights are O floats apart: too far for the hardware prefetcher to follow
    for (int j = 0; j < NV; ++j) __builtin_prefetch(w + kPrefetchRows * O + j * kW);
    vec wv[NV];
    for (int j = 0; j < NV; ++j) wv[j] = load(w + j * kW);
    for (int m = 0; m < M; ++m) {
      const vec b = vec{} + x[m * ldx + k];
      for (int j = 0; j < NV; ++j) acc[m][j] = fma(b, wv[j], acc[m][j]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NV; ++j)
      store(y + m * ldy + o + j * kW, bias != nullptr ? acc[m][j] + load(bias + o + j * kW) : acc[m][j]);
}

// Column-major weight (wt: [K, O] row-major, i.e. weight.t() contiguous), outputs [o, o + width) (a
// multiple of kW) of M rows, the accumulators in y: a chunk of outputs at a time (its M rows of y stay
// in L1), KU rows of wt per pass, each read along the chunk: a few long contiguous streams, which the
// hardware prefetchers follow (register tiles that read a short piece of every row of wt in turn ran
// at half the memory's bandwidth on an Intel Xeon). Each output is one chain of fused multiply-adds,
// k ascending from 0, whatever M.
template <int M, typename W>
void stream_t(const float* x, int64_t ldx, const W* wt, const float* bias, float* y, int64_t ldy, int64_t K,
              int64_t O, int64_t o, int64_t width) {
  constexpr int KU = 4;
  constexpr int64_t kChunk = std::max<int64_t>(2 * kW, (32768 / (4 * M)) / kW * kW);  // M rows in 32 KB
  for (int64_t c = o; c < o + width; c += kChunk) {
    const int64_t n = std::min(kChunk, o + width - c);
    for (int m = 0; m < M; ++m)
      for (int64_t j = 0; j < n; j += kW) store(y + m * ldy + c + j, vec{} + 0.f);
    int64_t k = 0;
    for (; k + KU <= K; k += KU) {
      const W* w = wt + k * O + c;
      for (int64_t j = 0; j < n; j += kW) {
        vec wv[KU];
        for (int u = 0; u < KU; ++u) wv[u] = load(w + u * O + j);
        for (int m = 0; m < M; ++m) {
          float* yp = y + m * ldy + c + j;
          vec acc = load(yp);
          for (int u = 0; u < KU; ++u) acc = fma(vec{} + x[m * ldx + k + u], wv[u], acc);
          store(yp, acc);
        }
      }
    }
    for (; k < K; ++k) {
      const W* w = wt + k * O + c;
      for (int64_t j = 0; j < n; j += kW) {
        const vec wv = load(w + j);
        for (int m = 0; m < M; ++m) {
          float* yp = y + m * ldy + c + j;
          store(yp, fma(vec{} + x[m * ldx + k], wv, load(yp)));
        }
      }
    }
    if (bias != nullptr)
      for (int m = 0; m < M; ++m)
        for (int64_t j = 0; j < n; j += kW) store(y + m * ldy + c + j, load(y + m * ldy + c + j) + load(bias + c + j));
  }
}

// outputs [o, o + width) of M rows, column-major weight: vector streams or tiles, then one column at a time
template <int M, typename W>
void columns_t(const float* x, int64_t ldx, const W* wt, const float* bias, float* y, int64_t ldy, int64_t K,
               int64_t O, int64_t o, int64_t width) {
  constexpr int NV = std::max(1, std::min(8, (kRegs - 2) / (M + 1)));
  const int64_t end = o + width;
  if (K * O * static_cast<int64_t>(sizeof(W)) >= kStreamBytes) {
    const int64_t vectors = width / kW * kW;
    stream_t<M>(x, ldx, wt, bias, y, ldy, K, O, o, vectors);
    o += vectors;
  } else {
    for (; o + NV * kW <= end; o += NV * kW) tile_t<M, NV>(x, ldx, wt, bias, y, ldy, K, O, o);
    for (; o + kW <= end; o += kW) tile_t<M, 1>(x, ldx, wt, bias, y, ldy, K, O, o);
  }
  for (; o < end; ++o)
    for (int m = 0; m < M; ++m) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s = __builtin_fmaf(x[m * ldx + k], static_cast<float>(wt[k * O + o]), s);
      y[m * ldy + o] = bias != nullptr ? s + bias[o] : s;
    }
}

// Row-major weight (w: [O, K], a tied LM head's): R outputs for M rows at once, each a dot product:
// lanes accumulate k ascending (k = lane mod kW), then the lanes are summed in order, then the tail.
template <int M, int R, typename W>
void tile_n(const float* x, int64_t ldx, const W* w, const float* bias, float* y, int64_t ldy, int64_t K,
            int64_t o) {
  vec acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = vec{} + 0.f;
  const int64_t body = K - K % kW;
  for (int64_t k = 0; k < body; k += kW) {
    // the same distance in bytes for either weight type (4 float vectors ahead)
    for (int r = 0; r < R; ++r) __builtin_prefetch(w + (o + r) * K + k + 4 * kW * 4 / sizeof(W));
    vec wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load(w + (o + r) * K + k);
    for (int m = 0; m < M; ++m) {
      const vec xv = load(x + m * ldx + k);
      for (int r = 0; r < R; ++r) acc[m][r] = fma(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) {
      float s = 0.f;
      for (int l = 0; l < kW; ++l) s += acc[m][r][l];
      for (int64_t k = body; k < K; ++k) s = __builtin_fmaf(x[m * ldx + k], static_cast<float>(w[(o + r) * K + k]), s);
      y[m * ldy + o + r] = bias != nullptr ? s + bias[o + r] : s;
    }
}

template <int M, typename W>
void columns_n(const float* x, int64_t ldx, const W* w, const float* bias, float* y, int64_t ldy, int64_t K,
               int64_t O, int64_t o, int64_t width) {
  constexpr int R = std::max(1, std::min(8, (kRegs - 1 - M) / (M + 1)));
  const int64_t end = o + width;
  for (; o + R <= end; o += R) tile_n<M, R>(x, ldx, w, bias, y, ldy, K, o);
  for (; o < end; ++o) tile_n<M, 1>(x, ldx, w, bias, y, ldy, K, o);
}

template <bool T, typename W>
void block(int rows, const float* x, int64_t ldx, const W* w, const float* bias, float* y, int64_t ldy, int64_t K,
           int64_t O, int64_t o, int64_t width) {
#define PAGODA_ROWS(M)                                                        \
  case M:                                                                     \
    if constexpr (T) columns_t<M>(x, ldx, w, bias, y, ldy, K, O, o, width);   \
    else columns_n<M>(x, ldx, w, bias, y, ldy, K, O, o, width);               \
    break;
  switch (rows) {
    PAGODA_ROWS(1) PAGODA_ROWS(2) PAGODA_ROWS(3) PAGODA_ROWS(4)
    PAGODA_ROWS(5) PAGODA_ROWS(6) PAGODA_ROWS(7) PAGODA_ROWS(8)
  }
#undef PAGODA_ROWS
}

template <typename W>
void few_rows(const float* xp, const W* wp, const float* b, float* yp, int64_t M, int64_t K, int64_t O, bool col_major) {
  // outputs per task: a multiple of 8 vectors, and at least ~64k weights (below that a parallel region
  // costs more than it saves)
  const int64_t quantum = 8 * kW;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, K * quantum));
  at::parallel_for(0, (O + quantum - 1) / quantum, grain, [&](int64_t a, int64_t e) {
    const int64_t o = a * quantum, width = std::min(O, e * quantum) - o;
    for (int64_t r = 0; r < M; r += kMaxRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, M - r));
      if (col_major) block<true>(rows, xp + r * K, K, wp, b, yp + r * O, O, K, O, o, width);
      else block<false>(rows, xp + r * K, K, wp, b, yp + r * O, O, K, O, o, width);
    }
  });
}

// x: [M, K] float32 or bfloat16; weight: [O, K] in x's dtype, column-major (weight.t() contiguous) or
// row-major; bias: [O] or none -> x @ weight.T + bias: [M, O] in x's dtype, accumulated in float32.
// Threads split the outputs; each runs every row block over its outputs (a block's weights are then in
// cache for the next block).
at::Tensor linear_few_rows(const at::Tensor& x_in, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.dim() == 2 && weight.dim() == 2 && x_in.size(1) == weight.size(1), "x must be [M, K], weight [O, K]");
  const auto dtype = x_in.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && weight.scalar_type() == dtype,
              "x and weight must both be float32 or both bfloat16");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();  // no copy for a contiguous float32 x
  const int64_t M = x.size(0), K = x.size(1), O = weight.size(0);
  const bool col_major = weight.stride(0) == 1 && weight.stride(1) == O;
  TORCH_CHECK(col_major || weight.is_contiguous(), "weight must be row- or column-major");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == dtype && bias->numel() == O, "bias must be [O] in x's dtype");
    b = bias->to(at::kFloat).contiguous();
  }
  at::Tensor y = at::empty({M, O}, x.options());
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  if (dtype == at::kFloat)
    few_rows(x.data_ptr<float>(), weight.data_ptr<float>(), bp, y.data_ptr<float>(), M, K, O, col_major);
  else
    few_rows(x.data_ptr<float>(), weight.data_ptr<c10::BFloat16>(), bp, y.data_ptr<float>(), M, K, O, col_major);
  return y.to(dtype);
}

// Panel-packed weight (wp: [O / kPanel, K, kPanel], one vector of outputs k-major): a thread's panels are
// one contiguous stream, and a block of up to kPanelRows rows keeps its outputs in registers while it
// walks a chunk of kChunkK inputs (one weight load and a fused multiply-add with an embedded broadcast
// of each row's input per step); a further row block reads the same chunk from L2. Each output is one
// chain of fused multiply-adds, k ascending from 0 (through acc_io between chunks, exactly), as tile_t
// and stream_t compute it: the column-major op's numbers, whatever the rows beside it.
constexpr int kPanel = kW;
constexpr int kPanelRows = kRegs - 4;  // AVX-512: 28 rows a pass, AVX2: 12
constexpr int64_t kChunkK = 1024;
// inputs ahead a tile asks for its panel's weights (the hardware prefetcher alone: 1.3x slower at 16 rows;
// 16 to 1024 ahead measured, 64 best on an Intel Xeon)
constexpr int64_t kPanelPrefetch = 64;

template <int M>
void panel_tile(const float* xt, int64_t ldx, const float* wp, int64_t k0, int64_t k1, float* acc_io, bool first,
                bool last, const float* bias) {
  vec acc[M];
#pragma GCC unroll 32
  for (int m = 0; m < M; ++m) acc[m] = first ? vec{} + 0.f : load(acc_io + m * kPanel);
  for (int64_t k = k0; k < k1; ++k) {
    const float* w = wp + k * kPanel;
    __builtin_prefetch(w + kPanelPrefetch * kPanel);
    const vec wv = load(w);
    const float* xk = xt + k * ldx;
#pragma GCC unroll 32
    for (int m = 0; m < M; ++m) acc[m] = fma(splat(xk[m]), wv, acc[m]);
  }
#pragma GCC unroll 32
  for (int m = 0; m < M; ++m)
    store(acc_io + m * kPanel, last && bias != nullptr ? acc[m] + load(bias) : acc[m]);
}

using PanelTile = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, bool, bool, const float*);
template <int... Ms>
constexpr std::array<PanelTile, sizeof...(Ms)> panel_tiles(std::integer_sequence<int, Ms...>) {
  return {&panel_tile<Ms + 1>...};
}
constexpr auto kPanelTiles = panel_tiles(std::make_integer_sequence<int, kPanelRows>{});

// x: [M, K] float32; wp: [ceil(O / kPanel), K, kPanel] float32 (cpu_ops.PanelLinear: zero rows past O);
// bias: [ceil(O / kPanel) * kPanel] (PanelLinear: zeros past O) or none -> [M, O]. Threads split the panels;
// rows go in blocks of even size up to kPanelRows.
at::Tensor linear_panels(const at::Tensor& x_in, const at::Tensor& wp, const c10::optional<at::Tensor>& bias,
                         int64_t O) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "x must be [M, K] float32");
  TORCH_CHECK(wp.dim() == 3 && wp.scalar_type() == at::kFloat && wp.is_contiguous() && wp.size(2) == kPanel &&
              wp.size(1) == x_in.size(1) && wp.size(0) * kPanel >= O && (wp.size(0) - 1) * kPanel < O,
              "wp must be [ceil(O / ", kPanel, "), K, ", kPanel, "] float32, contiguous");
  const at::Tensor x = x_in.t().contiguous();  // [K, M]: a step's inputs for every row side by side
  const int64_t M = x.size(1), K = x.size(0), panels = wp.size(0);
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == panels * kPanel,
                "bias must be [ceil(O / ", kPanel, ") * ", kPanel, "] float32, contiguous, zeros past O");
    bp = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, O}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* w0 = wp.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (M == 0) return y;
  const int64_t blocks = (M + kPanelRows - 1) / kPanelRows;
  const int64_t per_block = (M + blocks - 1) / blocks;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, K * kPanel));
  at::parallel_for(0, panels, grain, [&](int64_t a, int64_t e) {
    alignas(64) float acc[kPanelRows * kPanel];
    for (int64_t p = a; p < e; ++p) {
      const float* w = w0 + p * K * kPanel;
      const int64_t o = p * kPanel, n = std::min<int64_t>(kPanel, O - o);
      for (int64_t r = 0; r < M; r += per_block) {
        const int rows = static_cast<int>(std::min(per_block, M - r));
        for (int64_t k0 = 0; k0 < K; k0 += kChunkK) {
          const int64_t k1 = std::min(K, k0 + kChunkK);
          kPanelTiles[rows - 1](xp + r, M, w, k0, k1, acc, k0 == 0, k1 == K, bp == nullptr ? nullptr : bp + o);
        }
        for (int m = 0; m < rows; ++m) std::copy(acc + m * kPanel, acc + m * kPanel + n, yp + (r + m) * O + o);
      }
    }
  });
  return y;
}

// [outputs per panel, rows per pass]: how to pack a weight, and up to how many rows one pass serves
std::vector<int64_t> linear_panel_shape() { return {kPanel, kPanelRows}; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda, m) {
  m.def("linear_few_rows(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("linear_panels(Tensor x, Tensor wp, Tensor? bias, int out_features) -> Tensor");
  m.def("linear_panel_shape() -> int[]", &linear_panel_shape);
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) {
  m.impl("linear_few_rows", &linear_few_rows);
  m.impl("linear_panels", &linear_panels);
}
