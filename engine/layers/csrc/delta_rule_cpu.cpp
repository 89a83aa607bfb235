// The causal conv1d and the gated delta rule of linear-attention layers (Qwen3.5, Qwen3-Next) for the CPU,
// over a step's flat batch of sequences, each reading and updating its state slot in place. The torch reference
// is engine/layers/delta_rule.py: the same math in float32, in another summation order (within ~1e-5).
// Loops run along a row's contiguous dimension (channels, head_v_dim), which the compiler vectorizes for the
// build's ISA (AVX-512 or AVX2); threads split channel blocks (conv) or (sequence, value head) pairs (delta rule).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_math.h"

namespace {

using pagoda::exp_approx;
using pagoda::round_to;
constexpr int64_t kMaxKernel = 8;
constexpr int64_t kCB = 64;     // channels (conv) or state columns (delta rule) per block: a block of state in L1
constexpr int64_t kChunk = 64;  // the chunked form's chunk, as delta_rule.CHUNK

// ---------------------------------------------------------------------------------------------------------
// causal conv1d + SiLU
// ---------------------------------------------------------------------------------------------------------

// channels [c0, c0 + nc) of every sequence: each token's K taps over the window of the K - 1 inputs before it
// (the slot's state before the sequence's first token), then the window written back to the slot
template <typename T>
void conv_block(const T* x, int64_t ldx, const T* w, T* state, T* out, int64_t C, int64_t K, const int64_t* starts,
                const int64_t* slots, int64_t num_seqs, int64_t c0, int64_t nc) {
  float wt[kMaxKernel][kCB], win[kMaxKernel][kCB], acc[kCB];
  for (int64_t j = 0; j < K; ++j)
    for (int64_t c = 0; c < nc; ++c) wt[j][c] = static_cast<float>(w[(c0 + c) * K + j]);
  for (int64_t s = 0; s < num_seqs; ++s) {
    T* st = state + slots[s] * C * (K - 1) + c0 * (K - 1);  // [nc, K - 1]
    for (int64_t j = 0; j < K - 1; ++j)
      for (int64_t c = 0; c < nc; ++c) win[j][c] = static_cast<float>(st[c * (K - 1) + j]);
    for (int64_t t = starts[s]; t < starts[s + 1]; ++t) {
      const T* xt = x + t * ldx + c0;
#pragma omp simd
      for (int64_t c = 0; c < nc; ++c) acc[c] = 0.f;
      for (int64_t j = 0; j < K - 1; ++j) {
#pragma omp simd
        for (int64_t c = 0; c < nc; ++c) acc[c] += wt[j][c] * win[j][c];
      }
      for (int64_t j = 0; j + 2 < K; ++j) std::copy(win[j + 1], win[j + 1] + nc, win[j]);
      T* ot = out + t * C + c0;
#pragma omp simd
      for (int64_t c = 0; c < nc; ++c) {
        const float xv = static_cast<float>(xt[c]);
        if (K > 1) win[K - 2][c] = xv;
        const float y = static_cast<float>(round_to<T>(acc[c] + wt[K - 1][c] * xv));
        ot[c] = round_to<T>(y / (1.f + exp_approx(-y)));
      }
    }
    for (int64_t j = 0; j < K - 1; ++j)
      for (int64_t c = 0; c < nc; ++c) st[c * (K - 1) + j] = round_to<T>(win[j][c]);
  }
}

std::vector<int64_t> as_longs(const at::Tensor& t) {
  const at::Tensor l = t.to(at::kLong).contiguous();
  return std::vector<int64_t>(l.data_ptr<int64_t>(), l.data_ptr<int64_t>() + l.numel());
}

void check_batch(const std::vector<int64_t>& starts, const std::vector<int64_t>& slots, int64_t num_tokens,
                 int64_t num_slots) {
  TORCH_CHECK(starts.size() == slots.size() + 1 && starts.front() == 0 && starts.back() <= num_tokens,
              "query_start_loc must be [num_seqs + 1] from 0, state_slots [num_seqs]");
  for (size_t s = 0; s < slots.size(); ++s) {
    TORCH_CHECK(starts[s] <= starts[s + 1], "query_start_loc must not decrease");
    TORCH_CHECK(slots[s] >= 0 && slots[s] < num_slots, "state slot ", slots[s], " out of range");
  }
}

// x: [num_tokens, C] (rows may be strided); weight: [C, K]; conv_state: [num_slots, C, K - 1] in x's dtype,
// updated in place; query_start_loc: [num_seqs + 1]; state_slots: [num_seqs] -> [num_tokens, C]
at::Tensor causal_conv1d_(const at::Tensor& x_in, const at::Tensor& weight_in, at::Tensor& conv_state,
                          const at::Tensor& query_start_loc, const at::Tensor& state_slots) {
  const auto dtype = x_in.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(x_in.dim() == 2 && weight_in.dim() == 2 && conv_state.dim() == 3, "x must be [n, C], weight [C, K]");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const at::Tensor weight = weight_in.contiguous();
  const int64_t n = x.size(0), C = x.size(1), K = weight.size(1);
  TORCH_CHECK(weight.size(0) == C && K >= 1 && K <= kMaxKernel, "weight must be [C, K], K <= ", kMaxKernel);
  TORCH_CHECK(weight.scalar_type() == dtype && conv_state.scalar_type() == dtype, "weight and state in x's dtype");
  TORCH_CHECK(conv_state.is_contiguous() && conv_state.size(1) == C && conv_state.size(2) == K - 1,
              "conv_state must be contiguous [num_slots, C, K - 1]");
  const auto starts = as_longs(query_start_loc), slots = as_longs(state_slots);
  check_batch(starts, slots, n, conv_state.size(0));
  at::Tensor out = at::empty({n, C}, x.options());
  const int64_t blocks = (C + kCB - 1) / kCB;
  auto run = [&](auto* xp, auto* wp, auto* sp, auto* op) {
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        conv_block(xp, x.stride(0), wp, sp, op, C, K, starts.data(), slots.data(), (int64_t)slots.size(), b * kCB,
                   std::min(kCB, C - b * kCB));
    });
  };
  if (dtype == at::kFloat)
    run(x.data_ptr<float>(), weight.data_ptr<float>(), conv_state.data_ptr<float>(), out.data_ptr<float>());
  else
    run(x.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(), conv_state.data_ptr<c10::BFloat16>(),
        out.data_ptr<c10::BFloat16>());
  return out;
}

