// One vector register of floats for pagoda's CPU ops (GCC vector extensions over AVX-512 or AVX2,
// by the build's flags), and what the linear and LoRA ops do with it.
#pragma once

#include <c10/util/BFloat16.h>

#include <immintrin.h>

namespace pagoda {

#if defined(__AVX512F__)
constexpr int kW = 16;  // floats per vector register
constexpr int kRegs = 32;
#else
constexpr int kW = 8;
constexpr int kRegs = 16;
#endif
typedef float vec __attribute__((vector_size(kW * 4), aligned(4)));

inline vec load(const float* p) { return *reinterpret_cast<const vec*>(p); }
inline void store(float* p, vec v) { *reinterpret_cast<vec*>(p) = v; }

// every lane v (a broadcast: `vec{} + v` costs an add, which the compiler may not drop for v = -0.f)
inline vec splat(float v) {
#if defined(__AVX512F__)
  return (vec)_mm512_set1_ps(v);
#else
  return (vec)_mm256_set1_ps(v);
#endif
}

// bfloat16 widened to float32 (bf16 is the high half of a float's bits)
inline vec load(const c10::BFloat16* p) {
#if defined(__AVX512F__)
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return (vec)_mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
#else
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return (vec)_mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
#endif
}

// a * b + c rounded once, as the scalar tails' fmaf (ISO C++ builds do not contract a * b + c themselves)
inline vec fma(vec a, vec b, vec c) {
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(a, b, c);
#elif defined(__FMA__)
  return _mm256_fmadd_ps(a, b, c);
#else
  vec r;
  for (int l = 0; l < kW; ++l) r[l] = __builtin_fmaf(a[l], b[l], c[l]);
  return r;
#endif
}

}  // namespace pagoda
