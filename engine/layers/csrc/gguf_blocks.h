// GGUF block formats as llama.cpp stores them (ggml-quants.c's layouts), decoded in registers: Q8_0, Q4_0, Q4_1,
// Q5_0, Q5_1, IQ4_NL (32 weights a block), Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS (256 a super-block); and rows of
// blocks times a few rows of float32 activations. Shared by the linear layers over blocks (gguf_cpu.cpp) and the
// experts (moe_cpu.cpp).
#pragma once

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_vec.h"

namespace pagoda::gguf {

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);  // F16C: both builds have it (-mf16c)
}

// kW bytes of p widened to a vector of floats (u8: unsigned, i8: signed); nibbles and bit fields are cut
// from the bytes first, on the 128-bit register they are loaded into
#if defined(__AVX512F__)
inline __m128i bytes(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline vec u8(__m128i b) { return (vec)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }
inline vec i8(__m128i b) { return (vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)); }
#else
inline __m128i bytes(const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }
inline vec u8(__m128i b) { return (vec)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)); }
inline vec i8(__m128i b) { return (vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)); }
#endif
inline __m128i low4(__m128i b) { return _mm_and_si128(b, _mm_set1_epi8(0x0F)); }
inline __m128i high4(__m128i b) { return _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F)); }
// bits [s, s + n) of each byte, moved up to bit `to`
inline __m128i bits(__m128i b, int s, int n, int to) {
  return _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(b, s), _mm_set1_epi8((1 << n) - 1)), to);
}

// ggml's type ids (gguf.GGMLQuantizationType)
enum Type : int64_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
  kIQ4_NL = 20, kIQ4_XS = 23
};

struct Q8_0 {  // d (f16), qs[32] int8: w = d * q
  static constexpr int kN = 32, kBytes = 34;
  static void dequant(const uint8_t* b, float* y) {
    const vec d = splat(f16(b));
    for (int i = 0; i < 32; i += kW) store(y + i, d * i8(bytes(b + 2 + i)));
  }
};

struct Q4_0 {  // d (f16), qs[16]: weights j and j + 16 in the low and high nibble of qs[j], w = d * (q - 8)
  static constexpr int kN = 32, kBytes = 18;
  static void dequant(const uint8_t* b, float* y) {
    const float d = f16(b);
    const vec dv = splat(d), off = splat(-8.f * d);
    for (int j = 0; j < 16; j += kW) {
      const __m128i q = bytes(b + 2 + j);
      store(y + j, fma(dv, u8(low4(q)), off));
      store(y + j + 16, fma(dv, u8(high4(q)), off));
    }
  }
};

// 16 bytes' values (unsigned / signed) as 16 floats d * q + o at y: one AVX-512 register, two AVX2 ones
inline void put16(float* y, __m128i q, vec d, vec o) {
  store(y, fma(d, u8(q), o));
  if (kW == 8) store(y + 8, fma(d, u8(_mm_srli_si128(q, 8)), o));
}
inline void put16s(float* y, __m128i q, vec d) {
  store(y, d * i8(q));
  if (kW == 8) store(y + 8, d * i8(_mm_srli_si128(q, 8)));
}

struct Q4_1 {  // d, m (f16), qs[16]: w = d * q + m
  static constexpr int kN = 32, kBytes = 20;
  static void dequant(const uint8_t* b, float* y) {
    const vec d = splat(f16(b)), m = splat(f16(b + 2));
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
    put16(y, low4(q), d, m);
    put16(y + 16, high4(q), d, m);
  }
};

// the 5-bit quants of a Q5_0 / Q5_1 block, qh's 32 bits (one per weight) above qs's nibbles: weights 0-15
// in *lo, 16-31 in *hi. Bit j of qh to byte j: each byte gets qh's byte j / 8, then tests its bit j % 8.
inline void q5(const uint8_t* qh_bytes, const uint8_t* qs, __m128i* lo, __m128i* hi) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  const __m128i h = _mm_set1_epi32(static_cast<int>(qh));
  const __m128i bit = _mm_set1_epi64x(0x8040201008040201LL);
  const __m128i h0 = _mm_shuffle_epi8(h, _mm_set_epi64x(0x0101010101010101LL, 0));
  const __m128i h1 = _mm_shuffle_epi8(h, _mm_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL));
  const __m128i five = _mm_set1_epi8(0x10);
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  *lo = _mm_or_si128(low4(q), _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(h0, bit), bit), five));
  *hi = _mm_or_si128(high4(q), _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(h1, bit), bit), five));
}

