// Math for pagoda's CPU ops.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace pagoda {

// exp(x) in plain arithmetic, so that loops calling it vectorize (std::exp does not without
// -ffast-math): Cephes' range reduction and polynomial, about 1 ulp; x is clamped to [-87, 88]. The
// clamp becomes vector min/max on AVX2 only with -fno-trapping-math (setup.py and cpu_ops.py pass it):
// without it GCC 12 leaves every loop calling this scalar there (AVX-512's masks do not need it).
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
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

}  // namespace pagoda