// ---------------------------------------------------------------------------------------------------------
// gated delta rule
// ---------------------------------------------------------------------------------------------------------

template <typename T>
struct Rule {
  const T *q, *k, *v;
  int64_t sq0, sq1, sk0, sk1, sv0, sv1;  // token and head strides (the last dimension contiguous)
  const float *g, *beta;                 // [num_tokens, Hv]
  float* state;                          // [num_slots, Hv, Dk, Dv]
  T* out;                                // [num_tokens, Hv, Dv]
  int64_t Hv, rep, Dk, Dv;
  float scale;
};

// out[0, n) = x / sqrt(sum x^2 + 1e-6) * mul, as delta_rule.l2norm (then the scale)
template <typename T>
void l2norm(const T* x, int64_t n, float mul, float* out) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  const float r = 1.f / std::sqrt(ss + 1e-6f);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(x[i]) * r * mul;
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// one token of head h: S = S e^g; delta = (v - k S) beta; S += k delta; out = q S, by blocks of state columns
// (the block's second pass reads it from L1: the state is read from memory and written once)
template <typename T>
void recurrent_step(const Rule<T>& r, int64_t t, int64_t h, float* S, float* qn, float* kn) {
  const int64_t Dk = r.Dk, Dv = r.Dv, hk = h / r.rep;
  l2norm(r.q + t * r.sq0 + hk * r.sq1, Dk, r.scale, qn);
  l2norm(r.k + t * r.sk0 + hk * r.sk1, Dk, 1.f, kn);
  const T* v = r.v + t * r.sv0 + h * r.sv1;
  T* out = r.out + (t * r.Hv + h) * Dv;
  const float e = std::exp(r.g[t * r.Hv + h]), beta = r.beta[t * r.Hv + h];
  float ks[kCB], o[kCB];
  for (int64_t c0 = 0; c0 < Dv; c0 += kCB) {
    const int64_t nc = std::min(kCB, Dv - c0);
    std::fill(ks, ks + nc, 0.f);
    std::fill(o, o + nc, 0.f);
    for (int64_t i = 0; i < Dk; ++i) {
      float* Si = S + i * Dv + c0;
#pragma omp simd
      for (int64_t c = 0; c < nc; ++c) {
        Si[c] *= e;
        ks[c] += Si[c] * kn[i];
      }
    }
#pragma omp simd
    for (int64_t c = 0; c < nc; ++c) ks[c] = (static_cast<float>(v[c0 + c]) - ks[c]) * beta;  // delta
    for (int64_t i = 0; i < Dk; ++i) {
      float* Si = S + i * Dv + c0;
#pragma omp simd
      for (int64_t c = 0; c < nc; ++c) {
        Si[c] += kn[i] * ks[c];
        o[c] += Si[c] * qn[i];
      }
    }
    for (int64_t c = 0; c < nc; ++c) out[c0 + c] = round_to<T>(o[c]);
  }
}

