// Math for pagoda's CPU ops.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace pagoda {

// exp(x) in plain arithmetic, so that loops calling it vectorize (std::exp does not without
// -ffast-math): Cephes' range reduction and polynomial, about 1 ulp; x is clamped to [-80, 80]. The
// clamp becomes vector min/max on AVX2 only with -fno-trapping-math (setup.py and cpu_ops.py pass it):
// without it GCC 12 leaves every loop calling this scalar there (AVX-512's masks do not need it).
// Not [-87, 88], float's own range: a subnormal costs an Intel core a microcode assist per vector (AMD's
// do not). GCC evaluates a caller's expression for the clamped lanes too, and SiLU's g / (1 + e^88) is
// one (SiLU ran 4x slower); y * 2^-126 near the bottom can be one, and so are softmax weights of e^-87
// times small values (kEmin: softmax flushes weights below e^-80 to 0). SiLU beyond |g| = 80 is the
// same either way; a softmax weight below e^-80 is under a float's precision beside the row's max (1).
constexpr float kEmin = -80.0f;
inline float exp_approx(float x) {
  x = std::min(std::max(x, kEmin), 80.0f);
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  x -= n * 0.693359375f;
  x -= n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * x * x + x + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return y * two_n;
}

// float -> T as static_cast<T> rounds it; for bfloat16 c10's round-to-nearest-even (NaN -> 0x7fc0) in
// plain integer arithmetic, so that loops storing bfloat16 vectorize (c10's conversion does not).
template <typename T>
inline T round_to(float f) {
  return static_cast<T>(f);
}

template <>
inline c10::BFloat16 round_to<c10::BFloat16>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return c10::BFloat16(static_cast<uint16_t>(f != f ? 0x7fc0u : rounded), c10::BFloat16::from_bits());
}

}  // namespace pagoda
