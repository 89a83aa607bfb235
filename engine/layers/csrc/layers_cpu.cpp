// Fused element-wise layers for the CPU: each is one pass over its rows where torch would run
// five to ten ops, each allocating and reading its input again. Rounding follows transformers'
// modules: math in float32, results rounded to the tensor's dtype where they round theirs (round_to:
// the same rounding as a cast, in arithmetic that vectorizes for bfloat16).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "cpu_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

using pagoda::round_to;

// rows per thread: at least ~32k elements, below which a parallel region costs more than it saves
inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_elems)); }

// out = weight * (x / sqrt(mean(x^2) + eps)) per row; with residual (add_rms_norm), first
// residual = x + residual in place, and that sum is normalized.
template <typename T>
void rms_norm_rows(T* out, const T* x, T* residual, const T* w, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, grain(dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * dim;
      if (residual != nullptr) {
        T* rr = residual + r * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) rr[i] = round_to<T>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
        xr = rr;
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < dim; ++i) ss += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
      const float inv = 1.f / std::sqrt(ss / dim + eps);
      T* o = out + r * dim;
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i)
        o[i] = round_to<T>(static_cast<float>(w[i]) * static_cast<float>(round_to<T>(static_cast<float>(xr[i]) * inv)));
    }
  });
}

// x: [..., dim] -> weight * (x / sqrt(mean(x^2) + eps)), as LlamaRMSNorm
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps) {
  const at::Tensor x = x_in.contiguous();
  const int64_t dim = x.size(-1), rows = x.numel() / std::max<int64_t>(dim, 1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == dim && weight.is_contiguous(), "weight must be [dim]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight must be in x's dtype");
  at::Tensor out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), nullptr, weight.data_ptr<scalar_t>(),
                            rows, dim, static_cast<float>(eps));
  });
  return out;
}

// residual += x (in place), then -> rms_norm(residual): a decoder layer's residual add and the
// next norm in one pass, as transformers' `hidden = residual + hidden; norm(hidden)`
at::Tensor add_rms_norm_(const at::Tensor& x_in, at::Tensor& residual, const at::Tensor& weight, double eps) {
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "residual must be contiguous, with x's shape and dtype");
  const int64_t dim = x.size(-1), rows = x.numel() / std::max<int64_t>(dim, 1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == dim && weight.is_contiguous(), "weight must be [dim]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight must be in x's dtype");
  at::Tensor out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm_", [&] {
    rms_norm_rows<scalar_t>(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(),
                            weight.data_ptr<scalar_t>(), rows, dim, static_cast<float>(eps));
  });
  return out;
}

template <typename T>
void silu_and_mul_rows(T* out, const T* x, int64_t rows, int64_t d) {
  at::parallel_for(0, rows, grain(2 * d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T *gate = x + r * 2 * d, *up = gate + d;
      T* o = out + r * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) {
        const float g = static_cast<float>(gate[i]);
        const T act = round_to<T>(g / (1.f + pagoda::exp_approx(-g)));
        o[i] = round_to<T>(static_cast<float>(act) * static_cast<float>(up[i]));
      }
    }
  });
}

// x: [rows, 2 * d] (gate | up) -> silu(gate) * up: [rows, d], as LlamaMLP's act_fn(gate) * up
at::Tensor silu_and_mul(const at::Tensor& x_in) {
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.size(-1) % 2 == 0, "the last dimension must hold gate and up halves");
  const int64_t d = x.size(-1) / 2, rows = x.numel() / std::max<int64_t>(2 * d, 1);
  auto sizes = x.sizes().vec();
  sizes.back() = d;
  at::Tensor out = at::empty(sizes, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_rows<scalar_t>(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), rows, d);
  });
  return out;
}

