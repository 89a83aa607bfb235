// PagedAttention on the CPU. Every query token attends over its sequence's cached keys up to its
// own position (within a sliding window: only the last `window` of them), reading K and V in place
// from the blocks its block table names (no gather, no padding; blocks before the window are never
// read, so they may be freed). Scores may be soft-capped (Gemma 2) and each head's softmax may
// normalize over one more, learned logit (gpt-oss's sinks). One work item is one KV head of a tile of query tokens: a decode token alone, or a few
// consecutive tokens of a prefill chunk, with the GQA group's query heads; every key and value
// loaded feeds all of the tile's rows. Decode tokens and prefill chunks go through the same loop,
// and the items are split over the threads by their cost.
//
// Cache layout, per block and KV head (the same bytes per block as the torch and Triton layout,
// [block_size, num_kv_heads, head_dim], read another way):
//   k_cache: [num_blocks, num_kv_heads, head_dim, block_size]  keys transposed: a block's scores
//            are head_dim broadcast-multiply-adds over block_size lanes, no horizontal sums
//   v_cache: [num_blocks, num_kv_heads, block_size, head_dim]  rows: a multiply-add per key
// An 8-bit cache (int8, or fp8 e4m3) has a float32 scale per token and KV head beside it, k_scale and
// v_scale: [num_blocks, num_kv_heads, block_size] (the bytes of the torch layout's [num_blocks, block_size,
// num_kv_heads]). Values are widened to float in registers as they are loaded; a key's scale multiplies its
// scores, a value's its softmax weights.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include "cpu_math.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

// Below this many multiply-adds a call runs on one thread: waking the others costs more than it saves,
// and on a busy machine a descheduled thread holds everyone at the barrier for a whole time slice (a
// single stream's decode). set_attention_min_work changes it (0: always split; for A/B runs).
std::atomic<int64_t> min_parallel_work{1 << 18};

struct Shape {
  int64_t heads, head_dim, block_size, kv_heads, group, blocks_per_seq, num_blocks;
  int64_t q_tok, q_head;  // q's strides, in elements
  // every token in a tile of its own: a multi-token tile sums its scores in other chains than a single
  // token does, so a prompt token would differ by a rounding from the same token decoded (batch_invariant)
  bool single_token_tiles;
  int64_t window;      // keys a token sees at most (its own included); 0: all before it
  float softcap;       // scores -> softcap * tanh(scores / softcap); 0: none
  const float* sinks;  // [heads]: a logit each head's softmax also normalizes over; nullptr: none
  const float* k_scale;  // an 8-bit cache's scales, [num_blocks, kv_heads, block_size]; nullptr: none
  const float* v_scale;
};

// A cache element as float: 16/32-bit and int8 by conversion; fp8 e4m3 by its bits (4 vector instructions,
// where c10's conversion does not vectorize): its sign, exponent and mantissa, sign-extended and shifted, are a
// float's with an exponent 120 short (bias 7, not 127), which the multiply adds back (subnormals included)
template <typename X>
inline float to_float(X x) { return static_cast<float>(x); }
inline float to_float(c10::Float8_e4m3fn x) {
  const int32_t bits = (static_cast<int32_t>(static_cast<int8_t>(x.x)) << 20) & static_cast<int32_t>(0x87F00000u);
  float f;
  std::memcpy(&f, &bits, 4);
  return f * 0x1p120f;
}

// The 8-bit formats: largest magnitude, and x (already divided by its scale) rounded into them
template <typename C>
constexpr float kMax = std::is_same_v<C, int8_t> ? 127.f : 448.f;
inline void quantize(int8_t& out, float x) { out = static_cast<int8_t>(std::nearbyint(std::clamp(x, -127.f, 127.f))); }
inline void quantize(c10::Float8_e4m3fn& out, float x) { out = c10::Float8_e4m3fn(std::clamp(x, -448.f, 448.f)); }

// The first key a token that sees n keys attends to.
inline int64_t first_key(int64_t n, int64_t window) { return window > 0 && n > window ? n - window : 0; }

// Asks for n elements from p into the cache ahead of their use: a block's chunk of keys or values
// is too short for the hardware prefetcher to find the stream in time.
template <typename T>
inline void prefetch(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < n * static_cast<int64_t>(sizeof(T)); i += 64) __builtin_prefetch(c + i);
}