struct Q5_0 {  // d (f16), qh[4], qs[16]: w = d * (q - 16)
  static constexpr int kN = 32, kBytes = 22;
  static void dequant(const uint8_t* b, float* y) {
    const float d = f16(b);
    const vec dv = splat(d), off = splat(-16.f * d);
    __m128i lo, hi;
    q5(b + 2, b + 6, &lo, &hi);
    put16(y, lo, dv, off);
    put16(y + 16, hi, dv, off);
  }
};

struct Q5_1 {  // d, m (f16), qh[4], qs[16]: w = d * q + m
  static constexpr int kN = 32, kBytes = 24;
  static void dequant(const uint8_t* b, float* y) {
    const vec d = splat(f16(b)), m = splat(f16(b + 2));
    __m128i lo, hi;
    q5(b + 4, b + 8, &lo, &hi);
    put16(y, lo, d, m);
    put16(y + 16, hi, d, m);
  }
};

// IQ4_NL's and IQ4_XS's non-uniform grid of 16 values (kvalues_iq4nl), looked up by a byte shuffle
inline __m128i iq4_grid() {
  return _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
}

struct IQ4_NL {  // d (f16), qs[16]: w = d * grid[nibble]
  static constexpr int kN = 32, kBytes = 18;
  static void dequant(const uint8_t* b, float* y) {
    const __m128i grid = iq4_grid();
    const vec d = splat(f16(b));
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
    put16s(y, _mm_shuffle_epi8(grid, low4(q)), d);
    put16s(y + 16, _mm_shuffle_epi8(grid, high4(q)), d);
  }
};

// the 6-bit scale and min of sub-block j of a Q4_K / Q5_K super-block (12 bytes for 8 pairs)
inline void scale_min(int j, const uint8_t* q, float* sc, float* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

struct Q4_K {  // d, dmin (f16), scales[12], qs[128]: 8 sub-blocks of 32, w = d * sc * q - dmin * m
  static constexpr int kN = 256, kBytes = 144;
  static void dequant(const uint8_t* b, float* y) {
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* q = b + 16;
    for (int j = 0; j < 8; j += 2, q += 32, y += 64) {
      float s1, m1, s2, m2;
      scale_min(j, scales, &s1, &m1);
      scale_min(j + 1, scales, &s2, &m2);
      const vec d1 = splat(d * s1), o1 = splat(-dmin * m1), d2 = splat(d * s2), o2 = splat(-dmin * m2);
      for (int l = 0; l < 32; l += kW) {
        const __m128i v = bytes(q + l);
        store(y + l, fma(d1, u8(low4(v)), o1));
        store(y + l + 32, fma(d2, u8(high4(v)), o2));
      }
    }
  }
};

struct Q5_K {  // d, dmin (f16), scales[12], qh[32] (the 5th bits), qs[128]
  static constexpr int kN = 256, kBytes = 176;
  static void dequant(const uint8_t* b, float* y) {
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* qh = b + 16;
    const uint8_t* q = b + 48;
    for (int j = 0; j < 8; j += 2, q += 32, y += 64) {
      float s1, m1, s2, m2;
      scale_min(j, scales, &s1, &m1);
      scale_min(j + 1, scales, &s2, &m2);
      const vec d1 = splat(d * s1), o1 = splat(-dmin * m1), d2 = splat(d * s2), o2 = splat(-dmin * m2);
      for (int l = 0; l < 32; l += kW) {
        const __m128i v = bytes(q + l), h = bytes(qh + l);
        store(y + l, fma(d1, u8(_mm_or_si128(low4(v), bits(h, j, 1, 4))), o1));
        store(y + l + 32, fma(d2, u8(_mm_or_si128(high4(v), bits(h, j + 1, 1, 4))), o2));
      }
    }
  }
};

struct Q6_K {  // ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] int8, d (f16): w = d * sc * (q - 32)
  static constexpr int kN = 256, kBytes = 210;
  static void dequant(const uint8_t* b, float* y) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = f16(b + 208);
    for (int n = 0; n < 2; ++n, ql += 64, qh += 32, sc += 8, y += 128) {
      for (int l = 0; l < 32; l += kW) {
        const int is = l / 16;  // 16 weights of each of the 4 groups below share a scale
        const float s0 = d * sc[is], s1 = d * sc[is + 2], s2 = d * sc[is + 4], s3 = d * sc[is + 6];
        const __m128i a = bytes(ql + l), c = bytes(ql + l + 32), h = bytes(qh + l);
        store(y + l, fma(splat(s0), u8(_mm_or_si128(low4(a), bits(h, 0, 2, 4))), splat(-32.f * s0)));
        store(y + l + 32, fma(splat(s1), u8(_mm_or_si128(low4(c), bits(h, 2, 2, 4))), splat(-32.f * s1)));
        store(y + l + 64, fma(splat(s2), u8(_mm_or_si128(high4(a), bits(h, 4, 2, 4))), splat(-32.f * s2)));
        store(y + l + 96, fma(splat(s3), u8(_mm_or_si128(high4(c), bits(h, 6, 2, 4))), splat(-32.f * s3)));
      }
    }
  }
};

