// LoRA adapters' updates for a batch whose rows use different adapters (engine/lora.py): each row r of
// slot s gets y[r] += (x[r] @ At[s]) @ Bt[s] in one call per layer, with no gather, no padding and no
// scatter. Rows arrive grouped by slot; a block of up to 8 rows of one slot reads that slot's At and Bt
// once, both laid out so that a vector runs along their columns (no horizontal sums). A row's update is
// the same sequence of fused multiply-adds whatever the rows beside it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_vec.h"

namespace {

using namespace pagoda;
constexpr int kMaxRows = 8;  // rows per block: their accumulators stay in registers

inline void add_store(float* p, vec v) { *reinterpret_cast<vec*>(p) = load(p) + v; }
inline void add_store(c10::BFloat16* p, vec v) {
  const vec s = load(p) + v;
  for (int l = 0; l < kW; ++l) p[l] = c10::BFloat16(s[l]);  // round to nearest even, as torch does
}

struct Args {
  int64_t in, out, cols, rank;  // cols: the slices' rank columns of At, slices * rank
  const int64_t* slice_start;  // first output column of each slice; slice j ends where j + 1 starts (or out)
  int64_t num_slices;
};

// column tiles of NV vectors: M * NV accumulators, NV weight vectors and a broadcast in registers
template <int M>
constexpr int tile_vectors() { return std::max(1, std::min(4, (kRegs - 2) / (M + 1))); }

// t[m][c0 ..] = sum_k x[m][k] * at[k][c0 ..] (k ascending) for a tile of NV vectors of columns
template <int M, int NV, typename T>
void shrink_tile(const Args& g, const T* const* x, const T* at, float* t, int64_t c0) {
  vec acc[M][NV];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NV; ++j) acc[m][j] = vec{} + 0.f;
  for (int64_t k = 0; k < g.in; ++k) {
    vec w[NV];
    for (int j = 0; j < NV; ++j) w[j] = load(at + k * g.cols + c0 + j * kW);
    for (int m = 0; m < M; ++m) {
      const vec b = vec{} + float(x[m][k]);
      for (int j = 0; j < NV; ++j) acc[m][j] = fma(b, w[j], acc[m][j]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NV; ++j) *reinterpret_cast<vec*>(t + m * g.cols + c0 + j * kW) = acc[m][j];
}

// t: [M, cols] = x @ at (at: [in, cols])
template <int M, typename T>
void shrink(const Args& g, const T* const* x, const T* at, float* t) {
  constexpr int NV = tile_vectors<M>();
  int64_t c = 0;
  for (; c + NV * kW <= g.cols; c += NV * kW) shrink_tile<M, NV>(g, x, at, t, c);
  for (; c + kW <= g.cols; c += kW) shrink_tile<M, 1>(g, x, at, t, c);
  for (; c < g.cols; ++c)
    for (int m = 0; m < M; ++m) {
      float s = 0.f;
      for (int64_t k = 0; k < g.in; ++k) s = __builtin_fmaf(float(x[m][k]), float(at[k * g.cols + c]), s);
      t[m * g.cols + c] = s;
    }
}

// y[m][o ..] += sum_k tj[m][k] * bt[k][o ..] (k ascending) for a tile of NV vectors of outputs
template <int M, int NV, typename T>
void expand_tile(const Args& g, const float* tj, const T* bt, T* const* y, int64_t o) {
  vec acc[M][NV];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NV; ++j) acc[m][j] = vec{} + 0.f;
  for (int64_t k = 0; k < g.rank; ++k) {
    vec w[NV];
    for (int j = 0; j < NV; ++j) w[j] = load(bt + k * g.out + o + j * kW);
    for (int m = 0; m < M; ++m) {
      const vec b = vec{} + tj[m * g.cols + k];
      for (int j = 0; j < NV; ++j) acc[m][j] = fma(b, w[j], acc[m][j]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NV; ++j) add_store(y[m] + o + j * kW, acc[m][j]);
}

// y[m][slice j's outputs] += t[m][j * rank ..] @ bt[:, slice j's outputs]
template <int M, typename T>
void expand(const Args& g, const float* t, const T* bt, T* const* y) {
  constexpr int NV = tile_vectors<M>();
  for (int64_t j = 0; j < g.num_slices; ++j) {
    const int64_t end = j + 1 < g.num_slices ? g.slice_start[j + 1] : g.out;
    const float* tj = t + j * g.rank;
    int64_t o = g.slice_start[j];
    for (; o + NV * kW <= end; o += NV * kW) expand_tile<M, NV>(g, tj, bt, y, o);
    for (; o + kW <= end; o += kW) expand_tile<M, 1>(g, tj, bt, y, o);
    for (; o < end; ++o)
      for (int m = 0; m < M; ++m) {
        float s = 0.f;
        for (int64_t k = 0; k < g.rank; ++k) s = __builtin_fmaf(tj[m * g.cols + k], float(bt[k * g.out + o]), s);
        y[m][o] = T(float(y[m][o]) + s);
      }
  }
}

template <int M, typename T>
void block(const Args& g, const T* const* x, const T* at, const T* bt, T* const* y, float* t) {
  shrink<M, T>(g, x, at, t);
  expand<M, T>(g, t, bt, y);
}

template <typename T>
void run(const Args& g, const at::Tensor& y, const at::Tensor& x, const at::Tensor& At, const at::Tensor& Bt,
         const int64_t* rows, const int64_t* slots, const std::vector<int64_t>& starts) {
  T* yp = y.data_ptr<T>();
  const T* xp = x.data_ptr<T>();
  const T* ap = At.data_ptr<T>();
  const T* bp = Bt.data_ptr<T>();
  const int64_t ldy = y.stride(0), ldx = x.stride(0), a_slot = At.stride(0), b_slot = Bt.stride(0);
  const int64_t num_blocks = static_cast<int64_t>(starts.size()) - 1;
  // blocks per task: at least ~64k multiply-adds (below that a parallel region costs more than it saves)
  const int64_t per_block = kMaxRows * (g.cols * g.in + g.rank * g.out);
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, per_block));
  at::parallel_for(0, num_blocks, grain, [&](int64_t first, int64_t last) {
    std::vector<float> t(kMaxRows * g.cols + kW);  // [rows, cols]: the block's x @ At
    const T* xr[kMaxRows];
    T* yr[kMaxRows];
    for (int64_t b = first; b < last; ++b) {
      const int64_t lo = starts[b], n = starts[b + 1] - lo, s = slots[lo];
      for (int64_t m = 0; m < n; ++m) {
        xr[m] = xp + rows[lo + m] * ldx;
        yr[m] = yp + rows[lo + m] * ldy;
      }
      const T* a = ap + s * a_slot;
      const T* bt = bp + s * b_slot;
#define PAGODA_ROWS(M) \
  case M:              \
    block<M, T>(g, xr, a, bt, yr, t.data()); \
    break;
      switch (n) {
        PAGODA_ROWS(1) PAGODA_ROWS(2) PAGODA_ROWS(3) PAGODA_ROWS(4)
        PAGODA_ROWS(5) PAGODA_ROWS(6) PAGODA_ROWS(7) PAGODA_ROWS(8)
      }
#undef PAGODA_ROWS
    }
  });
}

// y: [n, out] (the base layer's output, updated in place), x: [n, in]; At: [slots, in, slices * rank];
// Bt: [slots, rank, out] (slice j's outputs take At's columns j * rank ..); rows: [m] the batch rows
// with an adapter, grouped by slot; slots: [m] their slots; slice_start: each slice's first output.
void lora_rows_(const at::Tensor& y, const at::Tensor& x, const at::Tensor& At, const at::Tensor& Bt,
                const at::Tensor& rows, const at::Tensor& slots, at::IntArrayRef slice_start, int64_t rank) {
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && At.dim() == 3 && Bt.dim() == 3, "y, x: 2-d; At, Bt: 3-d");
  TORCH_CHECK(y.scalar_type() == x.scalar_type() && At.scalar_type() == x.scalar_type() &&
              Bt.scalar_type() == x.scalar_type(), "y, x, At and Bt must share a dtype");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1 && At.stride(2) == 1 && At.stride(1) == At.size(2) &&
              Bt.stride(2) == 1 && Bt.stride(1) == Bt.size(2), "rows of y, x, At and Bt must be contiguous");
  TORCH_CHECK(rows.scalar_type() == at::kLong && slots.scalar_type() == at::kLong && rows.is_contiguous() &&
              slots.is_contiguous() && rows.numel() == slots.numel(), "rows and slots: int64 [m]");
  const int64_t num_slices = static_cast<int64_t>(slice_start.size());
  Args g{x.size(1), y.size(1), At.size(2), rank, slice_start.data(), num_slices};
  TORCH_CHECK(At.size(1) == g.in && Bt.size(2) == g.out && Bt.size(1) == rank && g.cols == num_slices * rank &&
              x.size(0) == y.size(0) && At.size(0) == Bt.size(0), "shapes of y, x, At and Bt do not fit");
  const int64_t m = rows.numel();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  std::vector<int64_t> starts;  // blocks: runs of one slot, at most kMaxRows rows
  for (int64_t i = 0; i < m; ++i) {
    TORCH_CHECK(rp[i] >= 0 && rp[i] < x.size(0) && sp[i] >= 0 && sp[i] < At.size(0), "row or slot out of range");
    if (starts.empty() || sp[i] != sp[i - 1] || i - starts.back() == kMaxRows) starts.push_back(i);
  }
  starts.push_back(m);
  if (m == 0) return;
  if (x.scalar_type() == at::kFloat) run<float>(g, y, x, At, Bt, rp, sp, starts);
  else if (x.scalar_type() == at::kBFloat16) run<c10::BFloat16>(g, y, x, At, Bt, rp, sp, starts);
  else TORCH_CHECK(false, "float32 or bfloat16 only");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda, m) {
  m.def("lora_rows_(Tensor(a!) y, Tensor x, Tensor At, Tensor Bt, Tensor rows, Tensor slots, int[] slice_start, "
        "int rank) -> ()");
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) { m.impl("lora_rows_", &lora_rows_); }