// out[g * out_stride + i] = sum over u of acc[g][u][i]: the independent multiply-add chains added up
template <int64_t GC, int64_t U, int64_t N>
inline void sum_chains(float* out, int64_t out_stride, const float (&acc)[GC][U][N]) {
  for (int64_t g = 0; g < GC; ++g)
#pragma omp simd
    for (int64_t i = 0; i < N; ++i) {
      float sum = 0.f;
      for (int64_t u = 0; u < U; ++u) sum += acc[g][u][i];
      out[g * out_stride + i] = sum;
    }
}

// The two passes over one sequence's blocks for one KV head, for R = TM * GC query rows: TM
// consecutive tokens of the sequence (the last one at key count n, the others one key fewer each)
// times GC query heads of the GQA group. Each key and value loaded feeds R multiply-adds. D_, BS_ > 0:
// head and block size fixed at compile time, so that the accumulators live in registers; 0: sizes
// known only at run time (then TM = 1).
template <int64_t D_, int64_t BS_, int64_t GC, int64_t TM>
struct Pass {
  static constexpr int64_t R = TM * GC;
  int64_t D, BS, n, stride;  // head and block size, keys the last row sees, scores' row stride
  int64_t first;             // the first block any row sees: scores[r][0] is its first key's
  const int32_t* table;      // the sequence's blocks
  int64_t block_stride, head_offset;

  // scores[r][j] = sum_d q[r][d] * k_j[d] for the n keys; q: [R, D], a block's keys: [D, BS]
  template <typename T>
  void scores(float* __restrict scores, const float* __restrict q, const T* k_cache, const T* v_cache) const {
    const int64_t num_blocks = (n + BS - 1) / BS;
    const int64_t chunk = D * BS;  // one block's keys (or values) of this head
    for (int64_t b = first; b < num_blocks; ++b) {
      const T* __restrict kt = k_cache + table[b] * block_stride + head_offset;
      if (b + 2 < num_blocks) prefetch(k_cache + table[b + 2] * block_stride + head_offset, chunk);
      prefetch(v_cache + table[b] * block_stride + head_offset, chunk);
      float* out = scores + (b - first) * BS;
      if constexpr (D_ > 0 && BS_ > 0 && D_ % std::max<int64_t>(1, 8 / R) == 0) {
        constexpr int64_t U = std::max<int64_t>(1, 8 / R);  // at least 8 independent multiply-add chains
        float acc[R][U][BS_] = {};
        for (int64_t d = 0; d < D_; d += U)
          for (int64_t u = 0; u < U; ++u)
            for (int64_t r = 0; r < R; ++r) {
              const float qd = q[r * D_ + d + u];
#pragma omp simd
              for (int64_t j = 0; j < BS_; ++j) acc[r][u][j] += qd * to_float(kt[(d + u) * BS_ + j]);
            }
        sum_chains(out, stride, acc);
      } else {
        for (int64_t r = 0; r < R; ++r) {
          float* o = out + r * stride;
          std::fill(o, o + BS, 0.f);
          for (int64_t d = 0; d < D; ++d) {
            const float qd = q[r * D + d];
#pragma omp simd
            for (int64_t j = 0; j < BS; ++j) o[j] += qd * to_float(kt[d * BS + j]);
          }
        }
      }
    }
  }

