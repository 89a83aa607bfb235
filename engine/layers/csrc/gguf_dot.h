// Integer dot products of GGUF weight blocks (gguf_blocks.h's layouts) with activations quantized to 16 bits:
// activations in blocks of 32 (dx = max|x| / 32767 in float32, q = round-half-even(x / dx) in int16), a span's
// weights unpacked once into int16 (offsets such as Q4_0's -8, Q5_0's -16, Q6_K's -32 applied to them), each
// block's products summed as integers (madd: int16 x int16 -> int32 pairs), then scaled in float: the 8 blocks
// (or sub-blocks) of a span of 256 weights each give 8 int32 partial sums, added into one vector of 8 block sums,
// converted once and multiplied by the 8 blocks' weight scale * activation scale. The weights' mins (Q4_1, Q5_1,
// Q4_K, Q5_K) use the activation blocks' sums dx * sum(q). A span's weights are reused for every row.
// 256-bit code in both builds (the AVX-512 build compiles it with EVEX encodings and 32 registers).
// Each activation is off by at most dx / 2 = max|x| / 65534 of its block (8 bits: max|x| / 254, which flipped
// greedy near-ties of the test models).
#pragma once

#include <cstdint>
#include <cstring>

#include "gguf_blocks.h"

namespace pagoda::gguf {

// M rows of quantized activations: row m's K int16 values at q + m * K, its K / 32 scales dx at d + m * K / 32
// and its K / 32 sums dx * (sum of q) over each block at s (for the weights' mins)
struct Q16Rows {
  const int16_t* q;
  const float* d;
  const float* s;
  int64_t K;
};

// n blocks of 32 floats at x -> q [32 n], d [n], s [n]
inline void quantize_blocks(const float* x, int64_t n, int16_t* q, float* d, float* s) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t b = 0; b < n; ++b, x += 32, q += 32) {
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float dx = _mm_cvtss_f32(h) / 32767.f;
    d[b] = dx;
    __m256i n[4];
    for (int i = 0; i < 4; ++i)  // x / dx rounded half to even (MXCSR's default); a zero block: 0
      n[i] = dx == 0.f ? _mm256_setzero_si256() : _mm256_cvtps_epi32(_mm256_div_ps(v[i], _mm256_set1_ps(dx)));
    // int32 -> int16 (packs works per 128-bit lane: the permute puts the 16 values back in order)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permute4x64_epi64(_mm256_packs_epi32(n[0], n[1]), 0xD8));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16),
                        _mm256_permute4x64_epi64(_mm256_packs_epi32(n[2], n[3]), 0xD8));
    const __m256i t = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
    __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0x4E));
    u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0xB1));
    s[b] = dx * static_cast<float>(_mm_cvtsi128_si32(u));  // |sum| <= 32 * 32767: exact in float
  }
}

inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256i join(__m128i lo, __m128i hi) { return _mm256_set_m128i(hi, lo); }
// a Q5 block's 32 quants: the nibbles at qs, bit j of the 4 bytes at qh the 5th bit of weight j (llama.cpp's
// bytes_from_bits_32: byte j gets qh's byte j / 8 and keeps its bit j % 8)
inline __m256i q5x32(const uint8_t* qh, const uint8_t* qs) {
  uint32_t h;
  std::memcpy(&h, qh, 4);
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0);
  const __m256i bits = _mm256_or_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(h)), shuf),
                                       _mm256_set1_epi64x(0x7FBFDFEFF7FBFDFELL));
  const __m256i fifth = _mm256_and_si256(_mm256_cmpeq_epi8(bits, _mm256_set1_epi8(-1)), _mm256_set1_epi8(16));
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_or_si256(join(low4(v), high4(v)), fifth);
}
inline float hsum(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
// 32 signed bytes -> 32 int16: values 0-15 in w[0], 16-31 in w[1]
inline void widen(__m256i q, __m256i* w) {
  w[0] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q));
  w[1] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1));
}
// a block's 32 int16 weights (w[0], w[1]) times 32 int16 activations at qx: 8 int32 partial sums
inline __m256i dot32(const __m256i* w, const int16_t* qx) {
  return _mm256_add_epi32(_mm256_madd_epi16(w[0], load32(qx)), _mm256_madd_epi16(w[1], load32(qx + 16)));
}
// the sums of 8 vectors of int32: lane j = the sum of v[j]'s lanes
inline __m256 reduce8(const __m256i* v) {
  const __m256i t0 = _mm256_hadd_epi32(v[0], v[1]), t1 = _mm256_hadd_epi32(v[2], v[3]);
  const __m256i t2 = _mm256_hadd_epi32(v[4], v[5]), t3 = _mm256_hadd_epi32(v[6], v[7]);
  const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);  // halves of v0-3 | v4-7's sums
  return _mm256_cvtepi32_ps(
      _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31)));
}
// the first n of 8 floats at p (the rest 0)
inline __m256 load8(const float* p, int n) {
  if (n == 8) return _mm256_loadu_ps(p);
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

// A type with an integer path: Dot<T>::rows<M> adds each row's dot with a span of weight blocks (kSpan of
// them, or n < kSpan at a row's end) to acc[m] (8 partial sums a row). The primary template marks the types
// without one: they keep the float path.
template <typename T>
struct Dot {
  static constexpr bool kHas = false;
};

// blocks of 32 weights w = d * q (+ m): a block's dot with 32 quantized activations is d * dx * sum(q * qx)
// (+ m * dx * sum(qx)). q in int16 (offsets already subtracted): |q| <= 128 (Q8_0's -128), so each block's
// integer sum is at most 32 * 128 * 32767 < 2^28 in magnitude, and madd's pairs never wrap (no -32768 in qx).
template <typename W>
struct Dot32 {
  static constexpr bool kHas = true;
  static constexpr int kSpan = 8;
  template <int M>
  static void rows(const uint8_t* b, int n, const Q16Rows& x, int64_t i, __m256* acc) {  // i: the span's first block
    __m256i w[16];
    __m128i dh = _mm_setzero_si128(), mh = _mm_setzero_si128();  // the blocks' f16 scales (and mins)
    for (int j = 0; j < 8; ++j) {
      if (j < n) {
        const uint8_t* p = b + j * W::kBytes;
        widen(W::quants(p), w + 2 * j);
        dh = _mm_insert_epi16(dh, *reinterpret_cast<const uint16_t*>(p), j);
        if (W::kMin) mh = _mm_insert_epi16(mh, *reinterpret_cast<const uint16_t*>(p + 2), j);
      } else {
        w[2 * j] = w[2 * j + 1] = _mm256_setzero_si256();
      }
    }
    const __m256 dw = _mm256_cvtph_ps(dh), mw = _mm256_cvtph_ps(mh);
    for (int r = 0; r < M; ++r) {
      const int16_t* qx = x.q + r * x.K + i * 32;
      __m256i v[8];
      // a row's end (j >= n): the next row's (or the scales') bytes, times 0
      for (int j = 0; j < 8; ++j) v[j] = dot32(w + 2 * j, qx + 32 * j);
      const int64_t at = r * x.K / 32 + i;
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, load8(x.d + at, n)), reduce8(v), acc[r]);
      if (W::kMin) acc[r] = _mm256_fmadd_ps(mw, load8(x.s + at, n), acc[r]);
    }
  }
};

// a block's bytes b -> its 32 quants as signed bytes, less the type's offset; d at b (f16), then kMin: m (f16)
struct Q8_0q {
  static constexpr int kBytes = 34;
  static constexpr bool kMin = false;
  static __m256i quants(const uint8_t* b) { return load32(b + 2); }
};
struct Q4_0q {  // q - 8
  static constexpr int kBytes = 18;
  static constexpr bool kMin = false;
  static __m256i quants(const uint8_t* b) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
    return _mm256_sub_epi8(join(low4(v), high4(v)), _mm256_set1_epi8(8));
  }
};
struct Q4_1q {
  static constexpr int kBytes = 20;
  static constexpr bool kMin = true;
  static __m256i quants(const uint8_t* b) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
    return join(low4(v), high4(v));
  }
};
struct Q5_0q {  // q - 16
  static constexpr int kBytes = 22;
  static constexpr bool kMin = false;
  static __m256i quants(const uint8_t* b) { return _mm256_sub_epi8(q5x32(b + 2, b + 6), _mm256_set1_epi8(16)); }
};
struct Q5_1q {
  static constexpr int kBytes = 24;
  static constexpr bool kMin = true;
  static __m256i quants(const uint8_t* b) { return q5x32(b + 4, b + 8); }
};
struct IQ4_NLq {  // the grid's values
  static constexpr int kBytes = 18;
  static constexpr bool kMin = false;
  static __m256i quants(const uint8_t* b) {
    const __m128i grid = iq4_grid();
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
    return join(_mm_shuffle_epi8(grid, low4(v)), _mm_shuffle_epi8(grid, high4(v)));
  }
};
template <> struct Dot<Q8_0> : Dot32<Q8_0q> {};
template <> struct Dot<Q4_0> : Dot32<Q4_0q> {};
template <> struct Dot<Q4_1> : Dot32<Q4_1q> {};
template <> struct Dot<Q5_0> : Dot32<Q5_0q> {};
template <> struct Dot<Q5_1> : Dot32<Q5_1q> {};
template <> struct Dot<IQ4_NL> : Dot32<IQ4_NLq> {};