// d (f16), scales_h (u16), scales_l[4], qs[128]: 8 sub-blocks of 32 laid out as IQ4_NL's, w = d * (sc - 32) *
// grid[nibble], sub-block j's 6-bit sc from nibble j of scales_l and bits 2j, 2j + 1 of scales_h
struct IQ4_XS {
  static constexpr int kN = 256, kBytes = 136;
  static void dequant(const uint8_t* b, float* y) {
    const __m128i grid = iq4_grid();
    const float d = f16(b);
    uint16_t sh;
    std::memcpy(&sh, b + 2, 2);
    const uint8_t* q = b + 8;
    for (int j = 0; j < 8; ++j, q += 16, y += 32) {
      const int sc = (((b[4 + j / 2] >> 4 * (j % 2)) & 0xF) | (((sh >> 2 * j) & 3) << 4)) - 32;
      const vec dl = splat(d * static_cast<float>(sc));
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
      put16s(y, _mm_shuffle_epi8(grid, low4(v)), dl);
      put16s(y + 16, _mm_shuffle_epi8(grid, high4(v)), dl);
    }
  }
};

// a Q2_K / Q3_K super-block's weights 32 * i + l (i < 4) of each half of 128: bits 2i, 2i + 1 of byte l of that
// half's 32 quant bytes (Q3_K's third bit: bit 4 * half + i of hmask's byte l); 16 a group share a scale, group
// 8 * half + 2 * i + l / 16

struct Q2_K {  // scales[16] (a 4-bit scale, a 4-bit min a group), qs[64], d, dmin (f16): w = d * sc * q - dmin * m
  static constexpr int kN = 256, kBytes = 84;
  static void dequant(const uint8_t* b, float* y) {
    alignas(64) float sc[16], mn[16];
    const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
    put16s(sc, low4(s), splat(f16(b + 80)));
    put16s(mn, high4(s), splat(-f16(b + 82)));
    const uint8_t* q = b + 16;
    for (int h = 0; h < 2; ++h, q += 32, y += 128)
      for (int l = 0; l < 32; l += kW) {
        const __m128i v = bytes(q + l);
        for (int i = 0; i < 4; ++i) {
          const int g = 8 * h + 2 * i + l / 16;
          store(y + 32 * i + l, fma(splat(sc[g]), u8(bits(v, 2 * i, 2, 0)), splat(mn[g])));
        }
      }
  }
};

// a Q3_K super-block's 16 6-bit scales (low 4 bits: bytes 0-7's low then high nibbles; high 2 bits: bytes 8-11,
// bits 2k, 2k + 1 of byte j % 4 for scale j, k = j / 4), less 32, times d
inline void q3_scales(const uint8_t* s, float d, float* out) {
  uint32_t h;
  std::memcpy(&h, s + 8, 4);
  const __m128i a = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s));
  const __m128i hi = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(static_cast<int>(h)), _mm_setr_epi32(0, 2, 4, 6)),
                                   _mm_set1_epi8(3));
  const __m128i sc = _mm_or_si128(_mm_unpacklo_epi64(low4(a), high4(a)), _mm_slli_epi16(hi, 4));
  put16s(out, _mm_sub_epi8(sc, _mm_set1_epi8(32)), splat(d));
}

struct Q3_K {  // hmask[32] (3rd bits), qs[64] (low 2 bits), scales[12], d (f16): w = d * sc * (q - 4), q < 8
  static constexpr int kN = 256, kBytes = 110;
  static void dequant(const uint8_t* b, float* y) {
    alignas(64) float sc[16];
    q3_scales(b + 96, f16(b + 108), sc);
    const uint8_t* q = b + 32;
    const __m128i four = _mm_set1_epi8(4);
    for (int h = 0; h < 2; ++h, q += 32, y += 128)
      for (int l = 0; l < 32; l += kW) {
        const __m128i v = bytes(q + l), m = bytes(b + l);  // hmask: bit 4 * half + s of byte l
        for (int i = 0; i < 4; ++i) {
          const __m128i w = _mm_sub_epi8(_mm_or_si128(bits(v, 2 * i, 2, 0), bits(m, 4 * h + i, 1, 2)), four);
          store(y + 32 * i + l, splat(sc[8 * h + 2 * i + l / 16]) * i8(w));
        }
      }
  }
};