  // out[r][d] = sum_j p[r][j] * v_j[d] over the n values; out: [R, D], a block's values: [BS, D].
  // A row that sees fewer than n keys has zeros past its own.
  template <typename T>
  void weighted_sum(float* __restrict out, const float* __restrict p, const T* v_cache) const {
    if constexpr (D_ > 0 && BS_ > 0) {
      constexpr int64_t U = std::max<int64_t>(1, (D_ <= 64 ? 4 : 2) / R);
      float acc[R][U][D_] = {};  // kept across blocks
      for (int64_t b = first; b * BS_ < n; ++b) {
        const T* __restrict v = v_cache + table[b] * block_stride + head_offset;
        const float* pb = p + (b - first) * BS_;
        const int64_t m = std::min<int64_t>(BS_, n - b * BS_);
        int64_t j = 0;
        for (; j + U <= m; j += U)
          for (int64_t u = 0; u < U; ++u)
            for (int64_t r = 0; r < R; ++r) {
              const float pj = pb[r * stride + j + u];
#pragma omp simd
              for (int64_t d = 0; d < D_; ++d) acc[r][u][d] += pj * to_float(v[(j + u) * D_ + d]);
            }
        for (; j < m; ++j)
          for (int64_t r = 0; r < R; ++r) {
            const float pj = pb[r * stride + j];
#pragma omp simd
            for (int64_t d = 0; d < D_; ++d) acc[r][0][d] += pj * to_float(v[j * D_ + d]);
          }
      }
      sum_chains(out, D_, acc);
    } else {
      std::fill(out, out + R * D, 0.f);
      for (int64_t b = first; b * BS < n; ++b) {
        const T* v = v_cache + table[b] * block_stride + head_offset;
        for (int64_t j = 0; j < std::min(BS, n - b * BS); ++j)
          for (int64_t r = 0; r < R; ++r) {
            const float pj = p[r * stride + (b - first) * BS + j];
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) out[r * D + d] += pj * to_float(v[j * D + d]);
          }
      }
    }
  }
};

// x[0, 16) -> their max (MAX) or sum, by halves (a reduction loop would add them one by one)
template <bool MAX>
inline float reduce16(float* x) {
  for (int w = 8; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) x[l] = MAX ? (x[l + w] > x[l] ? x[l + w] : x[l]) : x[l] + x[l + w];
  return x[0];
}

// row[start, n) -> exp(row - max) in place (soft-capped first where softcap > 0), the rest of
// row[0, padded) -> 0; returns 1 / the sum, a sink's exp(sink - max) included where sink is finite
// (max then covers it too). padded: n rounded up to a multiple of 16 that the row has room for, so
// that both loops run whole vectors.
inline float softmax_unnormalized(float* row, int64_t start, int64_t n, int64_t padded, float softcap, float sink) {
  if (softcap > 0.f)
    for (int64_t j = start; j < n; ++j) row[j] = softcap * std::tanh(row[j] / softcap);
  float lanes[16];
  std::fill(lanes, lanes + 16, -INFINITY);
  for (int64_t j = 0; j < padded; j += 16)
#pragma omp simd
    for (int64_t l = 0; l < 16; ++l) {
      const float v = j + l < n && j + l >= start ? row[j + l] : -INFINITY;
      lanes[l] = v > lanes[l] ? v : lanes[l];
    }
  const float mx = std::max(reduce16<true>(lanes), sink);
  std::fill(lanes, lanes + 16, 0.f);
  for (int64_t j = 0; j < padded; j += 16)
#pragma omp simd
    for (int64_t l = 0; l < 16; ++l) {
      const float d = row[j + l] - mx;  // weights below e^kEmin are 0: no subnormal products with V
      const float e = j + l < n && j + l >= start && d >= pagoda::kEmin ? pagoda::exp_approx(d) : 0.f;
      row[j + l] = e;
      lanes[l] += e;
    }
  const float sum = reduce16<false>(lanes);
  return 1.f / (std::isfinite(sink) ? sum + std::exp(sink - mx) : sum);
}

// rows[r][(b - first) * BS + j] *= the scale of key j of block b, for the R rows (stride apart) and the
// blocks [first, num_blocks) of a sequence's table: an 8-bit cache's key scales on the scores, its value
// scales on the softmax weights
inline void scale_columns(float* rows, int64_t R, int64_t stride, const float* scale, const int32_t* table,
                          int64_t first, int64_t num_blocks, int64_t BS, int64_t block_stride, int64_t head_offset) {
  for (int64_t b = first; b < num_blocks; ++b) {
    const float* sc = scale + table[b] * block_stride + head_offset;
    for (int64_t r = 0; r < R; ++r) {
      float* row = rows + r * stride + (b - first) * BS;
#pragma omp simd
      for (int64_t j = 0; j < BS; ++j) row[j] *= sc[j];
    }
  }
}

// Work: `count` consecutive query tokens from flat index `token`, all of one sequence; one item per
// KV head. cost ~ the multiply-adds, to split the items evenly over the threads.
struct Tile {
  int64_t token, count, cost;
};