// Q4_K / Q5_K: sub-block j (32 weights, one activation block) w = d * sc_j * q - dmin * m_j, q < 32:
// dot = sum_j d * sc_j * dx_j * sum(q * qx) - dmin * sum_j m_j * dx_j * sum(qx)
template <bool kFive>
struct DotK45 {
  static constexpr bool kHas = true;
  static constexpr int kSpan = 1;
  template <int M>
  static void rows(const uint8_t* b, int, const Q16Rows& x, int64_t i, __m256* acc) {  // i: the super-block
    const float d = f16(b), dmin = f16(b + 2);
    // scale_min's 6-bit fields, all 8 pairs at once (llama.cpp's masks): scales in u[0..1], mins in u[2..3]
    uint32_t u[4];
    std::memcpy(u, b + 4, 12);
    u[3] = ((u[2] >> 4) & 0x0F0F0F0F) | (((u[1] >> 6) & 0x03030303) << 4);
    const uint32_t m_lo = u[1] & 0x3F3F3F3F;
    u[1] = (u[2] & 0x0F0F0F0F) | (((u[0] >> 6) & 0x03030303) << 4);
    u[2] = m_lo;
    u[0] &= 0x3F3F3F3F;
    const __m128i sm = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u));
    const __m256 dsc = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm)));
    const __m256 dm = _mm256_mul_ps(_mm256_set1_ps(-dmin), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8))));
    const uint8_t* qs = b + (kFive ? 48 : 16);
    const __m256i nib = _mm256_set1_epi8(0x0F);
    __m256i q[8], w[16];
    for (int j = 0; j < 8; j += 2) {  // 32 bytes: sub-block j in the low nibbles, j + 1 in the high ones
      const __m256i v = load32(qs + 16 * j);
      q[j] = _mm256_and_si256(v, nib);
      q[j + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
    }
    if (kFive) {  // bit j of qh[l]: the 5th bit of sub-block j's weight l
      const __m256i qh = load32(b + 16), five = _mm256_set1_epi8(16);
      for (int j = 0; j < 8; ++j) {
        const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << j));
        q[j] = _mm256_or_si256(q[j], _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit), five));
      }
    }
    for (int j = 0; j < 8; ++j) widen(q[j], w + 2 * j);
    for (int r = 0; r < M; ++r) {
      const int16_t* qx = x.q + r * x.K + i * 256;
      __m256i v[8];
      for (int j = 0; j < 8; ++j) v[j] = dot32(w + 2 * j, qx + 32 * j);
      const int64_t at = r * x.K / 32 + 8 * i;
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dsc, _mm256_loadu_ps(x.d + at)), reduce8(v), acc[r]);
      acc[r] = _mm256_fmadd_ps(dm, _mm256_loadu_ps(x.s + at), acc[r]);
    }
  }
};
template <> struct Dot<Q4_K> : DotK45<false> {};
template <> struct Dot<Q5_K> : DotK45<true> {};