// In place, neox style (first half of each head rotated with the second half):
// x: [num_tokens, num_heads, head_dim] (last dim contiguous), for q and then k;
// cos, sin: [max_position, head_dim] tables (float32, or x's dtype); positions: [num_tokens] int64.
template <typename T, typename C>
void rotary_rows(T* xp, const C* cp, const C* sp, const int64_t* pos, int64_t tokens, int64_t heads, int64_t dim,
                 int64_t tok_stride, int64_t head_stride) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, grain(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const C *c = cp + pos[t] * dim, *s = sp + pos[t] * dim;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = xp + t * tok_stride + h * head_stride;
        for (int64_t i = 0; i < half; ++i) {
          // transformers: x * cos + rotate_half(x) * sin, the tables and each product rounded to x's dtype
          const float x1 = static_cast<float>(v[i]), x2 = static_cast<float>(v[i + half]);
          const T c1 = round_to<T>(static_cast<float>(c[i])), s1 = round_to<T>(static_cast<float>(s[i]));
          const T c2 = round_to<T>(static_cast<float>(c[i + half])), s2 = round_to<T>(static_cast<float>(s[i + half]));
          const T a1 = round_to<T>(x1 * static_cast<float>(c1));
          const T b1 = round_to<T>(-x2 * static_cast<float>(s1));
          const T a2 = round_to<T>(x2 * static_cast<float>(c2));
          const T b2 = round_to<T>(x1 * static_cast<float>(s2));
          v[i] = round_to<T>(static_cast<float>(a1) + static_cast<float>(b1));
          v[i + half] = round_to<T>(static_cast<float>(a2) + static_cast<float>(b2));
        }
      }
    }
  });
}

void rotary_one(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "q and k must be [num_tokens, num_heads, head_dim]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat || cos.scalar_type() == x.scalar_type(),
              "cos and sin must be float32 or in q's dtype");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_pos = cos.size(0);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position ", pos[t], " is outside the rotary table");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary", [&] {
    if (cos.scalar_type() == at::kFloat)
      rotary_rows(x.data_ptr<scalar_t>(), cos.data_ptr<float>(), sin.data_ptr<float>(), pos, tokens, heads, dim,
                  x.stride(0), x.stride(1));
    else
      rotary_rows(x.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), pos, tokens, heads, dim,
                  x.stride(0), x.stride(1));
  });
}

void rotary_(at::Tensor& q, at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos,
             const at::Tensor& sin) {
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.dim() == 1,
              "positions must be a contiguous int64 vector");
  TORCH_CHECK(cos.scalar_type() == sin.scalar_type() && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.sizes() == sin.sizes() && cos.dim() == 2,
              "cos and sin must be contiguous [max_position, head_dim] tables of one dtype");
  TORCH_CHECK(q.size(0) == positions.size(0) && k.size(0) == positions.size(0), "a position per token");
  TORCH_CHECK(q.size(2) == cos.size(1) && k.size(2) == cos.size(1) && cos.size(1) % 2 == 0,
              "head_dim must match the tables and be even");
  rotary_one(q, positions, cos, sin);
  rotary_one(k, positions, cos, sin);
}


// x: [rows, n] float32 -> [rows] int64, each row's first maximum, as torch.argmax (a NaN counts as
// the maximum). On 64 x 4096 logits torch's argmax takes ~7x as long, max(dim).indices ~2.5x.
at::Tensor argmax(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.size(1) > 0,
              "x must be a non-empty float32 matrix");
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * n;
      // 64 lanes (4 independent chains of 16), each with its first maximum: a max-with-index
      // loop does not vectorize. v - v is NaN for NaN and inf; rows with a NaN take a scalar scan.
      constexpr int64_t L = 64;
      float best[L], probe[L] = {};
      int32_t at[L];
      for (int64_t l = 0; l < L; ++l) best[l] = xr[0], at[l] = 0;
      int64_t j = 0;
      for (; j + L <= n; j += L)
#pragma omp simd
        for (int64_t l = 0; l < L; ++l) {
          const float v = xr[j + l];
          const bool more = v > best[l];
          best[l] = more ? v : best[l];
          at[l] = more ? static_cast<int32_t>(j + l) : at[l];
          probe[l] += v - v;
        }
      for (; j < n; ++j) {
        if (xr[j] > best[0]) best[0] = xr[j], at[0] = static_cast<int32_t>(j);
        probe[0] += xr[j] - xr[j];
      }
      float mx = best[0];
      int64_t i = at[0];
      for (int64_t l = 1; l < L; ++l)
        if (best[l] > mx || (best[l] == mx && at[l] < i)) mx = best[l], i = at[l];
      if (std::any_of(probe, probe + L, [](float p) { return p != 0.f; })) {
        const int64_t nan = std::find_if(xr, xr + n, [](float v) { return std::isnan(v); }) - xr;
        i = nan < n ? nan : i;
      }
      op[r] = i;
    }
  });
  return out;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def("argmax(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_", &rotary_);
  m.impl("argmax", &argmax);
}