// tokens -> tiles of tm consecutive tokens of one sequence where they run that long, single tokens
// otherwise (decode rows, a chunk's remainder)
std::vector<Tile> tile_tokens(const std::vector<int64_t>& seq_of, const std::vector<int64_t>& pos_of, int64_t tm,
                              int64_t window) {
  const auto seen = [window](int64_t pos) { return window > 0 ? std::min(pos + 1, window) : pos + 1; };
  std::vector<Tile> tiles;
  const int64_t num_tokens = static_cast<int64_t>(seq_of.size());
  for (int64_t t = 0; t < num_tokens;) {
    int64_t run = 1;
    while (t + run < num_tokens && seq_of[t + run] == seq_of[t] && pos_of[t + run] == pos_of[t] + run) ++run;
    const int64_t full = tm > 1 ? run / tm * tm : 0;
    for (int64_t i = 0; i < full; i += tm) tiles.push_back({t + i, tm, tm * seen(pos_of[t + i + tm - 1]) + 16});
    for (int64_t i = full; i < run; ++i) tiles.push_back({t + i, 1, seen(pos_of[t + i]) + 16});
    t += run;
  }
  return tiles;
}

template <typename T, typename C, int64_t D_, int64_t BS_, int64_t GC, int64_t TM>
void attend_tile(T* out, const T* q, const C* k_cache, const C* v_cache, const int32_t* table, int64_t t0,
                 int64_t n, int64_t h, float scale, const Shape& s, std::vector<float>& qf,
                 std::vector<float>& acc, std::vector<float>& scores) {
  const int64_t D = D_ ? D_ : s.head_dim, BS = BS_ ? BS_ : s.block_size, G = s.group;
  const int64_t head_stride = D * BS, block_stride = s.kv_heads * head_stride;
  constexpr int64_t R = TM * GC;
  const int64_t num_blocks = (n + BS - 1) / BS;
  const int64_t first_block = first_key(n - (TM - 1), s.window) / BS;  // the tile's first token sees the earliest keys
  // score rows padded to whole 16-lane vectors for the softmax
  const Pass<D_, BS_, GC, TM> pass{D, BS, n, ((num_blocks - first_block) * BS + 15) / 16 * 16, first_block, table,
                                   block_stride, h * head_stride};
  scores.resize(R * pass.stride);  // the tail of the last block past n is computed and ignored
  for (int64_t g0 = 0; g0 < G; g0 += GC) {
    const int64_t first = h * G + g0;  // the first query head of this pass
    for (int64_t i = 0; i < TM; ++i)
      for (int64_t g = 0; g < GC; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[(i * GC + g) * D + d] = static_cast<float>(q[(t0 + i) * s.q_tok + (first + g) * s.q_head + d]) * scale;
    pass.scores(scores.data(), qf.data(), k_cache, v_cache);
    if (s.k_scale)
      scale_columns(scores.data(), R, pass.stride, s.k_scale, table, first_block, num_blocks, BS, s.kv_heads * BS, h * BS);
    float inv[R];
    for (int64_t i = 0; i < TM; ++i) {
      const int64_t seen = n - (TM - 1 - i);  // token i sees the keys up to its own position
      const int64_t offset = first_block * BS;  // the key of each row's column 0
      for (int64_t g = 0; g < GC; ++g) {
        float* row = &scores[(i * GC + g) * pass.stride];
        const float sink = s.sinks ? s.sinks[first + g] : -INFINITY;
        inv[i * GC + g] = softmax_unnormalized(row, first_key(seen, s.window) - offset, seen - offset, pass.stride,
                                               s.softcap, sink);
      }
    }
    if (s.v_scale)
      scale_columns(scores.data(), R, pass.stride, s.v_scale, table, first_block, num_blocks, BS, s.kv_heads * BS, h * BS);
    pass.weighted_sum(acc.data(), scores.data(), v_cache);
    for (int64_t i = 0; i < TM; ++i)
      for (int64_t g = 0; g < GC; ++g) {
        T* oh = out + ((t0 + i) * s.heads + first + g) * D;
        for (int64_t d = 0; d < D; ++d) oh[d] = static_cast<T>(acc[(i * GC + g) * D + d] * inv[i * GC + g]);
      }
  }
}

template <typename T, typename C, int64_t D_, int64_t BS_, int64_t GC>
void attend(T* out, const T* q, const C* k_cache, const C* v_cache, const int32_t* tables,
            const std::vector<int64_t>& seq_of, const std::vector<int64_t>& pos_of, float scale,
            const Shape& s) {
  // query tokens per tile: R = TM * GC rows of accumulators, D floats each, stay in registers
  constexpr int64_t TM = D_ > 0 && BS_ > 0 ? std::max<int64_t>(1, 256 / (GC * D_)) : 1;
  const int64_t D = D_ ? D_ : s.head_dim;
  const std::vector<Tile> tiles = tile_tokens(seq_of, pos_of, s.single_token_tiles ? 1 : TM, s.window);
  const int64_t num_items = static_cast<int64_t>(tiles.size()) * s.kv_heads;
  // contiguous runs of items of about equal cost, one per thread
  int64_t total = 0, so_far = 0;
  for (const Tile& tile : tiles) total += tile.cost * s.kv_heads;
  const bool small = total * s.group * D * 2 < min_parallel_work.load(std::memory_order_relaxed);
  const int64_t num_threads = small ? 1 : std::min<int64_t>(at::get_num_threads(), num_items);
  std::vector<int64_t> bounds{0};  // thread i takes items [bounds[i], bounds[i + 1])
  for (int64_t i = 0; i < num_items; ++i) {
    so_far += tiles[i / s.kv_heads].cost;
    for (int64_t k = static_cast<int64_t>(bounds.size()); k < num_threads && so_far * num_threads >= total * k; ++k)
      bounds.push_back(i + 1);
  }
  while (static_cast<int64_t>(bounds.size()) <= num_threads) bounds.push_back(num_items);
  at::parallel_for(0, num_threads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(TM * GC * D), acc(TM * GC * D), scores;
    for (int64_t item = bounds[begin]; item < bounds[end]; ++item) {
      const Tile& tile = tiles[item / s.kv_heads];
      const int64_t h = item % s.kv_heads, t = tile.token + tile.count - 1;  // the tile's last token
      const int64_t n = pos_of[t] + 1;  // the keys it sees
      if (n <= 0) {  // a padding row (context 0): zeros
        std::fill(out + t * s.heads * D + h * s.group * D, out + t * s.heads * D + (h + 1) * s.group * D,
                  static_cast<T>(0));
        continue;
      }
      const int32_t* table = tables + seq_of[t] * s.blocks_per_seq;
      for (int64_t b = first_key(n - (tile.count - 1), s.window) / s.block_size; b < (n + s.block_size - 1) / s.block_size; ++b)
        TORCH_CHECK(table[b] >= 0 && table[b] < s.num_blocks, "block table entry ", table[b],
                    " is outside the cache (", s.num_blocks, " blocks)");
      if (tile.count == TM)
        attend_tile<T, C, D_, BS_, GC, TM>(out, q, k_cache, v_cache, table, tile.token, n, h, scale, s, qf, acc, scores);
      else
        attend_tile<T, C, D_, BS_, GC, 1>(out, q, k_cache, v_cache, table, tile.token, n, h, scale, s, qf, acc, scores);
    }
  });
}