constexpr int kMaxRows = 8;  // rows whose accumulators share a dequantized block
constexpr int kSpan = 256;  // weights dequantized into L1 at a time (8 blocks of 32, or a super-block)

// y[m][o - o0] = sum_k x[m][k] * W[o][k] for M rows (x: [M, K]) and outputs [o0, o1), y's rows ldy apart, W's rows
// `row_bytes` of blocks each: a
// span of a row's blocks dequantized once into L1, then every row's fused multiply-adds over it (M rows'
// accumulators in registers)
template <typename T, int M>
void rows_t(const float* x, int64_t K, const uint8_t* w, int64_t row_bytes, float* y, int64_t ldy, int64_t o0,
            int64_t o1) {
  constexpr int kBlocks = kSpan / T::kN;
  // independent accumulators a row: with one or two rows a single chain of fused multiply-adds would wait on
  // its latency; A vectors are 32 weights, so every block count divides
  constexpr int A = M < 3 ? 32 / kW : 1;
  alignas(64) float buf[kSpan];
  const int64_t spans = K / kSpan, rest = K % kSpan / T::kN;  // whole spans, then the blocks left
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* row = w + o * row_bytes;
    vec acc[M][A];
    for (int m = 0; m < M; ++m)
      for (int a = 0; a < A; ++a) acc[m][a] = vec{} + 0.f;
    for (int64_t s = 0; s <= spans; ++s) {
      const int n = s < spans ? kBlocks : static_cast<int>(rest);
      const uint8_t* b = row + s * kBlocks * T::kBytes;
      __builtin_prefetch(b + 2 * kBlocks * T::kBytes);
      for (int i = 0; i < n; ++i) T::dequant(b + i * T::kBytes, buf + i * T::kN);
      const float* xs = x + s * kSpan;
      for (int i = 0; i < n * T::kN; i += A * kW)
        for (int a = 0; a < A; ++a) {
          const vec wv = load(buf + i + a * kW);
          for (int m = 0; m < M; ++m) acc[m][a] = fma(wv, load(xs + m * K + i + a * kW), acc[m][a]);
        }
    }
    for (int m = 0; m < M; ++m) {
      for (int a = 1; a < A; ++a) acc[m][0] += acc[m][a];
      float sum = 0.f;
      for (int l = 0; l < kW; ++l) sum += acc[m][0][l];
      y[m * ldy + o - o0] = sum;
    }
  }
}

template <typename T>
void rows(int m, const float* x, int64_t K, const uint8_t* w, int64_t row_bytes, float* y, int64_t ldy, int64_t o0,
          int64_t o1) {
#define PAGODA_ROWS(M) \
  case M: rows_t<T, M>(x, K, w, row_bytes, y, ldy, o0, o1); break;
  switch (m) {
    PAGODA_ROWS(1) PAGODA_ROWS(2) PAGODA_ROWS(3) PAGODA_ROWS(4)
    PAGODA_ROWS(5) PAGODA_ROWS(6) PAGODA_ROWS(7) PAGODA_ROWS(8)
  }
#undef PAGODA_ROWS
}

template <typename T>
void dequant_t(const uint8_t* w, int64_t row_bytes, int64_t K, float* out, int64_t o0, int64_t o1) {
  for (int64_t o = o0; o < o1; ++o)
    for (int64_t b = 0; b < K / T::kN; ++b) T::dequant(w + o * row_bytes + b * T::kBytes, out + o * K + b * T::kN);
}

template <typename F>
void by_type(int64_t type, F&& f) {
  switch (type) {
    case kQ8_0: f(Q8_0{}); break;
    case kQ4_0: f(Q4_0{}); break;
    case kQ4_1: f(Q4_1{}); break;
    case kQ5_0: f(Q5_0{}); break;
    case kQ5_1: f(Q5_1{}); break;
    case kIQ4_NL: f(IQ4_NL{}); break;
    case kQ4_K: f(Q4_K{}); break;
    case kQ5_K: f(Q5_K{}); break;
    case kQ6_K: f(Q6_K{}); break;
    case kQ2_K: f(Q2_K{}); break;
    case kQ3_K: f(Q3_K{}); break;
    case kIQ4_XS: f(IQ4_XS{}); break;
    default: TORCH_CHECK(false, "GGUF type ", type, " has no CPU kernel (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q4_K, Q5_K, Q6_K, "
                         "Q2_K, Q3_K, IQ4_XS have)");
  }
}

}  // namespace pagoda::gguf