// Q6_K: w = d * sc_k * (q - 32), one int8 scale sc_k per 16 weights (group k: sub-block k / 2's first or last 16),
// q < 64: dot = d * sum_k sc_k * dx_(k / 2) * sum over group k of (q - 32) * qx. The 16 group sums stay apart
// and are scaled in float: |q - 32| <= 32 and |qx| <= 32767, so a group's sum (and every partial sum madd and
// reduce8 form of it) is at most 16 * 32 * 32767 = 16,776,704 < 2^24 in magnitude: no int32 overflow, and exact in
// float. (Scaled by sc_k in integers it could reach 128 * 16 * 32 * 32767, a hair under 2^31 for one group; two
// groups, a whole block, would overflow.)
template <>
struct Dot<Q6_K> {
  static constexpr bool kHas = true;
  static constexpr int kSpan = 1;
  template <int M>
  static void rows(const uint8_t* b, int, const Q16Rows& x, int64_t i, __m256* acc) {
    const __m256 d = _mm256_set1_ps(f16(b + 208));
    const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
    const __m256 sc_lo = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8)));  // groups 0-7
    const __m256 sc_hi = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc8, 8))));
    const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x03), off = _mm256_set1_epi8(32);
    __m256i w[16];
    for (int n = 0; n < 2; ++n) {  // 128 weights: ql[64] (low 4 bits), qh[32] (high 2 bits) -> 4 sub-blocks of 32
      const __m256i a = load32(b + 64 * n), c = load32(b + 64 * n + 32), h = load32(b + 128 + 32 * n);
      __m256i g[4];
      g[0] = _mm256_and_si256(a, low);
      g[1] = _mm256_and_si256(c, low);
      g[2] = _mm256_and_si256(_mm256_srli_epi16(a, 4), low);
      g[3] = _mm256_and_si256(_mm256_srli_epi16(c, 4), low);
      for (int k = 0; k < 4; ++k) {
        g[k] = _mm256_or_si256(g[k], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * k), two), 4));
        widen(_mm256_sub_epi8(g[k], off), w + 8 * n + 2 * k);
      }
    }
    const __m256i first = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), last = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
    for (int r = 0; r < M; ++r) {
      const int16_t* qx = x.q + r * x.K + i * 256;
      __m256i g[16];  // group k: weights 16 k .. 16 k + 15
      for (int k = 0; k < 16; ++k) g[k] = _mm256_madd_epi16(w[k], load32(qx + 16 * k));
      const __m256 dx = _mm256_loadu_ps(x.d + r * x.K / 32 + 8 * i);  // a block's dx for both its groups
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(sc_lo, _mm256_permutevar8x32_ps(dx, first)), reduce8(g), acc[r]);
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(sc_hi, _mm256_permutevar8x32_ps(dx, last)), reduce8(g + 8), acc[r]);
    }
  }
};

// y[m][o - o0] = sum_k dequant(q16(x))[m][k] * W[o][k] for M rows, outputs [o0, o1): each block unpacked once
template <typename T, int M>
void dot_rows_t(const Q16Rows& x, const uint8_t* w, int64_t row_bytes, float* y, int64_t ldy, int64_t o0, int64_t o1) {
  // one or two rows: spans alternate between A sets of accumulators (one chain of adds would wait on latency)
  constexpr int A = M < 3 ? 2 : 1, S = Dot<T>::kSpan;
  const int64_t n = x.K / T::kN;  // blocks a row
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* row = w + o * row_bytes;
    __m256 acc[A][M];
    for (int a = 0; a < A; ++a)
      for (int r = 0; r < M; ++r) acc[a][r] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + A * S <= n; i += A * S) {
      for (int64_t l = 0; l < A * S * T::kBytes; l += 64) __builtin_prefetch(row + (i + 2 * A * S) * T::kBytes + l);
      for (int a = 0; a < A; ++a) Dot<T>::template rows<M>(row + (i + a * S) * T::kBytes, S, x, i + a * S, acc[a]);
    }
    for (; i < n; i += S)
      Dot<T>::template rows<M>(row + i * T::kBytes, static_cast<int>(std::min<int64_t>(S, n - i)), x, i, acc[0]);
    for (int r = 0; r < M; ++r) {
      for (int a = 1; a < A; ++a) acc[0][r] = _mm256_add_ps(acc[0][r], acc[a][r]);
      y[r * ldy + o - o0] = hsum(acc[0][r]);
    }
  }
}

template <typename T>
void dot_rows(int m, const Q16Rows& x, const uint8_t* w, int64_t row_bytes, float* y, int64_t ldy, int64_t o0, int64_t o1) {
#define PAGODA_DOT_ROWS(M) \
  case M: dot_rows_t<T, M>(x, w, row_bytes, y, ldy, o0, o1); break;
  switch (m) {
    PAGODA_DOT_ROWS(1) PAGODA_DOT_ROWS(2) PAGODA_DOT_ROWS(3) PAGODA_DOT_ROWS(4)
    PAGODA_DOT_ROWS(5) PAGODA_DOT_ROWS(6) PAGODA_DOT_ROWS(7) PAGODA_DOT_ROWS(8)
  }
#undef PAGODA_DOT_ROWS
}

}  // namespace pagoda::gguf