template <typename T, typename C, int64_t D_, int64_t BS_>
void attend_gc(T* out, const T* q, const C* kc, const C* vc, const int32_t* tables,
               const std::vector<int64_t>& seq_of, const std::vector<int64_t>& pos_of, float scale, const Shape& s) {
  // An 8-bit cache: the whole GQA group in one pass, so that each key and value is widened once for all its
  // query heads, not once per pair (the widening, not the bytes, bounds these loops; int8 at Qwen2.5-0.5B's
  // group of 7: 1.5x the bfloat16 cache, against 0.8x in pairs)
  if constexpr (!std::is_same_v<C, T> && !std::is_same_v<T, double> && (D_ == 64 || D_ == 128) && BS_ > 0) {
    switch (s.group) {
      case 4: return attend<T, C, D_, BS_, 4>(out, q, kc, vc, tables, seq_of, pos_of, scale, s);
      case 6: return attend<T, C, D_, BS_, 6>(out, q, kc, vc, tables, seq_of, pos_of, scale, s);
      case 7: return attend<T, C, D_, BS_, 7>(out, q, kc, vc, tables, seq_of, pos_of, scale, s);
      case 8: return attend<T, C, D_, BS_, 8>(out, q, kc, vc, tables, seq_of, pos_of, scale, s);
      default: break;
    }
  }
  if (s.group % 2 == 0) return attend<T, C, D_, BS_, 2>(out, q, kc, vc, tables, seq_of, pos_of, scale, s);
  return attend<T, C, D_, BS_, 1>(out, q, kc, vc, tables, seq_of, pos_of, scale, s);
}