// per (sequence, head) scratch of the chunked form
struct Scratch {
  std::vector<float> q, k, w, u, o, a, p, d, b;
  Scratch(int64_t Dk, int64_t Dv)
      : q(kChunk * Dk), k(kChunk * Dk), w(kChunk * Dk), u(kChunk * kCB), o(kChunk * kCB), a(kChunk * kChunk),
        p(kChunk * kChunk), d(kChunk), b(kChunk) {}
};

// rows [0, L) of x -= lower-triangular a (strictly below the diagonal) solved forward: (I + A) X = X
inline void solve_unit_lower(const float* a, float* x, int64_t L, int64_t n, int64_t ld) {
  for (int64_t i = 1; i < L; ++i)
    for (int64_t j = 0; j < i; ++j) {
      const float aij = a[i * kChunk + j];
      const float* xj = x + j * ld;
      float* xi = x + i * ld;
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) xi[c] -= aij * xj[c];
    }
}

// tokens [t0, t0 + L) of head h, L <= kChunk, from state S to the next (delta_rule._chunked's loop body):
//   A = strict_lower(beta_i k_i.k_j e^(d_i - d_j)), P = lower(q_i.k_j e^(d_i - d_j)), d the cumulative log decay
//   W = (I + A)^-1 (beta k e^d), U = (I + A)^-1 (beta v); V' = U - W S
//   out = (q e^d) S + P V';  S = S e^(d_L) + (k e^(d_L - d))^T V'
// every step but W is separable in the state's columns, done by blocks of kCB of them
template <typename T>
void chunk(const Rule<T>& r, int64_t t0, int64_t L, int64_t h, float* S, Scratch& x) {
  const int64_t Dk = r.Dk, Dv = r.Dv, hk = h / r.rep;
  float *q = x.q.data(), *k = x.k.data(), *w = x.w.data(), *a = x.a.data(), *p = x.p.data(), *d = x.d.data(),
        *b = x.b.data();
  float cum = 0.f;
  for (int64_t i = 0; i < L; ++i) {
    const int64_t t = t0 + i;
    l2norm(r.q + t * r.sq0 + hk * r.sq1, Dk, r.scale, q + i * Dk);
    l2norm(r.k + t * r.sk0 + hk * r.sk1, Dk, 1.f, k + i * Dk);
    d[i] = cum += r.g[t * r.Hv + h];
    b[i] = r.beta[t * r.Hv + h];
  }
  for (int64_t i = 0; i < L; ++i)
    for (int64_t j = 0; j <= i; ++j) {
      const float decay = std::exp(d[i] - d[j]);
      a[i * kChunk + j] = b[i] * dot(k + i * Dk, k + j * Dk, Dk) * decay;
      p[i * kChunk + j] = dot(q + i * Dk, k + j * Dk, Dk) * decay;
    }
  for (int64_t i = 0; i < L; ++i) {
    const float f = b[i] * std::exp(d[i]);
#pragma omp simd
    for (int64_t c = 0; c < Dk; ++c) w[i * Dk + c] = k[i * Dk + c] * f;
  }
  solve_unit_lower(a, w, L, Dk, Dk);
  const float dl = d[L - 1], el = std::exp(dl);
  for (int64_t i = 0; i < L; ++i) {  // q e^d, k e^(d_L - d) in place
    const float fq = std::exp(d[i]), fk = std::exp(dl - d[i]);
#pragma omp simd
    for (int64_t c = 0; c < Dk; ++c) {
      q[i * Dk + c] *= fq;
      k[i * Dk + c] *= fk;
    }
  }
  float *u = x.u.data(), *o = x.o.data();
  for (int64_t c0 = 0; c0 < Dv; c0 += kCB) {
    const int64_t nc = std::min(kCB, Dv - c0);
    for (int64_t i = 0; i < L; ++i) {
      const T* v = r.v + (t0 + i) * r.sv0 + h * r.sv1 + c0;
#pragma omp simd
      for (int64_t c = 0; c < nc; ++c) u[i * kCB + c] = static_cast<float>(v[c]) * b[i];
    }
    solve_unit_lower(a, u, L, nc, kCB);
    for (int64_t i = 0; i < L; ++i) {  // u -= W S; o = (q e^d) S
      float* ui = u + i * kCB;
      float* oi = o + i * kCB;
      std::fill(oi, oi + nc, 0.f);
      for (int64_t m = 0; m < Dk; ++m) {
        const float* Sm = S + m * Dv + c0;
        const float wm = w[i * Dk + m], qm = q[i * Dk + m];
#pragma omp simd
        for (int64_t c = 0; c < nc; ++c) {
          ui[c] -= wm * Sm[c];
          oi[c] += qm * Sm[c];
        }
      }
    }
    for (int64_t i = 0; i < L; ++i) {  // o += P V'
      float* oi = o + i * kCB;
      for (int64_t j = 0; j <= i; ++j) {
        const float pij = p[i * kChunk + j];
        const float* uj = u + j * kCB;
#pragma omp simd
        for (int64_t c = 0; c < nc; ++c) oi[c] += pij * uj[c];
      }
      T* out = r.out + ((t0 + i) * r.Hv + h) * Dv + c0;
      for (int64_t c = 0; c < nc; ++c) out[c] = round_to<T>(oi[c]);
    }
    for (int64_t m = 0; m < Dk; ++m) {  // S = S e^(d_L) + (k e^(d_L - d))^T V'
      float* Sm = S + m * Dv + c0;
#pragma omp simd
      for (int64_t c = 0; c < nc; ++c) Sm[c] *= el;
      for (int64_t i = 0; i < L; ++i) {
        const float km = k[i * Dk + m];
        const float* ui = u + i * kCB;
#pragma omp simd
        for (int64_t c = 0; c < nc; ++c) Sm[c] += km * ui[c];
      }
    }
  }
}