template <typename T, typename C, int64_t D>
void attend_bs(T* out, const T* q, const C* kc, const C* vc, const int32_t* tables, const std::vector<int64_t>& seq_of,
               const std::vector<int64_t>& pos_of, float scale, const Shape& s) {
  if (s.block_size == 16) return attend_gc<T, C, D, 16>(out, q, kc, vc, tables, seq_of, pos_of, scale, s);
  return attend_gc<T, C, D, 0>(out, q, kc, vc, tables, seq_of, pos_of, scale, s);
}

template <typename T, typename C>
void attend_any(T* out, const T* q, const C* kc, const C* vc, const int32_t* tables,
                const std::vector<int64_t>& seq_of, const std::vector<int64_t>& pos_of, float scale,
                const Shape& s) {
  switch (s.head_dim) {
    case 32: return attend_bs<T, C, 32>(out, q, kc, vc, tables, seq_of, pos_of, scale, s);
    case 64: return attend_bs<T, C, 64>(out, q, kc, vc, tables, seq_of, pos_of, scale, s);
    case 128: return attend_bs<T, C, 128>(out, q, kc, vc, tables, seq_of, pos_of, scale, s);
    default: return attend_bs<T, C, 0>(out, q, kc, vc, tables, seq_of, pos_of, scale, s);
  }
}

void check_caches(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4, "the caches must have 4 dimensions");
  TORCH_CHECK(k_cache.size(0) == v_cache.size(0) && k_cache.size(1) == v_cache.size(1) &&
                  k_cache.size(2) == v_cache.size(3) && k_cache.size(3) == v_cache.size(2),
              "k_cache must be [num_blocks, num_kv_heads, head_dim, block_size] and v_cache "
              "[num_blocks, num_kv_heads, block_size, head_dim]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "the caches must share a dtype");
}

// An 8-bit cache's scales, checked; {nullptr, nullptr} for a 16/32-bit cache (which has none)
std::pair<float*, float*> cache_scales(const at::Tensor& k_cache, const c10::optional<at::Tensor>& k_scale,
                                       const c10::optional<at::Tensor>& v_scale) {
  const bool eight = k_cache.scalar_type() == at::kChar || k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(eight == k_scale.has_value() && eight == v_scale.has_value(),
              "k_scale and v_scale go with an 8-bit (int8 or fp8) cache, and only with one");
  if (!eight) return {nullptr, nullptr};
  for (const at::Tensor* t : {&*k_scale, &*v_scale})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 && t->size(0) == k_cache.size(0) &&
                    t->size(1) == k_cache.size(1) && t->size(2) == k_cache.size(3),
                "k_scale and v_scale must be contiguous float32 [num_blocks, num_kv_heads, block_size]");
  return {k_scale->data_ptr<float>(), v_scale->data_ptr<float>()};
}

// Calls f(k_cache's data, v_cache's data) with the caches' element type: T, int8 or fp8
template <typename T, typename F>
void with_cache_type(const at::Tensor& k_cache, const at::Tensor& v_cache, F&& f) {
  if (k_cache.scalar_type() == at::kChar) return f(k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>());
  if (k_cache.scalar_type() == at::kFloat8_e4m3fn)
    return f(k_cache.data_ptr<c10::Float8_e4m3fn>(), v_cache.data_ptr<c10::Float8_e4m3fn>());
  f(k_cache.data_ptr<T>(), v_cache.data_ptr<T>());
}

// x's D values -> out[d * stride] in 8 bits, and their scale (absolute max / the format's largest) -> *scale
// (engine/layers/attention.py quantize_kv)
template <typename T, typename C>
void store_8bit(const T* x, C* out, int64_t stride, int64_t D, float* scale) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::abs(static_cast<float>(x[d])));
  const float sc = amax > 0.f ? amax / kMax<C> : 1.f;
  for (int64_t d = 0; d < D; ++d) quantize(out[d * stride], static_cast<float>(x[d]) / sc);
  *scale = sc;
}

// q: [num_tokens, num_heads, head_dim]; block_tables: [num_seqs, max_blocks] int32;
// query_start_loc: [num_seqs + 1] int32, or None for one token per sequence; context_lens:
// [num_seqs] int32, each sequence's length including its new tokens, which are its last ones
// (0: a padding row, whose output is zeros). batch_invariant: each token's output bitwise the same
// whatever else the call holds (decode or prefill, any batch). window, softcap, sinks: see Shape (a
// block table's entries before a token's window are never read). k_scale, v_scale: an 8-bit cache's scales
// (see the top), None otherwise. Returns out: [num_tokens, num_heads, head_dim].
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const c10::optional<at::Tensor>& query_start_loc,
                           const at::Tensor& context_lens, double scale, bool batch_invariant, int64_t window,
                           double softcap, const c10::optional<at::Tensor>& sinks,
                           const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale) {
  check_caches(k_cache, v_cache);
  const auto [ks, vs] = cache_scales(k_cache, k_scale, v_scale);
  TORCH_CHECK(q.dim() == 3 && (ks || q.scalar_type() == k_cache.scalar_type()),
              "q must be 3-d, in the caches' dtype (unless they are 8-bit)");
  TORCH_CHECK(q.stride(2) == 1, "q's last dimension must be contiguous");
  TORCH_CHECK(q.size(2) == k_cache.size(2) && q.size(1) % k_cache.size(1) == 0, "q does not match the cache");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() && block_tables.dim() == 2,
              "block_tables must be a contiguous int32 matrix");
  TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.is_contiguous() && context_lens.dim() == 1,
              "context_lens must be a contiguous int32 vector");
  const int64_t num_tokens = q.size(0), num_seqs = context_lens.size(0);
  TORCH_CHECK(block_tables.size(0) == num_seqs, "block_tables has ", block_tables.size(0), " rows for ",
              num_seqs, " sequences");
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0");
  TORCH_CHECK(!sinks.has_value() || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                                     sinks->numel() == q.size(1)),
              "sinks must be float32 with one logit per query head");
  Shape s{q.size(1), q.size(2), k_cache.size(3), k_cache.size(1), q.size(1) / k_cache.size(1),
          block_tables.size(1), k_cache.size(0), q.stride(0), q.stride(1), batch_invariant, window,
          static_cast<float>(softcap), sinks.has_value() ? sinks->data_ptr<float>() : nullptr, ks, vs};

  const int32_t* ctx = context_lens.data_ptr<int32_t>();
  for (int64_t i = 0; i < num_seqs; ++i)
    TORCH_CHECK(ctx[i] >= 0 && ctx[i] <= s.blocks_per_seq * s.block_size, "context length ", ctx[i],
                " of sequence ", i, " is not in [0, block_tables width * block_size]");
  std::vector<int64_t> seq_of(num_tokens), pos_of(num_tokens);
  if (query_start_loc.has_value()) {
    const at::Tensor& qsl = *query_start_loc;
    TORCH_CHECK(qsl.scalar_type() == at::kInt && qsl.is_contiguous() && qsl.numel() == num_seqs + 1,
                "query_start_loc must be int32 with num_seqs + 1 entries");
    const int32_t* loc = qsl.data_ptr<int32_t>();
    TORCH_CHECK(loc[0] == 0 && loc[num_seqs] == num_tokens, "query_start_loc must span q's tokens");
    for (int64_t i = 0; i < num_seqs; ++i) {
      const int64_t len = loc[i + 1] - loc[i];
      TORCH_CHECK(len >= 0 && len <= ctx[i], "sequence ", i, " has more new tokens than context");
      for (int64_t j = 0; j < len; ++j) {
        seq_of[loc[i] + j] = i;
        pos_of[loc[i] + j] = ctx[i] - len + j;
      }
    }
  } else {
    TORCH_CHECK(num_tokens == num_seqs, "without query_start_loc there is one token per sequence");
    for (int64_t i = 0; i < num_seqs; ++i) {
      seq_of[i] = i;
      pos_of[i] = ctx[i] - 1;
    }
  }

  at::Tensor out = at::empty({num_tokens, s.heads, s.head_dim}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    with_cache_type<scalar_t>(k_cache, v_cache, [&](auto* kc, auto* vc) {
      attend_any<scalar_t>(out.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), kc, vc, block_tables.data_ptr<int32_t>(),
                           seq_of, pos_of, static_cast<float>(scale), s);
    });
  });
  return out;
}