template <typename T>
void rule(const Rule<T>& r, const std::vector<int64_t>& starts, const std::vector<int64_t>& slots) {
  const int64_t num_seqs = slots.size(), Hv = r.Hv;
  at::parallel_for(0, num_seqs * Hv, 1, [&](int64_t begin, int64_t end) {
    Scratch x(r.Dk, r.Dv);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / Hv, h = task % Hv, a = starts[s], n = starts[s + 1] - a;
      float* S = r.state + (slots[s] * Hv + h) * r.Dk * r.Dv;
      if (n == 1)
        recurrent_step(r, a, h, S, x.q.data(), x.k.data());
      else
        for (int64_t c = 0; c < n; c += kChunk) chunk(r, a + c, std::min(kChunk, n - c), h, S, x);
    }
  });
}

// q, k: [n, Hk, Dk]; v: [n, Hv, Dv] (float32 or bfloat16, last dimension contiguous); g, beta: [n, Hv] float32;
// state: [num_slots, Hv, Dk, Dv] float32, updated in place; query_start_loc: [num_seqs + 1]; state_slots:
// [num_seqs] -> [n, Hv, Dv] in v's dtype. q and k are L2-normalised here, q scaled by Dk^-0.5.
at::Tensor gated_delta_rule_(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                             const at::Tensor& g_in, const at::Tensor& beta_in, at::Tensor& state,
                             const at::Tensor& query_start_loc, const at::Tensor& state_slots) {
  const auto dtype = v_in.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "v must be float32 or bfloat16");
  TORCH_CHECK(q_in.scalar_type() == dtype && k_in.scalar_type() == dtype, "q and k must be in v's dtype");
  TORCH_CHECK(q_in.dim() == 3 && k_in.sizes() == q_in.sizes() && v_in.dim() == 3, "q, k must be [n, Hk, Dk]");
  auto rows = [](const at::Tensor& t) { return t.stride(2) == 1 ? t : t.contiguous(); };
  const at::Tensor q = rows(q_in), k = rows(k_in), v = rows(v_in);
  const at::Tensor g = g_in.to(at::kFloat).contiguous(), beta = beta_in.to(at::kFloat).contiguous();
  const int64_t n = q.size(0), Hk = q.size(1), Dk = q.size(2), Hv = v.size(1), Dv = v.size(2);
  TORCH_CHECK(v.size(0) == n && Hv % Hk == 0, "v must be [n, Hv, Dv], Hv a multiple of Hk");
  TORCH_CHECK(g.sizes() == at::IntArrayRef({n, Hv}) && beta.sizes() == g.sizes(), "g, beta must be [n, Hv]");
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.is_contiguous() && state.dim() == 4 && state.size(1) == Hv &&
                  state.size(2) == Dk && state.size(3) == Dv,
              "state must be contiguous float32 [num_slots, Hv, Dk, Dv]");
  const auto starts = as_longs(query_start_loc), slots = as_longs(state_slots);
  check_batch(starts, slots, n, state.size(0));
  at::Tensor out = at::empty({n, Hv, Dv}, v.options());
  auto run = [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    const Rule<T> r{q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(), q.stride(0), q.stride(1), k.stride(0),
                    k.stride(1), v.stride(0), v.stride(1), g.data_ptr<float>(), beta.data_ptr<float>(),
                    state.data_ptr<float>(), out.data_ptr<T>(), Hv, Hv / Hk, Dk, Dv,
                    static_cast<float>(1.0 / std::sqrt(static_cast<double>(Dk)))};
    rule(r, starts, slots);
  };
  if (dtype == at::kFloat)
    run(static_cast<float*>(nullptr));
  else
    run(static_cast<c10::BFloat16*>(nullptr));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda, m) {
  m.def("causal_conv1d_(Tensor x, Tensor weight, Tensor(a!) conv_state, Tensor query_start_loc, "
        "Tensor state_slots) -> Tensor");
  m.def("gated_delta_rule_(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state, "
        "Tensor query_start_loc, Tensor state_slots) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) {
  m.impl("causal_conv1d_", &causal_conv1d_);
  m.impl("gated_delta_rule_", &gated_delta_rule_);
}