// k, v: [num_tokens, num_kv_heads, head_dim] into the slots slot_mapping names (block * block_size
// + offset); tokens with a negative slot are skipped. An 8-bit cache takes each token's values of each KV head
// divided by their scale, which goes into k_scale / v_scale.
void write_kv_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                    const at::Tensor& slot_mapping, const c10::optional<at::Tensor>& k_scale,
                    const c10::optional<at::Tensor>& v_scale) {
  check_caches(k_cache, v_cache);
  const auto [ks, vs] = cache_scales(k_cache, k_scale, v_scale);
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == k_cache.size(1) && k.size(2) == k_cache.size(2),
              "k and v must be [num_tokens, num_kv_heads, head_dim] matching the cache");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && (ks || k.scalar_type() == k_cache.scalar_type()),
              "k and v must be in the caches' dtype (unless they are 8-bit)");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k's and v's last dimension must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == k.size(0),
              "slot_mapping must be int64 with a slot per token");
  const int64_t num_tokens = k.size(0), KVH = k.size(1), D = k.size(2), BS = k_cache.size(3);
  const int64_t num_slots = k_cache.size(0) * BS;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " is outside the cache (", num_slots, " slots)");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv_cache", [&] {
    const scalar_t *kp = k.data_ptr<scalar_t>(), *vp = v.data_ptr<scalar_t>();
    const int64_t k_tok = k.stride(0), k_head = k.stride(1), v_tok = v.stride(0), v_head = v.stride(1);
    with_cache_type<scalar_t>(k_cache, v_cache, [&](auto* kc, auto* vc) {
      using C = std::remove_pointer_t<decltype(kc)>;
      // each token writes head_dim cache lines per KV head (the keys are stored transposed), so even
      // a decode step's few tokens are worth splitting over the threads
      at::parallel_for(0, num_tokens, std::max<int64_t>(1, 2048 / (KVH * D)), [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          if (slots[t] < 0) continue;
          const int64_t block = slots[t] / BS, off = slots[t] % BS;
          for (int64_t h = 0; h < KVH; ++h) {
            const scalar_t* kt = kp + t * k_tok + h * k_head;
            const scalar_t* vt = vp + t * v_tok + h * v_head;
            C* kd = kc + ((block * KVH + h) * D) * BS + off;  // [D, BS] column off
            C* vd = vc + ((block * KVH + h) * BS + off) * D;  // [BS, D] row off
            if constexpr (std::is_same_v<C, scalar_t>) {
              for (int64_t d = 0; d < D; ++d) kd[d * BS] = kt[d];
              std::memcpy(vd, vt, D * sizeof(scalar_t));
            } else {
              store_8bit(kt, kd, BS, D, ks + (block * KVH + h) * BS + off);
              store_8bit(vt, vd, 1, D, vs + (block * KVH + h) * BS + off);
            }
          }
        }
      });
    });
  });
}

void set_attention_min_work(int64_t work) { min_parallel_work.store(std::max<int64_t>(0, work)); }

}  // namespace

TORCH_LIBRARY(pagoda, m) {
  m.def("set_attention_min_work(int work) -> ()", &set_attention_min_work);
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor? query_start_loc, Tensor context_lens, float scale, bool batch_invariant=False, int window=0, "
        "float softcap=0., Tensor? sinks=None, Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor");
  m.def("write_kv_cache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "Tensor(c!)? k_scale=None, Tensor(d!)? v_scale=None) -> ()");
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("write_kv_cache", &write_kv_cache);
}
